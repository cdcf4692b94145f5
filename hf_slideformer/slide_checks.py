"""Checks made once, when a model is slid or loaded, before any weight moves into the store: that
its weights are finite, and (data-parallel launches) that every rank slides the same model with
the same settings that change the mathematics.

Both refuse with an error that names what differs, so that a run that could only train wrongly
(every step skipped on a NaN weight; ranks averaging gradients of different models or clipping
at different norms) stops before its first step.
"""
from __future__ import annotations

from typing import Iterable

import torch

from .errors import NonFiniteWeightError, RankMismatchError

__all__ = ["check_finite", "check_finite_weights", "rank_fingerprint", "compare_ranks", "MATH_SETTINGS"]

_CHUNK = 1 << 24               # elements judged at once: a bounded temporary, whatever the tensor's size

# SlideConfig fields whose values change what the ranks compute together (the gradient average,
# the clipping, the update, the layers each slot holds); the rest (threads, pinning, logging)
# may differ per rank.
MATH_SETTINGS = ("dtype", "window", "gradient_accumulation_steps", "max_grad_norm", "nonfinite_grads",
                 "head_chunk_tokens", "mlp_chunk_tokens", "use_kernels", "host_adam", "late_layer_updates")

_MODEL_SHAPE = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "tie_word_embeddings")


def check_finite(name: str, t: torch.Tensor, where: str) -> None:
    """Raise `NonFiniteWeightError` naming `name` when `t` holds inf or NaN (judged in chunks)."""
    if not (t.dtype.is_floating_point or t.dtype.is_complex) or t.device.type == "meta":
        return
    flat = t.detach().reshape(-1)
    for a in range(0, flat.numel(), _CHUNK):
        part = flat[a:a + _CHUNK]
        if not bool(torch.isfinite(part).all()):
            bad = int((~torch.isfinite(part)).sum())
            raise NonFiniteWeightError(
                f"{name} holds {bad}{'+' if flat.numel() > a + _CHUNK else ''} non-finite value(s) (inf or NaN) "
                f"{where}: every step of this model would be skipped as a non-finite gradient. Load other weights, "
                "or pass SlideConfig(check_finite_weights=False) (SlideArgs: --slide_check_finite_weights false) to "
                "slide it anyway, to repair those weights, say.")


def check_finite_weights(named: Iterable[tuple[str, torch.Tensor]], where: str = "at slide()") -> None:
    """`check_finite` on each (name, tensor)."""
    for name, t in named:
        check_finite(name, t, where)


def rank_fingerprint(config, model, units) -> dict:
    """What must be equal on every rank: the settings of `MATH_SETTINGS` and the model's shape."""
    out = {f"SlideConfig.{k}": repr(getattr(config, k, None)) for k in MATH_SETTINGS}
    out["model type"] = getattr(model.config, "model_type", None)
    for key in _MODEL_SHAPE:
        out[f"model config {key}"] = getattr(model.config, key, None)
    out["parameter count"] = sum(u.numel for u in units)
    out["units"] = len(units)
    out["unit shapes"] = [[(e.name, tuple(e.shape)) for e in u.entries] for u in units]
    return out


def compare_ranks(prints: list[dict]) -> None:
    """Raise `RankMismatchError` naming the first entry in which a rank differs from rank 0."""
    first = prints[0]
    for rank, p in enumerate(prints[1:], start=1):
        for key, want in first.items():
            got = p.get(key)
            if got == want:
                continue
            if key == "unit shapes":
                diff = next(((a, b) for a, b in zip(_flat(want), _flat(got)) if a != b), (len(want), len(got)))
                want, got = diff
            raise RankMismatchError(
                f"the ranks of this launch differ in {key}: rank 0 has {want}, rank {rank} has {got}. Every rank "
                "must slide the same model with the same settings (their gradients are averaged); launch them "
                "with one configuration.")


def _flat(shapes):
    return [x for unit in shapes for x in unit]
