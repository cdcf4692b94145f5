"""Fused ops for the sliding engine and for plain HF models.

`linear_cross_entropy`, `rms_norm`, `rope` and `swiglu` dispatch to their Triton kernels
(`triton_ops.kernels`) for CUDA tensors when Triton is importable, and to the pure-torch
`triton_ops.reference` otherwise. Under Triton's interpreter (`TRITON_INTERPRET=1`, Triton's own
switch) the kernels also run on CPU tensors, which is how the CPU tests exercise them.

`patch(model)` swaps the ops into a Hugging Face model of a supported family
(`patching.supported_families()`) and
returns a handle; `unpatch(model)` (or `handle.revert()`) restores the original forwards.
"""
from __future__ import annotations

import functools
import os

import torch

from . import reference

__all__ = [
    "is_triton_available",
    "kernels_apply",
    "linear_cross_entropy",
    "patch",
    "PatchHandle",
    "reference",
    "rms_norm",
    "rope",
    "swiglu",
    "token_statistics",
    "unpatch",
    "LinearCrossEntropyLoss",
    "RMSNorm",
    "SwiGLU",
]


@functools.lru_cache(maxsize=None)
def is_triton_available() -> bool:
    """True when Triton imports and can compile or interpret kernels here."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:
        return False
    return True


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def kernels_apply(t: torch.Tensor) -> bool:
    """Whether the Triton kernels run for a tensor on this device (CUDA, or the interpreter)."""
    return is_triton_available() and (t.is_cuda or (_interpreting() and t.device.type == "cpu"))


@functools.wraps(reference.linear_cross_entropy)      # its signature and documentation
def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                         **options) -> torch.Tensor:
    if kernels_apply(hidden):
        from .kernels.cross_entropy import linear_cross_entropy as fused
        return fused(hidden, weight, labels, **options)
    return reference.linear_cross_entropy(hidden, weight, labels, **options)


token_statistics = reference.token_statistics     # torch ops on every device: no kernel of its own


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
             in_place_backward: bool = False) -> torch.Tensor:
    """RMSNorm of x (..., H) by weight (H,) with HF Llama/Qwen casting (`reference.rms_norm`);
    `in_place_backward` lets the kernel's backward write dx over the incoming gradient."""
    if kernels_apply(x):
        from .kernels.rms_norm import rms_norm as fused
        return fused(x, weight, eps, in_place_backward)
    return reference.rms_norm(x, weight, eps)


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
         unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding of q (B, Hq, S, D) and k (B, Hk, S, D), as HF's `apply_rotary_pos_emb`.

    The kernel rotates q and k in place and returns them; the reference returns new tensors.
    """
    if kernels_apply(q):
        from .kernels.rope import rope as fused
        return fused(q, k, cos, sin, unsqueeze_dim)
    return reference.rope(q, k, cos, sin, unsqueeze_dim)


def swiglu(gate: torch.Tensor, up: torch.Tensor, in_place_backward: bool = False) -> torch.Tensor:
    """SiLU(gate) * up fused (see `reference.swiglu`).

    Args:
        gate, up: (..., I) projections of one shape and dtype.
        in_place_backward: (kernel only) write the gradients over gate and up.
    """
    if kernels_apply(gate):
        from .kernels.swiglu import swiglu as fused
        return fused(gate, up, in_place_backward)
    return reference.swiglu(gate, up)


from .modules import LinearCrossEntropyLoss, RMSNorm, SwiGLU  # noqa: E402  (they call the dispatchers above)
from .patching import PatchHandle, patch, unpatch  # noqa: E402
