"""Triton implementations of the fused ops; importing this package requires Triton.

Each module holds the three tiers of one op: a private `@triton.jit` kernel, a launcher that
picks the grid, block and warps, and a `torch.autograd.Function` with a functional wrapper.
The dispatching entry points (`triton_ops.rms_norm`, ...) choose between these and
`triton_ops.reference`.
"""
from .cross_entropy import LinearCrossEntropyFunction, default_chunk_tokens, linear_cross_entropy
from .rms_norm import RMSNormFunction, rms_norm
from .rope import RopeFunction, rope
from .swiglu import SwiGLUFunction, swiglu

__all__ = [
    "LinearCrossEntropyFunction",
    "RMSNormFunction",
    "RopeFunction",
    "SwiGLUFunction",
    "default_chunk_tokens",
    "linear_cross_entropy",
    "rms_norm",
    "rope",
    "swiglu",
]
