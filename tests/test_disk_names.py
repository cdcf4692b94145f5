"""Nothing the engine writes under nvme_path outlives its process (disk/names.py): a child process
killed at named points (the state file's preallocation, mid-step with the nvme activation tier) or
ending without closing anything leaves the directory as it found it; files a killed run could
leave (its name, a dead process's id) are removed by the next run, and nothing else is."""
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import hf_slideformer as hs
from hf_slideformer.checkpoints.atomic_save import host_name
from helpers import make_pair

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

CHILD = textwrap.dedent("""
    import os, sys, time
    sys.path.insert(0, {here!r})
    import torch
    from helpers import batches, make_pair
    from hf_slideformer.host import store as store_module
    from hf_slideformer.disk.disk_store import WHOLE

    point, directory = sys.argv[1], sys.argv[2]

    def plan(units, config):                 # the last two layers' state on disk, whatever the limit
        layers = [u for u in units if u.kind == "layer"]
        return [(u, WHOLE) for u in layers[-2:]] if config.host_memory_limit is not None else []
    store_module.plan_disk_units = plan

    if point == "preallocation":
        real = os.posix_fallocate
        def slow(fd, offset, nbytes):
            print("at preallocation", flush=True)
            time.sleep(120)
            real(fd, offset, nbytes)
        os.posix_fallocate = slow
    _, model = make_pair(host_memory_limit=1.0, nvme_path=directory, activation_tier="nvme")
    opt = model.create_optimizer(lr=1e-3)
    for n, b in enumerate(batches(2)):
        loss = model(**b).loss
        model.slide_engine.tier.jobs.join()  # the layer inputs are on the disk
        if point == "mid-step":
            print("mid-step", flush=True)
            time.sleep(120)
        loss.backward()
        opt.step()
    print("done", flush=True)                # and the interpreter exits, nothing closed by hand
""")


def _child(point: str, directory, tmp_path):
    script = tmp_path / "child.py"
    script.write_text(CHILD.format(here=HERE))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, HERE, os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, str(script), point, str(directory)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def _until(proc, marker: str, timeout: float = 90.0) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        line = proc.stdout.readline()
        if marker in line:
            return
        if not line and proc.poll() is not None:
            raise AssertionError(f"the child ended before {marker!r}: {proc.stderr.read()[-3000:]}")
    raise AssertionError(f"no {marker!r} within {timeout} s")


@pytest.mark.parametrize("point", ["preallocation", "mid-step"])
def test_a_killed_run_leaves_nothing_under_nvme_path(tmp_path, point):
    directory = tmp_path / "nvme"
    directory.mkdir()
    proc = _child(point, directory, tmp_path)
    try:
        _until(proc, "at preallocation" if point == "preallocation" else "mid-step")
        time.sleep(0.2)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert os.listdir(directory) == []


def test_a_run_that_ends_without_closing_leaves_nothing(tmp_path):
    directory = tmp_path / "nvme"
    directory.mkdir()
    proc = _child("exit", directory, tmp_path)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and "done" in out, err[-3000:]
    assert os.listdir(directory) == []


def test_the_next_run_removes_what_dead_processes_left_and_nothing_else(tmp_path):
    directory = tmp_path / "nvme"
    directory.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    host = host_name()
    try:
        names = {pid: [f"slide-state-{host}-{pid}-0123456789ab.bin", f"slide-act-{host}-{pid}-0123456789ab-3.bin"]
                 for pid in (dead.pid, live.pid)}
        others = ["slide-state-notes.bin", "data.bin", f"slide-state-otherhost-{dead.pid}-0123456789ab.bin"]
        for n in names[dead.pid] + names[live.pid] + others:
            (directory / n).write_bytes(b"x")
        make_pair(activation_tier="nvme", nvme_path=str(directory), host_memory_limit=1.0)
        assert sorted(os.listdir(directory)) == sorted(names[live.pid] + others)
    finally:
        live.kill()
        live.wait()
