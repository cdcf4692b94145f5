"""SlideAccelerator / SlidePlugin: the custom Accelerate loop against plain Accelerate, and the real launcher."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from accelerate.commands.config import load_config_from_file
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.state import AcceleratorState, GradientState
from torch.utils.data import DataLoader

from hf_slideformer import CheckpointError
from hf_slideformer.accelerate_plugin import SlideAccelerator, SlidePlugin

from test_trainer import ATOL, RTOL, assert_same_params, tiny_data, tiny_model

ROOT = Path(__file__).resolve().parents[1]
YAML = ROOT / "examples" / "slideformer.yaml"


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def loop(accelerator, model, optimizer, clip):
    """The standard Accelerate loop: 10 batches, accumulation, clipping, a scheduler, a partial last window."""
    loader = DataLoader(tiny_data(20), batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(0))
    sched = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
    model, optimizer, loader, sched = accelerator.prepare(model, optimizer, loader, sched)
    losses = []
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), clip)
            optimizer.step()
            sched.step()
            optimizer.zero_grad()
        losses.append(loss.item())
    return losses, optimizer


def test_slide_accelerator_matches_plain_accelerate():
    ref, model = tiny_model(), tiny_model()
    want, _ = loop(Accelerator(cpu=True, gradient_accumulation_steps=3), ref,
                   torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0), clip=0.05)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    acc = SlideAccelerator(cpu=True, slide_plugin=SlidePlugin(gradient_accumulation_steps=3, max_grad_norm=0.05))
    model = acc.slide(model)
    got, opt = loop(acc, model, model.create_optimizer(lr=1e-2), clip=0.05)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=RTOL, atol=ATOL)
    # A rarely seen embedding row has |g| ~ eps-scale elements where Adam's m / sqrt(v) amplifies
    # summation-order noise: 1e-4 is a hundredth of one lr=1e-2 update.
    assert_same_params(model, ref, atol=1e-4)
    assert model.slide_stats()["steps"] == math.ceil(10 / 3)             # the partial last window stepped too
    assert isinstance(opt, AcceleratedOptimizer) and opt.device_placement is False


def test_clip_must_be_configured_up_front():
    acc = SlideAccelerator(cpu=True, slide_plugin=SlidePlugin())
    model = acc.slide(tiny_model())
    opt = model.create_optimizer(lr=1e-3)
    model, opt = acc.prepare(model, opt)
    model(**{k: torch.stack([d[k] for d in tiny_data(2)]) for k in ("input_ids", "labels")}).loss.backward()
    with pytest.raises(ValueError, match="max_grad_norm"):
        acc.clip_grad_norm_(model.parameters(), 1.0)


def test_unslid_model_is_refused():
    acc = SlideAccelerator(cpu=True, slide_plugin=SlidePlugin())
    with pytest.raises(ValueError, match="not slid"):
        acc.prepare(tiny_model())


@pytest.mark.parametrize("env, match", [({"ACCELERATE_USE_DEEPSPEED": "true"}, "DeepSpeed"),
                                        ({"ACCELERATE_USE_FSDP": "1"}, "FSDP")])
def test_launch_environment_is_checked(monkeypatch, env, match):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises((ValueError, RuntimeError), match=match):
        SlideAccelerator(cpu=True, slide_plugin=SlidePlugin())


def test_the_yaml_is_valid_for_accelerate_and_for_the_plugin():
    cfg = load_config_from_file(str(YAML))                 # Accelerate's own loader rejects unknown keys
    assert cfg.num_processes == 1
    plugin = SlidePlugin.from_yaml(str(YAML))
    assert (plugin.gradient_accumulation_steps, plugin.max_grad_norm, plugin.window) == (2, 1.0, 2)
    with pytest.raises(ValueError, match="unknown slideformer setting"):
        SlidePlugin.from_dict({"windw": 3})
    with pytest.raises(ValueError, match="activation_tier"):
        SlidePlugin(activation_tier="disk")
    assert SlidePlugin.from_dict({"device_update_share": "0.5"}).to_slide_config("cpu").device_update_share == 0.5
    with pytest.raises(ValueError, match="device_update_share"):
        SlidePlugin.from_dict({"device_update_share": "most"}).to_slide_config("cpu")


def test_accelerate_launch_runs_the_example(tmp_path):
    """The documented command, in a subprocess: settings from the yaml, threads despite OMP_NUM_THREADS=1."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "OMP_NUM_THREADS"))}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(YAML),
           str(ROOT / "examples" / "train_accelerate.py"), "--output_dir", str(tmp_path / "out")]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])
    assert out["gradient_accumulation_steps"] == 2 and out["max_grad_norm"] == 1.0
    assert out["optimizer_steps"] == 8 and out["dtype"] == "torch.bfloat16"
    assert out["losses"][-1] < out["losses"][0] and out["eval_loss"] < out["losses"][0]
    assert out["omp_num_threads"] == "1"
    assert out["cpu_optimizer_threads"] == os.cpu_count()      # the worker's own count, not OMP's 1
    assert (tmp_path / "out" / "model.safetensors").exists()


def test_save_state_and_load_state_resume_exactly(tmp_path):
    """accelerator.save_state / load_state: the slid model's state goes per unit (no whole-optimizer
    pickle), and 3 steps + save + load + 3 steps equals 6 steps."""
    make, steps = _accelerate_run, _train
    data = tiny_data(6)
    acc, model, opt, sched = make()
    steps(model, opt, sched, data)
    want = {k: v.clone() for k, v in model.state_dict().items()}

    acc, model, opt, sched = make()
    steps(model, opt, sched, data[:3])
    acc.save_state(str(tmp_path / "ckpt"))
    files = os.listdir(tmp_path / "ckpt")
    assert "slide_state" in files and not [f for f in files if f.startswith("optimizer")], files
    acc, model, opt, sched = make()
    acc.load_state(str(tmp_path / "ckpt"))
    steps(model, opt, sched, data[3:])
    got = model.state_dict()
    for k in want:
        assert torch.equal(got[k], want[k]), k


def _accelerate_run():
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    acc = SlideAccelerator(cpu=True, slide_plugin=SlidePlugin(max_grad_norm=0.5))
    model = acc.slide(tiny_model())
    opt = model.create_optimizer(lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    model, opt, sched = acc.prepare(model, opt, sched)
    return acc, model, opt, sched


def _train(model, opt, sched, data):
    for b in data:
        model(**{k: v[None] for k, v in b.items()}).loss.backward()
        opt.step(); sched.step(); opt.zero_grad()


def test_save_state_killed_at_every_step_loads_old_or_new(tmp_path):
    """save_state over an earlier state, killed at each file-system step in turn: load_state restores
    the earlier state or the new one (never a mix of layers); a file of the user's stays."""
    import shutil

    from kill_points import every_kill

    data = tiny_data(4)
    acc, model, opt, sched = _accelerate_run()
    _train(model, opt, sched, data[:2])
    base = tmp_path / "base"
    acc.save_state(str(base))
    (base / "notes.txt").write_text("mine")
    old = {k: v.clone() for k, v in model.state_dict().items()}
    _train(model, opt, sched, data[2:])
    new = {k: v.clone() for k, v in model.state_dict().items()}
    work = tmp_path / "run" / "state"

    def prepare():
        shutil.rmtree(tmp_path / "run", ignore_errors=True)
        shutil.copytree(base, work)

    seen = []
    for step, _ in every_kill(prepare, lambda: acc.save_state(str(work))):
        acc2, model2, _, _ = _accelerate_run()
        acc2.load_state(str(work))
        got = model2.state_dict()
        is_old, is_new = (all(torch.equal(got[k], ref[k]) for k in ref) for ref in (old, new))
        assert is_old or is_new, f"killed at step {step}: the loaded state mixes the two saves"
        seen.append("old" if is_old else "new")
        assert (work / "notes.txt").read_text() == "mine"
        assert os.listdir(tmp_path / "run") == ["state"]
    assert seen[0] == "old" and seen[-1] == "new" and len(seen) > 5, seen


def test_load_state_refuses_a_half_written_state(tmp_path):
    acc, model, opt, sched = _accelerate_run()
    _train(model, opt, sched, tiny_data(1))
    acc.save_state(str(tmp_path / "s"))
    (tmp_path / "s" / "slide_state" / "index.json").unlink()      # as a save killed before its end leaves it
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match="index.json is missing"):
        acc.load_state(str(tmp_path / "s"))
    after = model.state_dict()
    assert all(torch.equal(after[k], before[k]) for k in before)   # refused before anything was loaded


def test_save_state_with_automatic_checkpoint_naming(tmp_path):
    """Accelerate names the folders (checkpoint_0, checkpoint_1, ...); each is complete and loads."""
    from accelerate.utils import ProjectConfiguration

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    project = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True)
    acc = SlideAccelerator(cpu=True, slide_plugin=SlidePlugin(), project_config=project)
    model = acc.slide(tiny_model())
    opt = model.create_optimizer(lr=1e-2)
    model, opt = acc.prepare(model, opt)
    _train(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0), tiny_data(1))
    first = acc.save_state()
    want = {k: v.clone() for k, v in model.state_dict().items()}
    _train(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0), tiny_data(2)[1:])
    second = acc.save_state()
    assert os.path.basename(first) == "checkpoint_0" and os.path.basename(second) == "checkpoint_1"
    assert os.path.isfile(os.path.join(second, "slide_state", "index.json"))
    acc.load_state(first)
    got = model.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)
