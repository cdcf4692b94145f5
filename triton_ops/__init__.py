"""Fused ops for the sliding engine and for plain HF models.

`geglu`, `linear_cross_entropy`, `rms_norm`, `rope` and `swiglu` (and `rms_norm_rows` / `swiglu_rows`, which
also return their output's e4m3 rows for an FP8 GEMM) dispatch to their Triton kernels
(`triton_ops.kernels`) for CUDA tensors when Triton is importable, and to the pure-torch
`triton_ops.reference` otherwise. Under Triton's interpreter (`TRITON_INTERPRET=1`, Triton's own
switch) the kernels also run on CPU tensors, which is how the CPU tests exercise them.

`patch(model)` swaps the ops into a Hugging Face model of a supported family
(`patching.supported_families()`) and
returns a handle; `unpatch(model)` (or `handle.revert()`) restores the original forwards.
"""
from __future__ import annotations

import functools
import importlib
import os

import torch

from . import reference

__all__ = [
    "causal_conv",
    "gated_rms_norm",
    "geglu",
    "is_triton_available",
    "kernels_apply",
    "linear_cross_entropy",
    "patch",
    "qk_l2norm",
    "PatchHandle",
    "reference",
    "rms_norm",
    "rms_norm_rows",
    "rope",
    "swiglu",
    "swiglu_rows",
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


def causal_conv(x: torch.Tensor, weight: torch.Tensor, silu: bool = True) -> torch.Tensor:
    """SiLU (when `silu`) of the causal depthwise convolution of x (B, C, T) by weight (C, K), in
    x's dtype (`reference.causal_conv`: Qwen3.5's linear-attention convolution). The kernel reads x
    in its own strides (the layers' (B, T, C) projection, transposed) and writes the result in them;
    it takes x and weight of one dtype outside autocast (the reference, as transformers, casts x to
    the weight's dtype first, and autocast then picks the convolution's own)."""
    if kernels_apply(x) and x.dtype == weight.dtype and not torch.is_autocast_enabled(x.device.type):
        from .kernels.causal_conv import causal_conv as fused
        return fused(x, weight, silu)
    return reference.causal_conv(x, weight, silu)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """(weight * RMSNorm(x)) * SiLU(gate) over the last dimension, in x's dtype
    (`reference.gated_rms_norm`: Qwen3.5's gated norm of the linear attention's output). The kernel
    takes x, gate and weight of one dtype; other mixes run the reference."""
    if kernels_apply(x) and x.dtype == gate.dtype == weight.dtype:
        from .kernels.gated_norm import gated_rms_norm as fused
        return fused(x, gate, weight, eps)
    return reference.gated_rms_norm(x, gate, weight, eps)


def qk_l2norm(x: torch.Tensor, repeat: int = 1, scale: float = 1.0, eps: float = 1e-6) -> torch.Tensor:
    """Queries or keys (B, T, Hk, D) L2-normalized per row in fp32, scaled, heads first with each
    head repeated: (B, Hk * repeat, T, D) fp32 (`reference.qk_l2norm`: the chunked gated delta
    rule's preparation of them, one pass each way in the kernel)."""
    if kernels_apply(x):
        from .kernels.qk_norm import qk_l2norm as fused
        return fused(x, repeat, scale, eps)
    return reference.qk_l2norm(x, repeat, scale, eps)


token_statistics = reference.token_statistics     # torch ops on every device: no kernel of its own


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
             in_place_backward: bool = False, offset: bool = False) -> torch.Tensor:
    """RMSNorm of x (..., H) by weight (H,) with HF Llama/Qwen casting, or with `offset` Gemma's
    (1 + weight) scale and casting (`reference.rms_norm`); `in_place_backward` lets the kernel's
    backward write dx over the incoming gradient."""
    if kernels_apply(x):
        from .kernels.rms_norm import rms_norm as fused
        return fused(x, weight, eps, in_place_backward, offset)
    return reference.rms_norm(x, weight, eps, offset)


def rms_norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                  in_place_backward: bool = False) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """`rms_norm`, and its output's rows quantized for an FP8 GEMM (`reference.fp8_quantize_rows`).

    Returns:
        y (..., H) as `rms_norm`'s, and (q (N, H) float8_e4m3fn, inverse scales (N, 1) float32),
        N = y.numel() // H: one kernel where the kernels apply, the two reference ops elsewhere.
    """
    if kernels_apply(x):
        from .kernels.rms_norm import rms_norm_rows as fused
        return fused(x, weight, eps, in_place_backward)
    y = reference.rms_norm(x, weight, eps)
    return y, reference.fp8_quantize_rows(y.detach().reshape(-1, y.shape[-1]))


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
         unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding of q (B, Hq, S, D) and k (B, Hk, S, D), as HF's `apply_rotary_pos_emb`.

    The kernel rotates q and k in place and returns them; the reference returns new tensors.
    """
    if kernels_apply(q):
        from .kernels.rope import rope as fused
        return fused(q, k, cos, sin, unsqueeze_dim)
    return reference.rope(q, k, cos, sin, unsqueeze_dim)


def _gated(op: str, gate: torch.Tensor, up: torch.Tensor, in_place_backward: bool) -> torch.Tensor:
    """act(gate) * up by the kernel module `op` (swiglu, geglu) where kernels apply, else the reference."""
    if kernels_apply(gate):
        kernel = importlib.import_module(f".kernels.{op}", __name__)
        return getattr(kernel, op)(gate, up, in_place_backward)
    return getattr(reference, op)(gate, up)


def swiglu(gate: torch.Tensor, up: torch.Tensor, in_place_backward: bool = False) -> torch.Tensor:
    """SiLU(gate) * up fused (see `reference.swiglu`); gate, up (..., I) of one shape and dtype.
    With `in_place_backward` the kernel's backward writes the gradients over gate and up."""
    return _gated("swiglu", gate, up, in_place_backward)


def geglu(gate: torch.Tensor, up: torch.Tensor, in_place_backward: bool = False) -> torch.Tensor:
    """gelu_tanh(gate) * up fused, rounded as HF's Gemma MLP (see `reference.geglu`); the
    arguments are `swiglu`'s."""
    return _gated("geglu", gate, up, in_place_backward)


def swiglu_rows(gate: torch.Tensor, up: torch.Tensor,
                in_place_backward: bool = False) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """`swiglu`, and its output's rows quantized for an FP8 GEMM (`reference.fp8_quantize_rows`).

    Returns:
        c (..., I) as `swiglu`'s, and (q (M, I) float8_e4m3fn, inverse scales (M, 1) float32),
        M = c.numel() // I: one kernel where the kernels apply, the two reference ops elsewhere.
    """
    if kernels_apply(gate):
        from .kernels.swiglu import swiglu_rows as fused
        return fused(gate, up, in_place_backward)
    c = reference.swiglu(gate, up)
    return c, reference.fp8_quantize_rows(c.detach().reshape(-1, c.shape[-1]))


from .modules import LinearCrossEntropyLoss, RMSNorm, SwiGLU  # noqa: E402  (they call the dispatchers above)
from .patching import PatchHandle, patch, unpatch  # noqa: E402
