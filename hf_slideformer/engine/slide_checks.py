"""Checks made once, when a model is slid or loaded, before any weight moves into the store: that
its weights are finite, and (data-parallel launches) that every rank slides the same model with
the same settings that change the mathematics.

Both refuse with an error that names what differs, so that a run that could only train wrongly
(every step skipped on a NaN weight; ranks averaging gradients of different models or clipping
at different norms) stops before its first step.
"""
from __future__ import annotations

from typing import Iterable

import logging

import torch

from ..errors import NonFiniteWeightError, RankMismatchError
from ..host.memory import COPY_CHUNK

__all__ = ["check_finite", "check_finite_weights", "rank_fingerprint", "compare_ranks", "MATH_SETTINGS",
           "gpu_minimum_bytes", "check_gpu_limit", "GpuLimitError", "align_grouped_experts"]

GiB = 1024 ** 3
logger = logging.getLogger(__name__)

_CHUNK = 1 << 24               # elements judged at once: a bounded temporary, whatever the tensor's size

# SlideConfig fields whose values change what the ranks compute together (the gradient average,
# the clipping, the update, the layers each slot holds); the rest (threads, pinning, logging)
# may differ per rank.
MATH_SETTINGS = ("dtype", "window", "gradient_accumulation_steps", "max_grad_norm", "nonfinite_grads",
                 "head_chunk_tokens", "mlp_chunk_tokens", "use_kernels", "host_adam", "late_layer_updates",
                 "optimizer_state", "matmuls")

_MODEL_SHAPE = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "tie_word_embeddings")


def check_finite(name: str, tensor: torch.Tensor, where: str) -> None:
    """Raise `NonFiniteWeightError` naming `name` when `tensor` holds inf or NaN (judged in chunks)."""
    if not (tensor.dtype.is_floating_point or tensor.dtype.is_complex) or tensor.device.type == "meta":
        return
    flat = tensor.detach().reshape(-1)
    for start in range(0, flat.numel(), _CHUNK):
        part = flat[start:start + _CHUNK]
        if not bool(torch.isfinite(part).all()):
            bad = int((~torch.isfinite(part)).sum())
            raise NonFiniteWeightError(
                f"{name} holds {bad}{'+' if flat.numel() > start + _CHUNK else ''} non-finite value(s) (inf or NaN) "
                f"{where}: every step of this model would be skipped as a non-finite gradient. Load other weights, "
                "or pass SlideConfig(check_finite_weights=False) (SlideArgs: --slide_check_finite_weights false) to "
                "slide it anyway, to repair those weights, say.")


def check_finite_weights(named: Iterable[tuple[str, torch.Tensor]], where: str = "at slide()") -> None:
    """`check_finite` on each (name, tensor)."""
    for name, tensor in named:
        check_finite(name, tensor, where)


def rank_fingerprint(config, model, units) -> dict:
    """What must be equal on every rank: the settings of `MATH_SETTINGS` and the model's shape."""
    out = {f"SlideConfig.{k}": repr(getattr(config, k, None)) for k in MATH_SETTINGS}
    out["model type"] = getattr(model.config, "model_type", None)
    for key in _MODEL_SHAPE:
        out[f"model config {key}"] = getattr(model.config, key, None)
    out["parameter count"] = sum(_numel(u) for u in units)
    out["units"] = len(units)
    out["unit shapes"] = [[(e.name, tuple(e.shape)) for e in u.entries] for u in units]
    return out


def compare_ranks(prints: list[dict]) -> None:
    """Raise `RankMismatchError` naming the first entry in which a rank differs from rank 0."""
    first = prints[0]
    for rank, rank_print in enumerate(prints[1:], start=1):
        for key, want in first.items():
            got = rank_print.get(key)
            if got == want:
                continue
            if key == "unit shapes":
                diff = next(((a, b) for a, b in zip(_flat(want), _flat(got)) if a != b), (len(want), len(got)))
                want, got = diff
            raise RankMismatchError(
                f"the ranks of this launch differ in {key}: rank 0 has {want}, rank {rank} has {got}. Every rank "
                "must slide the same model with the same settings (their gradients are averaged); launch them "
                "with one configuration.")


def _numel(unit) -> int:
    """A unit's parameter count, before the store has laid it out."""
    return sum(e.numel for e in unit.entries)


def _flat(shapes):
    return [x for unit in shapes for x in unit]


class GpuLimitError(ValueError):
    """`SlideConfig.gpu_memory_limit` is below what the engine's GPU buffers need at least."""


def gpu_minimum_bytes(config, units, tied: bool) -> int:
    """The GPU bytes the engine allocates before any activation: `window` slots of the largest
    layer, the head's slot (with the tied embedding), one layer's gradients, and the fp32 staging
    buffer of the on-GPU cast (slide_engine.py, slots.py). A lower bound: activations come on top."""
    elem_bytes = torch.empty((), dtype=config.dtype).element_size()
    layers = [_numel(u) for u in units if u.kind == "layer"]
    max_layer = max(layers, default=0)
    head = _numel(units[-1]) + (_numel(units[0]) if tied else 0)
    staging = 4 * min(max(max_layer, head), COPY_CHUNK) if config.dtype != torch.float32 else 0
    return (config.window + 1) * max_layer * elem_bytes + head * elem_bytes + staging


def check_gpu_limit(config, units, tied: bool) -> None:
    """Refuse a `gpu_memory_limit` below `gpu_minimum_bytes`, before anything is allocated."""
    if config.gpu_memory_limit is None:
        return
    need = gpu_minimum_bytes(config, units, tied)
    if config.gpu_memory_limit * GiB < need:
        raise GpuLimitError(
            f"SlideConfig.gpu_memory_limit={config.gpu_memory_limit:g} GiB is below the {need / GiB:.3f} GiB that the "
            f"engine's GPU buffers need before any activation ({config.window} slots and the gradients of the largest "
            f"layer, the head, in {config.dtype}). Set gpu_memory_limit to at least {need / GiB:.3f} GiB plus room for "
            "the activations, or a smaller window.")


def align_grouped_experts(model, units, dtype: torch.dtype) -> bool:
    """Keep HF's grouped expert GEMM only where its operands are aligned as it requires.

    `torch._grouped_mm` (HF's `experts_implementation="grouped_mm"`, the default of its mixtures of
    experts on CUDA) needs each operand's data 16-byte aligned. A unit's parameters sit back to
    back in its slot, so an expert weight after a parameter whose bytes are not a multiple of 16
    (a tiny shape's 4 attention sinks, say) is not. Such a model switches to HF's `batched_mm`
    (the same mathematics, one batched GEMM) with a warning; real shapes, whose sizes are
    multiples of 8, keep `grouped_mm`. Returns whether the implementation was switched.
    """
    if getattr(model.config, "_experts_implementation", None) != "grouped_mm":
        return False
    itemsize = torch.empty((), dtype=dtype).element_size()
    off = [e.name for u in units for e in u.entries if ".experts." in e.name and (e.offset * itemsize) % 16]
    if not off:
        return False
    logger.warning("%s sits at a slot offset that is not 16-byte aligned, which torch's grouped GEMM needs: "
                   "the experts run HF's batched_mm instead (the same mathematics); sizes that are multiples "
                   "of 8 elements keep grouped_mm", off[0])
    model.set_experts_implementation("batched_mm")
    return True
