"""Every script in examples/ runs: a CPU smoke test each, on a tiny model built from a config.

examples/train_accelerate.py runs through `accelerate launch` in
tests/test_accelerate.py::test_accelerate_launch_runs_the_example, and examples/notebook.ipynb in
tests/test_notebook.py; test_every_example_is_exercised keeps that list complete.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def run_example(name: str, *args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, str(EXAMPLES / name), *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def last_json(stdout: str) -> dict:
    return json.loads([line for line in stdout.splitlines() if line.startswith("{")][-1])


def test_every_example_is_exercised():
    tests = "".join(p.read_text(encoding="utf-8") for p in Path(__file__).parent.glob("test_*.py"))
    scripts = [p.name for p in EXAMPLES.iterdir() if p.suffix in (".py", ".ipynb")]
    assert scripts and [s for s in scripts if f'"{s}"' not in tests] == []


def test_finetune_tiny_trains_reports_and_saves(tmp_path):
    from transformers import AutoModelForCausalLM

    proc = run_example("finetune_tiny.py", "--steps", "30", "--log-every", "10", "--save", str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[-1].startswith("OK: fine-tuned in ") and "held-out loss" in lines[-1]
    assert any(line.startswith("greedy continuation: 'The lighthouse keeper") for line in lines)
    held_out = next(line for line in lines if line.startswith("held-out loss: "))
    before, after = (float(part.split()[0]) for part in held_out.removeprefix("held-out loss: ").split(", "))
    assert after < before - 1.0
    AutoModelForCausalLM.from_pretrained(tmp_path / "out")       # the export loads in plain HF


def test_finetune_tiny_answers_help_without_torch():
    code = ("import runpy, sys; sys.argv = ['finetune_tiny.py', '--help']\n"
            "try:\n    runpy.run_path(sys.argv[0], run_name='__main__')\nexcept SystemExit:\n    pass\n"
            "print('torch imported:', 'torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=EXAMPLES, capture_output=True, text=True, timeout=60)
    assert "--steps" in proc.stdout and proc.stdout.rstrip().endswith("torch imported: False")


def test_train_trainer_runs_shorter_than_logging_steps_and_resumes(tmp_path):
    """Four steps under the default logging_steps log no loss (the run still ends with its JSON line);
    a second run resumed from the first one's step-2 checkpoint trains only steps 3 and 4, to the same model."""
    common = ["--max_steps", "4", "--per_device_train_batch_size", "4", "--save_steps", "2", "--report_to", "none",
              "--samples", "32", "--use_cpu", "true"]
    first = run_example("train_trainer.py", "--output_dir", str(tmp_path / "a"), *common)
    assert first.returncode == 0, first.stderr[-3000:]
    a = last_json(first.stdout)
    assert a["losses"] == [] and a["global_step"] == 4 and a["train_loss"] > 0

    second = run_example("train_trainer.py", "--output_dir", str(tmp_path / "b"), *common,
                         "--resume_from_checkpoint", str(tmp_path / "a" / "checkpoint-2"))
    assert second.returncode == 0, second.stderr[-3000:]
    b = last_json(second.stdout)
    assert b["global_step"] == 4 and b["eval_loss"] == a["eval_loss"]     # exact resume: the same final weights
    assert [p.name for p in (tmp_path / "b").glob("checkpoint-*")] == ["checkpoint-4"]   # steps 3 and 4 only


def test_every_python_example_answers_help():
    """`--help` of an `HfArgumentParser(SlideArgs)` script formats every help text (a bare % broke it)."""
    for script in sorted(p.name for p in EXAMPLES.glob("*.py")):
        proc = run_example(script, "--help")
        assert proc.returncode == 0, f"{script} --help: {proc.stderr[-2000:]}"
        assert "usage" in proc.stdout.lower(), script
