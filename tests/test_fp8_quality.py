"""benchmarks/fp8_quality.py and fp8_quality_plot.py: the corpus split, the held-out loss, the
criterion, and the run end to end on the CPU (the FP8 arm through the recipe's emulation)."""
import copy
import importlib
import json

import pytest
import torch

quality = importlib.import_module("benchmarks.fp8_quality")
plot = importlib.import_module("benchmarks.fp8_quality_plot")

TINY = ["--batch", "2", "--seq", "32", "--hidden", "64", "--layers", "2", "--heads", "4", "--kv-heads", "2",
        "--intermediate", "128", "--vocab", "704", "--device", "cpu", "--emulate"]


@pytest.fixture(scope="module")
def tokenizer():
    from hf_slideformer.demo import train_tokenizer
    return train_tokenizer(vocab_size=4096)


def test_split_holds_out_every_tenth_paragraph(tokenizer, tmp_path):
    paras = [f"paragraph number {i} says something {'odd' if i % 2 else 'even'}." for i in range(25)]
    path = tmp_path / "corpus.txt"
    path.write_text("\n\n".join(paras) + "\n")
    train, held = quality.corpus_split(tokenizer, str(path))
    ids = [tokenizer(p)["input_ids"] + [tokenizer.eos_token_id] for p in paras]
    assert held.tolist() == ids[9] + ids[19]
    assert train.tolist() == [t for i, p in enumerate(ids) if i not in (9, 19) for t in p]


def test_bundled_split_is_the_documented_one(tokenizer):
    train, held = quality.corpus_split(tokenizer)
    assert (train.numel(), held.numel(), len(tokenizer)) == (7405, 841, 695)      # docs/benchmarks.md


def test_train_batches_are_seeded_windows_of_the_train_stream():
    stream = torch.arange(1000)
    first = quality.train_batches(stream, 5, 3, 16, seed=0)
    assert [b.shape for b in first] == [(3, 16)] * 5
    assert all(torch.equal(b, c) for b, c in zip(first, quality.train_batches(stream, 5, 3, 16, seed=0)))
    assert not all(torch.equal(b, c) for b, c in zip(first, quality.train_batches(stream, 5, 3, 16, seed=1)))
    for row in torch.cat(first):                                   # consecutive tokens: one window each
        assert torch.equal(row, torch.arange(row[0], row[0] + 16))
    with pytest.raises(ValueError, match="train split"):
        quality.train_batches(torch.arange(16), 1, 1, 16, seed=0)


def test_held_out_blocks_are_whole_and_drop_the_tail():
    blocks = quality.held_out_blocks(torch.arange(70), 32)
    assert torch.equal(blocks, torch.arange(64).view(2, 32))
    with pytest.raises(ValueError, match="held-out split"):
        quality.held_out_blocks(torch.arange(20), 32)


def test_held_out_loss_is_the_mean_over_blocks_of_the_plain_model():
    import hf_slideformer as hs
    from hf_slideformer.demo import tiny_config
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(tiny_config(vocab_size=97), attn_implementation="sdpa").float()
    slid = hs.slide(copy.deepcopy(ref), hs.SlideConfig(device="cpu", dtype=torch.float32))
    blocks = torch.randint(0, 97, (3, 24))
    with torch.no_grad():
        expected = sum(ref(input_ids=b[None], labels=b[None]).loss.item() for b in blocks) / 3
    assert quality.held_out_loss(slid, blocks, "cpu") == pytest.approx(expected, rel=1e-5)
    slid.slide_engine.close()


def rows_of(*values):
    """Logged rows from (step, bf16 train, fp8 train, bf16 held-out, fp8 held-out) tuples."""
    keys = ("step", "bf16_train", "fp8_train", "bf16_held_out", "fp8_held_out")
    return [dict(zip(keys, v)) for v in values]


def test_judge_reads_the_learning_phase_and_fp8_above_bf16_after_it():
    rows = rows_of((0, None, None, 6.0, 6.0), (10, 3.0, 3.5, 2.0, 2.01), (20, 1.2, 1.21, 1.0, 1.01),
                   (30, 0.5, 0.9, 1.1, 1.05), (40, 0.3, 0.2, 1.3, 1.31))
    verdict = quality.judge(rows, warmup=10, tolerance=0.015)
    assert verdict["floor"] == 1.0 and verdict["best_step"] == 20
    assert verdict["held_out_steps_judged"] == [20] and verdict["train_steps_judged"] == [20]
    assert verdict["held_out_max_gap"] == pytest.approx(0.01) and verdict["held_out_max_step"] == 20
    assert verdict["train_max_gap"] == pytest.approx(0.01 / 1.2)
    assert verdict["memorizing_max_gap"] == pytest.approx(0.05 / 1.1) and verdict["memorizing_max_step"] == 30
    assert verdict["fp8_max_excess"] == pytest.approx(0.01) and verdict["fp8_not_worse"] and verdict["met"]
    rows[2]["fp8_held_out"] = 1.03                                 # 3% above while learning
    assert not quality.judge(rows, warmup=10, tolerance=0.015)["met"]
    rows[2]["fp8_held_out"] = 0.97                                 # 3% below while learning: apart
    lower = quality.judge(rows, warmup=10, tolerance=0.015)
    assert not lower["met"] and lower["fp8_not_worse"]
    rows[2]["fp8_held_out"] = 1.01
    rows[4]["fp8_held_out"] = 1.4                                  # 8% above while memorizing
    late = quality.judge(rows, warmup=10, tolerance=0.015)
    assert not late["met"] and not late["fp8_not_worse"] and late["memorizing_max_step"] == 40
    rows[4]["fp8_held_out"] = 1.31
    rows[2]["fp8_train"] = 1.3                                     # above the floor: judged
    assert not quality.judge(rows, warmup=10, tolerance=0.015)["met"]


def test_run_logs_both_losses_for_both_arms_and_plots_them(tmp_path):
    out = tmp_path / "q.json"
    assert quality.main(["--steps", "6", "--warmup", "1", "--log-every", "2", "--lr", "1e-3", "--json", str(out),
                         *TINY]) == 0
    doc = json.loads(out.read_text())
    assert doc["steps_run"] == 6 and [r["step"] for r in doc["rows"]] == [0, 2, 4, 6]
    assert len(doc["bf16"]["train"]) == len(doc["fp8"]["train"]) == 6 and doc["bf16"]["train"] != doc["fp8"]["train"]
    last = doc["rows"][-1]
    assert last["bf16_train"] == pytest.approx(sum(doc["bf16"]["train"][4:6]) / 2)
    assert last["bf16_held_out"] < doc["rows"][0]["bf16_held_out"]                # it learns
    verdict = doc["verdict"]
    assert verdict["met"] and 0 < verdict["held_out_max_gap"] < 0.015 and doc["fp8_emulated"]
    svg = plot.svg(doc)
    assert svg.startswith("<svg") and svg.count("<polyline") == 6          # 2 panels x 2 arms, the floor, the lowest
    assert plot.main([str(out), str(tmp_path / "q.svg")]) == 0 and (tmp_path / "q.svg").read_text() == svg


def test_out_of_time_the_fp8_arm_makes_the_bf16_arms_steps(tmp_path):
    out = tmp_path / "q.json"
    assert quality.main(["--steps", "4", "--warmup", "0", "--log-every", "1", "--max-seconds", "0", "--json", str(out),
                         *TINY]) == 0
    doc = json.loads(out.read_text())
    assert doc["steps_run"] == len(doc["bf16"]["train"]) == len(doc["fp8"]["train"]) == 1
    assert [r["step"] for r in doc["rows"]] == [0, 1]
