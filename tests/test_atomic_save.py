"""Crash consistency: a save killed at every file-system step in turn leaves the old save or the
new one, never neither, never a mix (`atomic_save.py`, `checkpoint.save_model`)."""
import json
import os
import shutil
import stat

import pytest
import torch
from transformers import AutoModelForCausalLM

import hf_slideformer as hs
from hf_slideformer.checkpoints.atomic_save import leftover_path, recover_directories, staged_directory

from helpers import batches, make_pair
from kill_points import every_kill

CPU = hs.SlideConfig(device="cpu")


def _trained(steps):
    _, slid = make_pair("qwen2", False)
    opt = slid.create_optimizer(lr=1e-2)
    for b in batches(steps):
        slid(**b).loss.backward(); opt.step(); opt.zero_grad()
    return slid


def _loaded(path):
    """What both loaders read from `path`, as fp32 values (each must load)."""
    hf = AutoModelForCausalLM.from_pretrained(path)
    slid = hs.SlideModel.from_pretrained(path, slide_config=CPU)
    out = ({k: v.float() for k, v in hf.state_dict().items()}, {k: v.clone() for k, v in slid.state_dict().items()})
    slid.slide_engine.close()
    return out


def _which(sd, old, new):
    """'old' or 'new' when every tensor of `sd` equals that save's; fails on a mix."""
    is_old = all(torch.equal(sd[k], old[k]) for k in old)
    is_new = all(torch.equal(sd[k], new[k]) for k in new)
    assert is_old or is_new, "the directory loads as a mix of the two saves"
    return "old" if is_old else "new"


def _assert_clean(path):
    entries = os.listdir(path)
    assert not [e for e in entries if e.startswith(".")], entries
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(os.path.join(path, "model.safetensors")):
        referenced = {"model.safetensors"}
        assert not os.path.exists(index)
    else:
        referenced = set(json.load(open(index))["weight_map"].values())
    assert {e for e in entries if e.endswith(".safetensors")} == referenced


@pytest.mark.parametrize("old_fmt, new_fmt", [
    (("5GB", torch.float32), ("5GB", torch.float32)),          # one file over one file
    (("20KB", torch.float32), ("20KB", torch.float32)),        # shards over shards of the same names
    (("5GB", torch.bfloat16), ("20KB", torch.float32)),        # shards over one file, a wider dtype
    (("20KB", torch.float32), ("5GB", torch.bfloat16)),        # one file over shards, a narrower dtype
])
def test_save_pretrained_killed_at_every_step_loads_old_or_new(tmp_path, old_fmt, new_fmt):
    old_model, new_model = _trained(1), _trained(2)
    base, ref_new, work = tmp_path / "base", tmp_path / "ref_new", tmp_path / "work"
    old_model.save_pretrained(base, max_shard_size=old_fmt[0], dtype=old_fmt[1])
    (base / "tokenizer_config.json").write_text("{}")              # a file of the user's: kept
    new_model.save_pretrained(ref_new, max_shard_size=new_fmt[0], dtype=new_fmt[1])
    old, new = _loaded(base), _loaded(ref_new)

    def prepare():
        shutil.rmtree(work, ignore_errors=True)
        shutil.copytree(base, work)

    seen = []
    for step, killed in every_kill(prepare, lambda: new_model.save_pretrained(work, max_shard_size=new_fmt[0],
                                                                              dtype=new_fmt[1])):
        hf_sd, slide_sd = _loaded(work)
        got = (_which(hf_sd, old[0], new[0]), _which(slide_sd, old[1], new[1]))
        assert got[0] == got[1], f"step {step}: AutoModelForCausalLM reads {got[0]}, SlideModel {got[1]}"
        assert (work / "tokenizer_config.json").exists()
        seen.append(got[0])
        if killed:                                 # the next save removes what the killed one left
            new_model.save_pretrained(work, max_shard_size=new_fmt[0], dtype=new_fmt[1])
            assert _which(_loaded(work)[1], old[1], new[1]) == "new"
        _assert_clean(work)
    assert seen[0] == "old" and seen[-1] == "new" and len(seen) > 4, seen
    assert seen == sorted(seen, key=["old", "new"].index), seen      # once new, never old again


def _tree(path):
    return {os.path.relpath(os.path.join(r, f), path): open(os.path.join(r, f)).read()
            for r, _, fs in os.walk(path) for f in fs}


@pytest.mark.parametrize("merge", [False, True])
def test_staged_directory_killed_at_every_step_recovers_old_or_new(tmp_path, merge):
    final, base = tmp_path / "run" / "state", tmp_path / "base"
    base.mkdir()
    (base / "a.txt").write_text("old")
    (base / "sub").mkdir()
    (base / "sub" / "b.txt").write_text("old")
    (base / "notes.txt").write_text("user")
    old = _tree(base)
    new = {"a.txt": "new", "sub/b.txt": "new", "c.txt": "new"} | ({"notes.txt": "user"} if merge else {})

    def prepare():
        shutil.rmtree(tmp_path / "run", ignore_errors=True)
        shutil.copytree(base, final)

    def save():
        with staged_directory(str(final), merge=merge) as tmp:
            for name in ("a.txt", "sub/b.txt", "c.txt"):
                os.makedirs(os.path.dirname(os.path.join(tmp, name)), exist_ok=True)
                with open(os.path.join(tmp, name), "w") as f:
                    f.write("new")

    run, snap = tmp_path / "run", tmp_path / "snapshot"

    def restore_killed_state():
        shutil.rmtree(run, ignore_errors=True)
        shutil.copytree(snap, run, symlinks=True)

    seen = []
    for step, killed in every_kill(prepare, save):
        shutil.rmtree(snap, ignore_errors=True)
        shutil.copytree(run, snap, symlinks=True)
        outcomes = set()
        for _ in every_kill(restore_killed_state, lambda: recover_directories(str(run))):
            recover_directories(str(run))             # a recovery killed midway is finished by the next
            got = _tree(final)
            assert got in (old, new), (step, got)
            outcomes.add("old" if got == old else "new")
            assert os.listdir(run) == ["state"], os.listdir(run)
        assert len(outcomes) == 1, f"step {step}: a killed recovery changed the outcome {outcomes}"
        seen.append(outcomes.pop())
    assert seen[0] == "old" and seen[-1] == "new" and "new" in seen[:-1], seen


def test_staged_directory_follows_the_umask_and_spares_live_saves(tmp_path):
    old_mask = os.umask(0o022)
    try:
        with staged_directory(str(tmp_path / "ckpt")) as tmp:
            open(os.path.join(tmp, "f"), "w").close()
    finally:
        os.umask(old_mask)
    assert stat.S_IMODE(os.stat(tmp_path / "ckpt").st_mode) == 0o755
    live = leftover_path(str(tmp_path), "tmp", "other").replace(f".{os.getpid()}.", f".{os.getppid()}.")
    os.mkdir(live)                                     # another live process of this host is saving
    dead = leftover_path(str(tmp_path), "tmp", "ckpt2")
    os.mkdir(dead)                                     # this process's own leftover: a killed save
    recover_directories(str(tmp_path))
    assert os.path.isdir(live) and not os.path.exists(dead)


_SAVER = """
import sys, torch, hf_slideformer as hs
sys.path.insert(0, {tests!r})
from helpers import batches, make_pair
_, m = make_pair("qwen2", False)
opt = m.create_optimizer(lr=1e-2)
states = []
for b in batches(2):
    m(**b).loss.backward(); opt.step(); opt.zero_grad()
    states.append({{k: v.clone() for k, v in m.state_dict().items()}})
shards = ["20KB", "5GB"]
for i, sd in enumerate(states):
    m.load_state_dict(sd)
    m.save_pretrained({ref!r} + str(i), max_shard_size=shards[i])
print("ready", flush=True)
i = 0
while True:                                       # alternate the two states and formats until killed
    m.load_state_dict(states[i % 2])
    m.save_pretrained({work!r}, max_shard_size=shards[i % 2])
    i += 1
"""


@pytest.mark.slow
def test_save_pretrained_survives_real_sigkills(tmp_path):
    """SIGKILL at random moments of back-to-back saves: the directory always loads as one of them."""
    import random
    import signal
    import subprocess
    import sys
    import time

    tests = os.path.dirname(os.path.abspath(__file__))
    code = _SAVER.format(tests=tests, ref=str(tmp_path / "ref"), work=str(tmp_path / "work"))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), OMP_NUM_THREADS="1")
    rng = random.Random(0)
    refs = None
    for _ in range(6):
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, env=env)
        assert proc.stdout.readline().strip() == b"ready"
        time.sleep(rng.uniform(0.05, 0.6))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        if refs is None:
            refs = [_loaded(tmp_path / f"ref{i}") for i in range(2)]
        if not (tmp_path / "work" / "config.json").exists():
            continue                                   # killed before the first save got anywhere
        hf_sd, slide_sd = _loaded(tmp_path / "work")
        assert _which(hf_sd, refs[0][0], refs[1][0]) == _which(slide_sd, refs[0][1], refs[1][1])
