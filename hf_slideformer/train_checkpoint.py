"""Training checkpoints of a sliding model: exact, streamed per unit, written atomically.

A checkpoint directory holds the HF export (`model.safetensors`, written by `save_pretrained`
in the training dtype) and, for an exact resume, `slide_state/`: one safetensors file per unit
(embedding, each decoder layer, head) with the unit's flat fp32 `master`, `exp_avg`,
`exp_avg_sq` and its per-parameter AdamW `step` counters, plus `slide_state/index.json` naming
every file with its size and tensor shapes, and the optimizer's hyper-parameters per group. No
single pickle ever holds the whole state; host memory stays flat while saving.

`atomic_directory` builds a checkpoint in a hidden sibling directory and renames it into place
at the end, so an interrupted save never damages an earlier checkpoint. `verify_training_state`
detects a missing, truncated or mismatched file and names it.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .checkpoint import CheckpointError

__all__ = ["STATE_DIR", "atomic_directory", "save_training_state", "load_training_state",
           "verify_training_state"]

STATE_DIR = "slide_state"
INDEX = "index.json"
FORMAT = "hf_slideformer.training_state/1"
_TENSORS = ("master", "exp_avg", "exp_avg_sq", "step")


@contextlib.contextmanager
def atomic_directory(final: str):
    """Yield a temporary directory beside `final`; on success, it replaces `final` by renames.

    An exception (or a killed process) leaves `final` as it was; the hidden temporary directory
    is removed on exceptions and ignored by HF's checkpoint discovery (`checkpoint-N` pattern).
    """
    parent = os.path.dirname(os.path.abspath(final)) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".tmp-{os.path.basename(final)}-", dir=parent)
    try:
        yield tmp
        _fsync_dir(tmp)
        old = None
        if os.path.exists(final):
            old = tempfile.mkdtemp(prefix=f".old-{os.path.basename(final)}-", dir=parent)
            os.rmdir(old)
            os.replace(final, old)
        os.replace(tmp, final)
        _fsync_dir(parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _fsync_dir(path: str) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _unit_file(index: int) -> str:
    return f"unit-{index:05d}.safetensors"


def _hyper_params(optimizer) -> list[dict]:
    out = []
    for g in optimizer.param_groups:
        out.append({k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items() if k != "params"})
    return out


def _optimizer_of(optimizer):
    """The SlideOptimizer behind an Accelerate wrapper (or itself)."""
    from .optim import SlideOptimizer

    inner = optimizer
    while not isinstance(inner, SlideOptimizer) and hasattr(inner, "optimizer"):
        inner = inner.optimizer
    if not isinstance(inner, SlideOptimizer):
        raise TypeError(f"expected a SlideOptimizer, got {type(optimizer).__name__}")
    return inner


def save_training_state(directory: str, model, optimizer) -> None:
    """Write `slide_state/` (masters, moments, step counters, hyper-parameters) under `directory`.

    Args:
        directory: the checkpoint directory (normally the temporary one of `atomic_directory`).
        model: the slid model.
        optimizer: its SlideOptimizer (or an Accelerate wrapper of it).
    """
    engine = model.slide_engine
    opt = _optimizer_of(optimizer)
    if engine.micro != 0:
        raise CheckpointError("save_training_state in the middle of an accumulation window: call it after "
                              "optimizer.step()")
    engine.synchronize()                               # every queued (deferred) update has landed
    out = os.path.join(directory, STATE_DIR)
    os.makedirs(out, exist_ok=True)
    units = []
    for k, u in enumerate(engine.store.units):
        fname = _unit_file(k)
        path = os.path.join(out, fname)
        # (numel,) fp32 each; the step counters are one fp32 scalar per parameter of the unit
        save_file({"master": u.master, "exp_avg": u.exp_avg, "exp_avg_sq": u.exp_avg_sq,
                   "step": torch.stack([s.reshape(()) for s in u.steps]) if u.steps else torch.zeros(0)},
                  path, metadata={"format": FORMAT, "unit": u.name})
        units.append({"name": u.name, "file": fname, "bytes": os.path.getsize(path), "numel": u.numel,
                      "params": [[e.name, list(e.shape)] for e in u.entries]})
    index = {"format": FORMAT, "units": units, "param_groups": _hyper_params(opt),
             "micro_steps": engine.stats.steps}
    with open(os.path.join(out, INDEX), "w", encoding="utf-8") as f:
        json.dump(index, f, indent=1)


def verify_training_state(directory: str, model) -> dict:
    """Check that `directory/slide_state` is complete and fits `model`; return its index.

    Raises:
        CheckpointError: naming the first missing, truncated, unreadable or mismatched file.
    """
    out = os.path.join(directory, STATE_DIR)
    ipath = os.path.join(out, INDEX)
    if not os.path.isfile(ipath):
        raise CheckpointError(f"{ipath} is missing: {directory} is not a complete hf_slideformer checkpoint "
                              "(interrupted copy, or saved without the optimizer state: save_only_model=True)")
    try:
        with open(ipath, encoding="utf-8") as f:
            index = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{ipath} is unreadable or corrupted: {e}") from e
    if index.get("format") != FORMAT:
        raise CheckpointError(f"{ipath} has format {index.get('format')!r}, expected {FORMAT!r}")
    units = model.slide_engine.store.units
    if len(index["units"]) != len(units):
        raise CheckpointError(f"{ipath} describes {len(index['units'])} units, the model has {len(units)}")
    for rec, u in zip(index["units"], units):
        path = os.path.join(out, rec["file"])
        if not os.path.isfile(path):
            raise CheckpointError(f"{path} is missing (unit {rec['name']})")
        size = os.path.getsize(path)
        if size != rec["bytes"]:
            raise CheckpointError(f"{path} has {size} bytes, the index says {rec['bytes']}: truncated or corrupted")
        theirs = [(n, tuple(s)) for n, s in rec["params"]]
        ours = [(e.name, tuple(e.shape)) for e in u.entries]
        if theirs != ours:
            raise CheckpointError(f"{path} holds unit {rec['name']} with parameters {theirs[:3]}..., the model's "
                                  f"unit {u.name} has {ours[:3]}...: a checkpoint of another model")
        try:
            with safe_open(path, "pt") as f:
                shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
                meta = f.metadata() or {}
        except Exception as e:  # noqa: BLE001 - any parse error means a damaged file
            raise CheckpointError(f"{path} is not a readable safetensors file: {e}") from e
        if meta.get("unit") != rec["name"]:
            raise CheckpointError(f"{path} holds unit {meta.get('unit')!r}, the index expects {rec['name']!r}")
        want = {"master": (u.numel,), "exp_avg": (u.numel,), "exp_avg_sq": (u.numel,), "step": (len(u.entries),)}
        if shapes != want:
            raise CheckpointError(f"{path} holds tensors {shapes}, expected {want}")
    return index


@torch.no_grad()
def load_training_state(directory: str, model, optimizer=None, *, weights: bool = True) -> None:
    """Restore masters (and, with `optimizer`, moments, step counters and hyper-parameters) in place.

    Args:
        directory: a checkpoint directory written with `save_training_state`.
        model: the slid model of the same architecture.
        optimizer: its SlideOptimizer (or an Accelerate wrapper); None restores the weights only.
        weights: restore the fp32 masters (False: optimizer state only).
    """
    index = verify_training_state(directory, model)
    engine = model.slide_engine
    engine.synchronize()
    opt = _optimizer_of(optimizer) if optimizer is not None else None
    if opt is not None and len(index["param_groups"]) != len(opt.param_groups):
        raise CheckpointError(f"{directory}: {len(index['param_groups'])} optimizer param groups saved, "
                              f"this optimizer has {len(opt.param_groups)}")
    out = os.path.join(directory, STATE_DIR)
    for rec, u in zip(index["units"], engine.store.units):
        path = os.path.join(out, rec["file"])
        try:
            with safe_open(path, "pt") as f:
                if weights:
                    u.master.copy_(f.get_tensor("master"))
                if opt is not None:
                    u.exp_avg.copy_(f.get_tensor("exp_avg"))
                    u.exp_avg_sq.copy_(f.get_tensor("exp_avg_sq"))
                    steps = f.get_tensor("step")
                    for s, v in zip(u.steps, steps):
                        s.copy_(v)
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"{path} could not be read: {e}") from e
        u.version += 1                              # device copies of the old weights are stale now
    if opt is not None:
        for saved, group in zip(index["param_groups"], opt.param_groups):
            for k, v in saved.items():
                group[k] = tuple(v) if k == "betas" else v
