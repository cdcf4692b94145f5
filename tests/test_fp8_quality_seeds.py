"""benchmarks/fp8_quality_seeds.py: the seed-mean curves of several fp8_quality.py runs, judged."""
import importlib
import json

import pytest

seeds = importlib.import_module("benchmarks.fp8_quality_seeds")
quality = importlib.import_module("benchmarks.fp8_quality")
from test_fp8_quality import TINY


def doc(seed, rows, stream="grammar"):
    return {"args": {"seed": seed, "warmup": 10, "train_stream": stream}, "rows": rows}


def rows(fp8_at_20):
    """bf16 and FP8 rows that differ only at step 20's train loss (FP8's there given)."""
    out = [{"step": 0, "bf16_train": None, "fp8_train": None, "bf16_held_out": 6.0, "fp8_held_out": 6.0}]
    for step, train, held in ((10, 3.0, 2.0), (20, 1.0, 0.9), (30, 0.8, 0.8)):
        out.append({"step": step, "bf16_train": train, "fp8_train": fp8_at_20 if step == 20 else train,
                    "bf16_held_out": held, "fp8_held_out": held})
    return out


def test_gaps_of_either_sign_average_out_and_their_spread_is_kept():
    """Seed 0 has FP8 3% above bf16 at step 20 and seed 1 3% below: each run alone misses 1.5%, the
    mean curves meet it, and the per-seed gaps are reported as the spread."""
    runs = [rows(1.03), rows(0.97)]
    assert not quality.judge(runs[0], 10, 0.015, memorizable=False)["met"]
    result = seeds.seed_verdicts([doc(0, runs[0]), doc(1, runs[1])], 0.015)
    assert result["seeds"] == [0, 1] and result["arms"] == ["fp8"]
    assert result["rows"][2]["fp8_train"] == pytest.approx(1.0) and result["rows"][0]["bf16_train"] is None
    assert result["verdicts"]["fp8"]["met"] and result["verdicts"]["fp8"]["train_max_gap"] == pytest.approx(0.0)
    assert seeds.gap_spread(runs, 20, "fp8", "train") == (pytest.approx(-0.03), pytest.approx(0.03))
    # a lag in every seed stays in the mean
    lagging = seeds.seed_verdicts([doc(0, rows(1.03)), doc(1, rows(1.02))], 0.015)["verdicts"]["fp8"]
    assert not lagging["met"] and lagging["train_max_gap"] == pytest.approx(0.025)


def test_runs_of_one_seed_are_refused(tmp_path):
    for n in (0, 1):
        (tmp_path / f"s{n}.json").write_text(json.dumps(doc(0, rows(1.0))))
    with pytest.raises(SystemExit, match="different seeds"):
        seeds.main([str(tmp_path / "s0.json"), str(tmp_path / "s1.json")])


def test_a_missing_or_foreign_file_is_named(tmp_path):
    (tmp_path / "trace.json").write_text("[]")                       # a step trace, not a quality run
    with pytest.raises(SystemExit, match="trace.json: not an fp8_quality.py result"):
        seeds.main([str(tmp_path / "trace.json"), str(tmp_path / "trace.json")])
    with pytest.raises(SystemExit, match="nope.json: not a readable JSON file"):
        seeds.main([str(tmp_path / "nope.json")])


def test_two_seeded_runs_end_to_end(tmp_path, capsys):
    files = []
    for seed in (0, 1):
        files.append(tmp_path / f"q{seed}.json")
        assert quality.main(["--steps", "4", "--warmup", "1", "--log-every", "2", "--lr", "1e-3", "--seed",
                             str(seed), "--json", str(files[-1]), *TINY]) == 0
    out = tmp_path / "seeds.json"
    assert seeds.main([str(f) for f in files] + ["--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["seeds"] == [0, 1] and [r["step"] for r in result["rows"]] == [0, 2, 4]
    one = [json.loads(f.read_text())["rows"] for f in files]
    assert result["rows"][-1]["fp8_held_out"] == pytest.approx((one[0][-1]["fp8_held_out"] + one[1][-1]["fp8_held_out"]) / 2)
    text = capsys.readouterr().out
    assert "fp8: mean curves" in text and "per seed" in text
    plot = importlib.import_module("benchmarks.fp8_quality_plot")      # the mean curves draw as one run's
    assert plot.svg(result).count("<polyline") == 6 and "entropy 0.7" in plot.svg(result)
