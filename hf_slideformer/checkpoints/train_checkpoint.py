"""Training checkpoints of a sliding model: exact, streamed per unit, checksummed, written atomically.

A checkpoint directory holds the HF export (`model.safetensors`, written by `save_pretrained`
from the fp32 masters) and, for an exact resume, `slide_state/`: one safetensors file per unit
(embedding, each decoder layer, head) with the unit's flat `master` and the arrays its optimizer
state format declares (host_optim.py: fp32 `exp_avg`, `exp_avg_sq` for 'adamw'; 8-bit moments
and their block scales for the compact formats) and its per-parameter AdamW `step` counters,
plus `slide_state/index.json` naming every file with its size, tensor shapes, its unit's state
format and a CRC-32 per tensor, and the optimizer's hyper-parameters per group. A checkpoint
loads only into a model of the same state format (`StateFormatMismatchError` names both). No single pickle ever holds the whole state; host memory stays flat
while saving. A frozen unit (the base under LoRA) is named in the index without a file: it never
changes, and the LoRA adapters with their moments are `slide_state/adapters.safetensors`.

`atomic_directory` builds a checkpoint in a hidden sibling directory and swaps it into place
by renames (`atomic_save.staged_directory`): killed at any step, the directory reads as the old
checkpoint or the new one. `verify_training_state` detects a missing, truncated or mismatched
file and names it; `load_training_state` checks every tensor against its CRC-32 as it reads it.
"""
from __future__ import annotations

import json
import logging
import os
import zlib
from concurrent.futures import ThreadPoolExecutor

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .atomic_save import fsync_dir, fsync_file, recover_directories, staged_directory
from .checkpoint import CheckpointError
from ..host.host_optim import ADAMW, CorruptOptimizerStateError, StateFormatMismatchError

__all__ = ["STATE_DIR", "atomic_directory", "recover_checkpoint", "save_training_state", "load_training_state",
           "verify_training_state", "tensor_crc32", "write_plain_resume_refusal"]

logger = logging.getLogger(__name__)

STATE_DIR = "slide_state"
INDEX = "index.json"
ADAPTERS = "adapters.safetensors"
FORMAT = "hf_slideformer.training_state/1"
_CRC_THREADS = 4
PLAIN_OPTIMIZER_NAME = "optimizer.pt"


def atomic_directory(final: str, merge: bool = False):
    """A context manager yielding a temporary directory beside `final`, swapped in by renames on success.

    An exception leaves `final` as it was and removes the temporary directory; a killed process
    leaves `final` (or what recovery restores under its name) as the old or the new checkpoint,
    and the next save (or `recover_checkpoint`) resolves the hidden leftovers. `merge=True`
    keeps the entries of an existing `final` that the new save does not write.
    """
    return staged_directory(final, merge=merge)


def recover_checkpoint(directory: str) -> None:
    """Resolve what a killed `atomic_directory` save left beside `directory` (old or new, never half)."""
    directory = os.path.abspath(directory)
    recover_directories(os.path.dirname(directory), os.path.basename(directory))


def resume_this_checkpoint_with_SlideTrainer(*_):  # noqa: N802 - the name is the message torch shows
    """Raise: what `optimizer.pt` of a sliding checkpoint unpickles to (see `write_plain_resume_refusal`)."""
    raise CheckpointError("this is an hf_slideformer checkpoint: its optimizer state is in slide_state/, not in "
                          "optimizer.pt. Resume it with hf_slideformer.SlideTrainer, or Trainer(args=SlideArgs(...)).")


class _PlainResumeRefusal:
    def __reduce__(self):
        return (resume_this_checkpoint_with_SlideTrainer, ())


def write_plain_resume_refusal(directory: str) -> None:
    """Write an `optimizer.pt` that makes a plain `transformers.Trainer` refuse to resume `directory`.

    Note: [Why a sliding checkpoint has an optimizer.pt] HF's Trainer resumes the optimizer and
    the schedule only if `optimizer.pt` exists, and silently starts both afresh otherwise. This
    file holds no state: unpickling it fails, under `weights_only=True` naming
    `resume_this_checkpoint_with_SlideTrainer`, and otherwise with the full message.
    """
    torch.save(_PlainResumeRefusal(), os.path.join(directory, PLAIN_OPTIMIZER_NAME))


def tensor_crc32(tensor: torch.Tensor) -> int:
    """CRC-32 of a tensor's bytes (contiguous, any dtype)."""
    return zlib.crc32(tensor.contiguous().view(torch.uint8).numpy())


def _unit_file(index: int) -> str:
    return f"unit-{index:05d}.safetensors"


def _hyper_params(optimizer) -> list[dict]:
    out = []
    for group in optimizer.param_groups:
        out.append({k: (list(v) if isinstance(v, tuple) else v) for k, v in group.items() if k != "params"})
    return out


def _optimizer_of(optimizer):
    """The SlideOptimizer behind an Accelerate wrapper (or itself)."""
    from ..host.optim import SlideOptimizer

    inner = optimizer
    while not isinstance(inner, SlideOptimizer) and hasattr(inner, "optimizer"):
        inner = inner.optimizer
    if not isinstance(inner, SlideOptimizer):
        raise TypeError(f"expected a SlideOptimizer, got {type(optimizer).__name__}")
    return inner


def save_training_state(directory: str, model, optimizer) -> None:
    """Write `slide_state/` (masters, moments, step counters, hyper-parameters) under `directory`.
    With several ranks, every rank may call it and rank 0 writes (they share one state).

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
    if engine.dp is not None and not engine.dp.writes:
        return                      # several ranks share one state (data_parallel.py): rank 0 writes it
    out = os.path.join(directory, STATE_DIR)
    os.makedirs(out, exist_ok=True)
    units = []
    with ThreadPoolExecutor(max_workers=_CRC_THREADS) as pool:     # zlib.crc32 releases the GIL
        for unit_index, unit in enumerate(engine.store.units):
            if not unit.trainable:
                units.append({"name": unit.name, "frozen": True, "numel": unit.numel,
                              "params": [[e.name, list(e.shape)] for e in unit.entries]})
                continue
            fname = _unit_file(unit_index)
            path = os.path.join(out, fname)
            with engine.store.unit_state(unit):          # a layer on disk: read into a buffer meanwhile
                # the format's arrays; the step counters are one fp32 scalar per parameter of the unit
                tensors = {**(unit.state_format or ADAMW).tensors(unit),
                           "step": torch.stack([s.reshape(()) for s in unit.steps]) if unit.steps else torch.zeros(0)}
                crcs = {n: pool.submit(tensor_crc32, t) for n, t in tensors.items()}
                save_file(tensors, path, metadata={"format": FORMAT, "unit": unit.name})
                crcs = {n: c.result() for n, c in crcs.items()}
                del tensors
            units.append({"name": unit.name, "file": fname, "bytes": os.path.getsize(path), "numel": unit.numel,
                          "state_format": (unit.state_format or ADAMW).name,
                          "params": [[e.name, list(e.shape)] for e in unit.entries], "crc32": crcs})
    index = {"format": FORMAT, "units": units, "param_groups": _hyper_params(opt),
             "micro_steps": engine.stats.steps}
    if engine.lora.params:         # LoRA adapters (lora.py): on the device, in a file of their own
        tensors = engine.lora.state()
        path = os.path.join(out, ADAPTERS)
        save_file(tensors, path, metadata={"format": FORMAT, "unit": "adapters"})
        index["adapters"] = {"file": ADAPTERS, "bytes": os.path.getsize(path), "names": engine.lora.names,
                             "crc32": {n: tensor_crc32(t) for n, t in tensors.items()}}
        fsync_file(path)
    for rec in units:                     # the index, written last, must never name a file not yet durable
        if "file" in rec:
            fsync_file(os.path.join(out, rec["file"]))
    with open(os.path.join(out, INDEX), "w", encoding="utf-8") as handle:
        json.dump(index, handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())
    fsync_dir(out)


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
        with open(ipath, encoding="utf-8") as handle:
            index = json.load(handle)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{ipath} is unreadable or corrupted: {e}") from e
    if index.get("format") != FORMAT:
        raise CheckpointError(f"{ipath} has format {index.get('format')!r}, expected {FORMAT!r}")
    units = model.slide_engine.store.units
    if len(index["units"]) != len(units):
        raise CheckpointError(f"{ipath} describes {len(index['units'])} units, the model has {len(units)}")
    adapters = model.slide_engine.lora
    saved = index.get("adapters", {}).get("names", [])
    if saved != adapters.names:
        raise CheckpointError(f"{ipath} holds the LoRA adapters {saved[:3]}..., the model has {adapters.names[:3]}...: "
                              "a checkpoint of another model or adapter configuration")
    if saved:
        path = os.path.join(out, index["adapters"]["file"])
        if not os.path.isfile(path) or os.path.getsize(path) != index["adapters"]["bytes"]:
            raise CheckpointError(f"{path} is missing or truncated (the LoRA adapters)")
    for rec, unit in zip(index["units"], units):
        if rec.get("frozen", False) != (not unit.trainable):
            raise CheckpointError(f"{ipath}: unit {rec['name']} is {'frozen' if rec.get('frozen') else 'trained'} "
                                  f"there and {'trained' if unit.trainable else 'frozen'} in this model: a checkpoint of "
                                  "another adapter configuration")
        if rec.get("frozen"):
            theirs = [(n, tuple(s)) for n, s in rec["params"]]
            if theirs != [(e.name, tuple(e.shape)) for e in unit.entries]:
                raise CheckpointError(f"{ipath}: frozen unit {rec['name']} has other parameters than the model's "
                                      f"{unit.name}: a checkpoint of another model")
            continue
        path = os.path.join(out, rec["file"])
        if not os.path.isfile(path):
            raise CheckpointError(f"{path} is missing (unit {rec['name']})")
        size = os.path.getsize(path)
        if size != rec["bytes"]:
            raise CheckpointError(f"{path} has {size} bytes, the index says {rec['bytes']}: truncated or corrupted")
        theirs = [(n, tuple(s)) for n, s in rec["params"]]
        ours = [(e.name, tuple(e.shape)) for e in unit.entries]
        if theirs != ours:
            raise CheckpointError(f"{path} holds unit {rec['name']} with parameters {theirs[:3]}..., the model's "
                                  f"unit {unit.name} has {ours[:3]}...: a checkpoint of another model")
        try:
            with safe_open(path, "pt") as handle:
                shapes = {k: tuple(handle.get_slice(k).get_shape()) for k in handle.keys()}
                meta = handle.metadata() or {}
        except Exception as e:  # noqa: BLE001 - any parse error means a damaged file
            raise CheckpointError(f"{path} is not a readable safetensors file: {e}") from e
        if meta.get("unit") != rec["name"]:
            raise CheckpointError(f"{path} holds unit {meta.get('unit')!r}, the index expects {rec['name']!r}")
        fmt = unit.state_format or ADAMW
        theirs_fmt = rec.get("state_format", ADAMW.name)
        if theirs_fmt != fmt.name:
            fix = f"slide the model with optimizer_state={theirs_fmt!r}"
            if unit.kind == "embed" and theirs_fmt == ADAMW.name:    # saved when it kept fp32 under every format
                fix += (f", or, if its layers are in {fmt.name!r}, with resident_embedding=True (the embedding "
                        "then keeps 'adamw', host_optim.embed_format)")
            raise StateFormatMismatchError(
                f"{path} holds unit {rec['name']} in optimizer state format {theirs_fmt!r}; this model keeps "
                f"{fmt.name!r} (SlideConfig.optimizer_state): {fix} to resume this checkpoint")
        want = {"master": (unit.numel,), **{n: (k,) for n, k in fmt.sizes(unit).items()}, "step": (len(unit.entries),)}
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
    if any("crc32" not in rec for rec in index["units"] if not rec.get("frozen")):
        logger.warning("%s was written without checksums: damaged values cannot be detected", out)
    for rec, unit in zip(index["units"], engine.store.units):
        if rec.get("frozen"):
            continue                                 # never changed: the model's own weights are the state
        path = os.path.join(out, rec["file"])
        try:
            with safe_open(path, "pt") as handle, engine.store.unit_state(unit, write=True):
                def read(name):
                    tensor = handle.get_tensor(name)
                    want = rec.get("crc32", {}).get(name)
                    if want is not None and tensor_crc32(tensor) != want:
                        raise CheckpointError(f"{path}: tensor {name!r} of unit {rec['name']} does not match its "
                                              "checksum (damaged on disk or in transfer). The load stopped here, "
                                              "with the state read before it restored: load a good checkpoint "
                                              "before training")
                    return tensor

                fmt = unit.state_format or ADAMW
                if weights:
                    unit.master.copy_(read("master"))
                if opt is not None:
                    arrays = {a.name: read(a.name) for a in fmt.arrays}
                    for name, tensor in arrays.items():    # every scale is checked before anything is written
                        fmt.check(name, tensor, f"{path} (unit {rec['name']})")
                    for name, tensor in arrays.items():
                        getattr(unit, name).copy_(tensor)
                    for counter, saved_step in zip(unit.steps, read("step")):
                        counter.copy_(saved_step)
                    del arrays
        except (CheckpointError, StateFormatMismatchError, CorruptOptimizerStateError):
            raise
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"{path} could not be read: {e}") from e
        unit.version += 1                              # device copies of the old weights are stale now
    if "adapters" in index:
        rec = index["adapters"]
        path = os.path.join(out, rec["file"])
        with safe_open(path, "pt") as handle:
            def read_adapter(name):
                tensor = handle.get_tensor(name)
                if tensor_crc32(tensor) != rec["crc32"].get(name):
                    raise CheckpointError(f"{path}: tensor {name!r} does not match its checksum (damaged on disk "
                                          "or in transfer): load a good checkpoint before training")
                return tensor
            engine.lora.load_state(read_adapter, weights=weights, optimizer=opt is not None)
    if opt is not None:
        for saved, group in zip(index["param_groups"], opt.param_groups):
            for key, value in saved.items():
                group[key] = tuple(value) if key == "betas" else value
    engine.note_restored(weights=weights, optimizer=opt is not None)
