"""A simulated kill at the N-th file-system step of a save, for the crash-consistency tests.

Every call that changes the file system by name (os.replace, os.rename, os.remove, os.unlink,
os.rmdir, os.mkdir, os.link; safetensors and torch writes) is one step. From step N on, each
such call raises `Killed`, so no clean-up code of the save can run either: what is on disk is
what a SIGKILL at that point would leave (modulo page-cache durability, which fsync covers).
PEFT's safetensors write (it writes in place) is killed half-way: the file holds half its bytes.
"""
from __future__ import annotations

import contextlib
import os

import torch

import hf_slideformer.checkpoints.checkpoint as checkpoint_mod
import hf_slideformer.checkpoints.train_checkpoint as train_checkpoint_mod

_OS_CALLS = ("replace", "rename", "remove", "unlink", "rmdir", "mkdir", "link")


class Killed(BaseException):
    """The simulated SIGKILL (a BaseException: no `except Exception` of the save catches it)."""


@contextlib.contextmanager
def killed_at(step: int):
    """Run the body with a kill at file-system step `step` (0-based); yields a dict whose "steps"
    is the number of steps taken (the save's total when no kill happened)."""
    seen = {"steps": 0, "killed": False}

    def wrap(fn):
        def inner(*args, **kwargs):
            n = seen["steps"]
            seen["steps"] += 1
            if n >= step:
                seen["killed"] = True
                raise Killed(f"killed at file-system step {step}")
            return fn(*args, **kwargs)
        return inner

    def torn(fn):
        """A write killed half-way: the file holds the first half of its bytes (PEFT writes in place)."""
        def inner(tensors, filename, *args, **kwargs):
            n = seen["steps"]
            seen["steps"] += 1
            if n >= step:
                seen["killed"] = True
                fn(tensors, filename, *args, **kwargs)
                os.truncate(filename, os.path.getsize(filename) // 2)
                raise Killed(f"killed at file-system step {step}, half-way through {filename}")
            return fn(tensors, filename, *args, **kwargs)
        return inner

    targets = [(os, name) for name in _OS_CALLS]
    targets += [(checkpoint_mod, "save_file"), (train_checkpoint_mod, "save_file"), (torch, "save")]
    originals = [(mod, name, getattr(mod, name)) for mod, name in targets]
    for mod, name, fn in originals:
        setattr(mod, name, wrap(fn))
    with contextlib.suppress(ImportError):
        import peft.peft_model as peft_model_mod
        originals.append((peft_model_mod, "safe_save_file", peft_model_mod.safe_save_file))
        peft_model_mod.safe_save_file = torn(peft_model_mod.safe_save_file)
    try:
        yield seen
    except Killed:
        pass
    finally:
        for mod, name, fn in originals:
            setattr(mod, name, fn)


def every_kill(prepare, save, limit: int = 500):
    """Yield (step, killed) for a kill at each step of `save()` in turn, then once with no kill.

    `prepare()` runs before each attempt, with no kill armed (it restores the earlier save).
    """
    for step in range(limit):
        prepare()
        with killed_at(step) as seen:
            save()
        yield step, seen["killed"]
        if not seen["killed"]:
            return
    raise AssertionError(f"the save took more than {limit} file-system steps")
