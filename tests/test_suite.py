"""`python -m benchmarks.suite`: every scenario's plan, the runner's budget, chains and old tree, a CPU smoke run."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from benchmarks import suite  # noqa: E402
from benchmarks.providers.base import load_config  # noqa: E402
from benchmarks.scenarios import LONG_SEQS, SCENARIOS, Settings, Step, long_context_model  # noqa: E402

# The flags bench_train.py has taken since 9f0645c: a project row must run from an older tree too.
OLD_BENCH_TRAIN_FLAGS = {"--model", "--providers", "--batch", "--offload-batches", "--cap-gib", "--steps", "--warmup",
                         "--no-probe", "--timeout", "--seq", "--slide-config", "--device", "--json", "--commit"}


@pytest.mark.parametrize("smoke", [False, True])
@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_every_scenario_plans_runnable_steps(name, smoke, tmp_path):
    steps = SCENARIOS[name](Settings(smoke=smoke, workdir=tmp_path))
    assert steps and len({s.name for s in steps}) == len(steps)
    for step in steps:
        script = step.argv[0]
        assert script == "-m" or (REPO_ROOT / script).is_file(), script
        assert 0 < step.timeout <= suite.DEFAULT_BUDGET_S
        if step.kind == "train":
            assert script == "benchmarks/bench_train.py"
            timeout = float(step.argv[step.argv.index("--timeout") + 1])
            assert timeout < step.timeout  # the provider stops before the step is killed, its JSON written
            assert ("--device" in step.argv) == smoke
        if step.project and step.kind == "train":
            assert {a for a in step.argv if a.startswith("--")} <= OLD_BENCH_TRAIN_FLAGS


def test_scenario_contents(tmp_path):
    names = {k: [s.name for s in fn(Settings(workdir=tmp_path))] for k, fn in SCENARIOS.items()}
    assert names["quick"] == ["gpu_tests", "3b_b16_cap24", "3b_b8_cap24"]
    assert names["full"] == ["8b_b16_cap24", "q7b_b16_cap24", "3b_b16_cap24", "3b_b8_cap24"]
    assert names["small-gpu"] == ["8b_b16_cap12", "8b_b16_cap16", "3b_b16_cap9", "host_adam_rate"]
    assert names["long"] == ["8b_seq8k", "8b_seq16k", "8b_seq32k", "8b_seq64k", "8b_seq128k"]
    assert names["baselines"] == ["3b_b16_cap24", "hf_b16", "ds3_search", "ds2_search"]
    assert names["lora"] == ["8b_hf_lora_b16", "8b_slide_lora_b16_cap24", "8b_hf_lora_offload_b16_cap24",
                             "8b_hf_lora_offload_b8_cap24"]
    assert names["lora32"] == ["q32b_slide_lora_b8_cap24", "q32b_hf_lora_b8"]
    assert names["disk"] == ["disk_bandwidth", "8b_b16_cap24", "8b_b16_cap24_hml48"]
    assert names["disk12"] == ["disk_bandwidth", "nemo12b_b16_cap24_hml100"]
    hml = SCENARIOS["disk12"](Settings(workdir=tmp_path))[-1].argv
    assert json.loads(hml[hml.index("--slide-config") + 1])["host_memory_limit"] == 100
    base = {s.name: s.argv for s in SCENARIOS["baselines"](Settings(workdir=tmp_path))}
    for name in ("hf_b16", "ds2_search", "ds3_search"):
        argv = base[name]
        assert argv[argv.index("--checkpointing") + 1] == "on" and argv[argv.index("--kernels") + 1] == "auto"
    assert "--search-batches" in base["ds2_search"] and "--search-batches" not in base["hf_b16"]
    long = SCENARIOS["long"](Settings(workdir=tmp_path))
    assert [int(s.argv[s.argv.index("--seq") + 1]) for s in long] == list(LONG_SEQS)
    assert all(s.chain == "long" and s.argv[s.argv.index("--batch") + 1] == "1" for s in long)
    assert all(s.argv[s.argv.index("--cap-gib") + 1] == "24" for s in long)
    tiers = [json.loads(s.argv[s.argv.index("--slide-config") + 1]).get("activation_tier") for s in long]
    assert tiers == [None] * (len(long) - 1) + ["nvme"]      # 128k's inputs do not fit beside the 8B state


def test_long_context_config_copy_raises_max_positions(tmp_path):
    assert long_context_model("llama3-8b", 131072, tmp_path) == "llama3-8b"  # the real 8B config admits 128k
    path = long_context_model("tiny", 512, tmp_path)
    config = load_config(path)
    assert config.max_position_embeddings == 512 and config.hidden_size == load_config("tiny").hidden_size
    assert Path(path).parent == tmp_path


def _args(*argv: str, tmp_path: Path) -> object:
    return suite.parse_args([*argv, "--out", str(tmp_path / "out")])


def _fake_steps(monkeypatch, steps: list[Step]) -> None:
    monkeypatch.setitem(SCENARIOS, "quick", lambda s: steps)


def test_chain_stops_at_the_first_failure_and_old_tree_reruns_project_rows(monkeypatch, tmp_path):
    steps = [Step("a", ["x"], 60, project=True, chain="c"), Step("b", ["x"], 60, project=True, chain="c"),
             Step("c", ["x"], 60, project=True, chain="c"), Step("t", ["x"], 60)]
    _fake_steps(monkeypatch, steps)
    calls = []

    def fake_run_step(step, root, commit, workdir, timeout, label):
        calls.append((label, step.name, root, commit))
        return {"name": step.name, "tree": label, "status": "oom" if step.name == "b" else "ok", "seconds": 1}

    monkeypatch.setattr(suite, "run_step", fake_run_step)
    monkeypatch.setattr(suite, "old_worktree", lambda commit: (Path("/old"), "f" * 40))
    doc = suite.run_suite(_args("quick", "--old", "HEAD~1", tmp_path=tmp_path))
    assert [(c[0], c[1]) for c in calls] == [("new", "a"), ("new", "b"), ("new", "t"), ("old", "a"), ("old", "b")]
    assert calls[-1][2:] == (Path("/old"), "f" * 40)
    status = [(r["tree"], r["name"], r["status"]) for r in doc["steps"]]
    assert ("new", "c", "not run") in status and ("old", "c", "not run") in status
    text = suite.render(doc)
    assert "c (new): the last that trained: a; b: oom" in text and "c (old): the last that trained: a; b: oom" in text
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["quick.json", "quick.log"]


def test_budget_shortens_the_last_step_and_skips_the_rest(monkeypatch, tmp_path):
    clock = [0.0]
    monkeypatch.setattr(suite, "_now", lambda: clock[0])
    _fake_steps(monkeypatch, [Step("a", ["x"], 300), Step("b", ["x"], 300), Step("c", ["x"], 300)])
    given = []

    def fake_run_step(step, root, commit, workdir, timeout, label):
        given.append(timeout)
        clock[0] += timeout
        return {"name": step.name, "tree": label, "status": "ok", "seconds": timeout}

    monkeypatch.setattr(suite, "run_step", fake_run_step)
    doc = suite.run_suite(_args("quick", "--budget", "500", tmp_path=tmp_path))
    assert given == [300, 200] and [r["status"] for r in doc["steps"]] == ["ok", "ok", "not run"]


def test_run_step_kills_a_step_at_its_timeout(tmp_path):
    script = tmp_path / "sleepy.py"
    script.write_text("import subprocess, sys, time\nprint('started', flush=True)\n"
                      "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\ntime.sleep(60)\n")
    result = suite.run_step(Step("sleepy", [str(script)], 60), REPO_ROOT, None, tmp_path, 2.0, "new")
    assert result["status"] == "timeout" and result["seconds"] < 30 and result["last_line"].endswith("started")
    ok = suite.run_step(Step("echo", ["-c", "print('done')"], 60, tail=1), REPO_ROOT, None, tmp_path, 30, "new")
    assert ok["status"] == "ok" and ok["tail"] == ["done"]


def test_only_selects_steps_and_refuses_unknown_names(tmp_path):
    args = _args("long", "--only", "8b_seq64k,8b_seq128k", tmp_path=tmp_path)
    assert [s.name for s, _ in suite.plan(args, tmp_path)] == ["8b_seq64k", "8b_seq128k"]
    with pytest.raises(SystemExit, match="no step"):
        suite.plan(_args("long", "--only", "8b_seq1m", tmp_path=tmp_path), tmp_path)


def test_suite_smoke_run_on_cpu(tmp_path):
    """The real suite, end to end on the CPU: the long-context chain at tiny scale, its files and table."""
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.suite", "long", "--smoke", "--out", str(out)],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    doc = json.loads((out / "long.json").read_text())
    assert [(r["name"], r["status"]) for r in doc["steps"]] == [("8b_seq64", "ok"), ("8b_seq256", "ok")]
    rows = [r["rows"][0] for r in doc["steps"]]
    assert [r["seq"] for r in rows] == [64, 256] and all(r["tokens_per_s"] > 0 and r["host_rss_peak_gib"] > 0
                                                         for r in rows)
    assert doc["steps"][1]["doc"]["shape"]["seq"] == 256  # beyond tiny's 128 positions: the config copy
    assert "===== new:8b_seq256: ok" in (out / "long.log").read_text()
    lines = proc.stdout.strip().splitlines()
    assert lines[-4].startswith("| step") and lines[-1].startswith("| 8b_seq256")
    assert any(ln.startswith("long (new): the last that trained: 8b_seq256") for ln in lines)
    assert any(ln.startswith("  TFLOPS against 8b_seq64's: 8b_seq256 ") for ln in lines)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["baselines"])  # the others' scripts have CPU runs of their own
def test_scenario_runs_at_smoke_scale(name, tmp_path):
    """A scenario end to end on the CPU; only baselines missing their packages may be skipped."""
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.suite", name, "--smoke", "--out", str(out)],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    doc = json.loads((out / f"{name}.json").read_text())
    for step in doc["steps"]:
        rows = step.get("rows") or [{"provider": None, "status": step["status"]}]
        for row in rows:
            assert row["status"] == "ok" or (row["provider"] in ("ds2", "ds3") and row["status"] == "skipped"), \
                (step["name"], row, proc.stdout[-2000:])
    assert proc.stdout.strip().splitlines()[-1].startswith("|")
