"""benchmarks/fp8_quality.py and fp8_quality_plot.py: the corpus split, the corpus's grammar and
the train stream drawn from it, the held-out loss, the control arm's start, the criterion, and
the run end to end on the CPU (the FP8 arm through the recipe's emulation)."""
import copy
import importlib
import itertools
import json
import math
import random

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


@pytest.fixture(scope="module")
def grammar():
    return quality.corpus_grammar()


def test_induce_grammar_finds_the_phrase_sets_of_a_product():
    roles = (["The red fox", "A cat", "Our old friend on the hill"], ["saw", "kept", "forgot"],
             ["the tall tree in the park", "a cup", "every small stone"],
             ["at noon", "with the dog in the rain", "twice"])
    made = [" ".join(parts) + "." for parts in itertools.product(*roles)]
    random.Random(0).shuffle(made)
    assert quality.induce_grammar(made[:50]) == tuple(sorted(r) for r in roles)     # 50 of the 81 sentences


def test_every_corpus_sentence_parses_one_way_into_the_grammar(grammar):
    assert [len(p) for p in grammar["phrases"]] == [16, 16, 16, 12]                   # docs/benchmarks.md
    assert "The baker on the corner" in grammar["phrases"][0] and "forgot" in grammar["phrases"][1]
    assert grammar["unparsed"] == [] and grammar["ambiguous"] == [] and grammar["corpus_sentences"] == 536
    assert grammar["paragraph_sizes"] == (3, 6)
    held = set()
    for i, para in enumerate(quality.corpus_paragraphs()):
        for sentence in quality.sentences(para):
            (parts,) = quality.parse(sentence, grammar["phrases"])
            assert quality.sentence_of(parts, grammar["phrases"]) == sentence
            if quality.is_held_out(i):
                held.add(parts)
    assert held == grammar["held_out"] and len(held) == 55
    assert quality.parse("The baker forgot a cup twice.", grammar["phrases"]) == []


def stream_paragraphs(tokenizer, stream):
    """The stream's whole paragraphs (the text between two <eos>), each as its sentences."""
    text = tokenizer.decode(stream.tolist())
    return [quality.sentences(p) for p in text.split(tokenizer.eos_token)[1:-1]]


def test_grammar_stream_is_seeded_new_text_of_the_grammar_in_the_vocab(tokenizer, grammar):
    stream, entropy = quality.grammar_stream(tokenizer, grammar, 20_000, seed=0)
    assert stream.shape == (20_000,) and stream.dtype == torch.long
    assert int(stream.min()) >= 0 and int(stream.max()) < len(tokenizer) <= 704
    assert torch.equal(stream, quality.grammar_stream(tokenizer, grammar, 20_000, seed=0)[0])
    assert not torch.equal(stream, quality.grammar_stream(tokenizer, grammar, 20_000, seed=1)[0])
    held = {quality.sentence_of(p, grammar["phrases"]) for p in grammar["held_out"]}
    paras = stream_paragraphs(tokenizer, stream)
    assert len(paras) > 250 and all(3 <= len(p) <= 6 for p in paras)
    drawn = [s for p in paras for s in p]
    assert not held & set(drawn)                                           # the held-out paragraphs stay unseen
    assert all(len(quality.parse(s, grammar["phrases"])) == 1 for s in drawn)
    assert len(set(drawn)) > 0.97 * len(drawn)                             # 49,097 sentences to draw from
    # the entropy: log 4 for a paragraph's size and log 49,097 for each sentence, over the tokens
    assert entropy == pytest.approx((math.log(4) + 4.5 * math.log(16 ** 3 * 12 - 55)) / (len(stream) / len(paras)),
                                    rel=0.05)
    assert 0.70 < entropy < 0.75


def test_grammar_stream_never_draws_an_excluded_sentence(tokenizer, grammar):
    g = dict(grammar, held_out={p for p in itertools.product(range(16), range(16), range(16), range(12))
                                if p[0] < 8})                                # half the sentences excluded
    stream, _ = quality.grammar_stream(tokenizer, g, 5_000, seed=0)
    subjects = {quality.parse(s, g["phrases"])[0][0] for p in stream_paragraphs(tokenizer, stream) for s in p}
    assert subjects == set(range(8, 16))


def test_grammar_batches_lay_the_windows_end_to_end():
    batches = quality.grammar_batches(torch.arange(1000), 4, 3, 16)
    assert [b.shape for b in batches] == [(3, 16)] * 4
    assert torch.equal(torch.cat([b.flatten() for b in batches]), torch.arange(192))   # no token seen twice
    with pytest.raises(ValueError, match="grammar stream"):
        quality.grammar_batches(torch.arange(100), 4, 3, 16)


def test_the_control_arm_starts_one_ulp_away():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, vocab_size=50)).bfloat16()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    quality.flip_last_bits(model, seed=3)
    changed = total = 0
    for name, p in model.named_parameters():
        diff = p.detach().view(torch.int16).int() - before[name].view(torch.int16).int()
        assert set(diff.unique().tolist()) <= {-1, 0, 1}                   # the last bit only
        changed, total = changed + int((diff != 0).sum()), total + diff.numel()
    assert 0.45 < changed / total < 0.55
    again = copy.deepcopy(model)
    for p, b in zip(again.parameters(), before.values()):
        p.data.copy_(b)
    quality.flip_last_bits(again, seed=3)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), again.parameters()))


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


def test_judge_reads_the_whole_run_where_nothing_can_be_memorized():
    rows = rows_of((0, None, None, 6.0, 6.0), (10, 3.0, 3.5, 2.0, 2.01), (20, 1.2, 1.21, 1.0, 1.01),
                   (30, 0.9, 0.905, 0.95, 0.951), (40, 0.8, 0.801, 0.9, 0.9))
    verdict = quality.judge(rows, warmup=10, tolerance=0.015, memorizable=False)
    assert verdict["learning_end"] == 40 and verdict["held_out_steps_judged"] == [20, 30, 40]
    assert verdict["train_steps_judged"] == [20, 30, 40]                # below the lowest held-out too
    assert verdict["held_out_max_gap"] == pytest.approx(0.01) and verdict["memorizing_max_gap"] == 0.0
    assert verdict["met"]
    rows[4]["fp8_train"] = 0.82                                    # 2.5% apart below the floor: judged here
    assert not quality.judge(rows, warmup=10, tolerance=0.015, memorizable=False)["met"]
    assert quality.judge(rows, warmup=10, tolerance=0.015)["met"]            # and not with the corpus stream
    control = [dict(r, control_train=r["bf16_train"], control_held_out=r["bf16_held_out"] * 1.001) for r in rows]
    mine = quality.judge(control, warmup=10, tolerance=0.015, memorizable=False, other="control")
    assert mine["held_out_max_gap"] == pytest.approx(0.001) and mine["train_max_gap"] == 0.0


def test_run_logs_both_losses_for_every_arm_and_plots_them(tmp_path):
    out = tmp_path / "q.json"
    assert quality.main(["--steps", "6", "--warmup", "1", "--log-every", "2", "--lr", "1e-3", "--control",
                         "--json", str(out), *TINY]) == 0
    doc = json.loads(out.read_text())
    assert doc["steps_run"] == 6 and [r["step"] for r in doc["rows"]] == [0, 2, 4, 6]
    assert len(doc["bf16"]["train"]) == len(doc["fp8"]["train"]) == len(doc["control"]["train"]) == 6
    assert doc["bf16"]["train"] != doc["fp8"]["train"] and doc["bf16"]["train"] != doc["control"]["train"]
    stream = doc["stream"]
    assert stream["kind"] == "grammar" and doc["split"]["train_tokens"] == 6 * 2 * 32
    assert stream["phrase_sets"] == {"subject": 16, "verb": 16, "object": 16, "ending": 12}
    assert stream["sentences"] == 49_152 and stream["held_out_sentences"] == 55 and stream["unparsed"] == []
    assert 0.7 < stream["entropy_floor"] < 0.75
    last = doc["rows"][-1]
    assert last["bf16_train"] == pytest.approx(sum(doc["bf16"]["train"][4:6]) / 2)
    assert last["bf16_held_out"] < doc["rows"][0]["bf16_held_out"]                # it learns
    verdict = doc["verdict"]
    assert verdict["met"] and 0 < verdict["held_out_max_gap"] < 0.015 and doc["fp8_emulated"]
    assert verdict["held_out_steps_judged"] == verdict["train_steps_judged"] == [2, 4, 6]   # the whole run
    assert 0 < verdict["control"]["held_out_max_gap"] < 0.015 and not verdict["control"]["memorizable"]
    svg = plot.svg(doc)
    assert svg.startswith("<svg") and svg.count("<polyline") == 8          # 2 panels x 3 arms, the entropy twice
    assert "entropy 0.7" in svg
    assert plot.main([str(out), str(tmp_path / "q.svg")]) == 0 and (tmp_path / "q.svg").read_text() == svg


def test_out_of_time_the_fp8_arm_makes_the_bf16_arms_steps_on_the_corpus_stream(tmp_path):
    out = tmp_path / "q.json"
    assert quality.main(["--steps", "4", "--warmup", "0", "--log-every", "1", "--max-seconds", "0",
                         "--train-stream", "corpus", "--json", str(out), *TINY]) == 0
    doc = json.loads(out.read_text())
    assert doc["steps_run"] == len(doc["bf16"]["train"]) == len(doc["fp8"]["train"]) == 1
    assert [r["step"] for r in doc["rows"]] == [0, 1]
    assert doc["stream"] == {"kind": "corpus"} and doc["split"]["train_tokens"] == 7405
    assert doc["verdict"]["memorizable"] and "control" not in doc
    svg = plot.svg(doc)
    assert svg.count("<polyline") == 6 and "floor " in svg and "lowest, step" in svg   # 2 panels x 2 arms


def test_further_recipes_run_as_arms_of_their_own(tmp_path):
    out = tmp_path / "q.json"
    assert quality.main(["--steps", "4", "--warmup", "1", "--log-every", "2", "--lr", "1e-3", "--recipes",
                         "fp8,fp8_gw_hp", "--json", str(out), *TINY]) == 0
    doc = json.loads(out.read_text())
    assert len(doc["fp8_gw_hp"]["train"]) == len(doc["fp8"]["train"]) == 4
    assert doc["fp8_gw_hp"]["train"] != doc["fp8"]["train"]            # another backward, another run
    assert "fp8_gw_hp_held_out" in doc["rows"][-1] and "met" in doc["verdict"]["fp8_gw_hp"]
    assert plot.svg(doc).count("<polyline") == 8                       # 2 panels x 3 arms, the entropy twice


def test_the_resident_arm_trains_the_plain_model_and_is_judged_against_its_own_bf16(tmp_path):
    args = quality.parse_args(["--steps", "4", "--log-every", "2", "--lr", "1e-3", "--warmup", "1",
                               "--json", str(tmp_path / "x.json"), *TINY])
    gen = torch.Generator().manual_seed(0)
    data = [torch.randint(0, 600, (2, 32), generator=gen) for _ in range(4)]
    blocks = torch.randint(0, 600, (2, 32), generator=gen)
    arm = quality.train_resident_arm(args, "resident", data, blocks, "cpu")
    assert len(arm["train"]) == 4 and sorted(arm["held_out"]) == [0, 2, 4]
    assert arm["held_out"][4] < arm["held_out"][0]                      # it learns
    rows = rows_of((0, None, None, 6.0, 6.0), (10, 3.0, 3.0, 2.0, 2.0), (20, 1.0, 1.0, 1.0, 1.0))
    for r in rows:                                                      # torchao 3% off its own bf16 at step 20
        r["resident_bf16_train"], r["resident_bf16_held_out"] = r["bf16_train"], r["bf16_held_out"]
        r["torchao_train"] = None if r["bf16_train"] is None else r["bf16_train"] * (1.03 if r["step"] == 20 else 1)
        r["torchao_held_out"] = r["bf16_held_out"]
    verdict = quality.judge(rows, 5, 0.015, memorizable=False, other="torchao", base="resident_bf16")
    assert verdict["train_max_gap"] == pytest.approx(0.03) and verdict["train_max_step"] == 20 and not verdict["met"]


def test_the_torchao_arms_need_torchao(tmp_path, monkeypatch):
    import builtins
    real = builtins.__import__

    def no_torchao(name, *args, **kwargs):
        if name.startswith("torchao"):
            raise ImportError("No module named 'torchao'")
        return real(name, *args, **kwargs)
    monkeypatch.setattr(builtins, "__import__", no_torchao)
    with pytest.raises(SystemExit, match="torchao"):
        quality.main(["--steps", "2", "--warmup", "0", "--log-every", "1", "--torchao", "--json",
                      str(tmp_path / "q.json"), *TINY])
