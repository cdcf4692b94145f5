"""Triton implementations of the fused ops; importing this package requires Triton.

Each module holds the three tiers of one op: a private `@triton.jit` kernel, a launcher that
picks the grid, block and warps, and a `torch.autograd.Function` with a functional wrapper.
The dispatching entry points (`triton_ops.rms_norm`, ...) choose between these and
`triton_ops.reference`. `adamw8` is an optimizer update, not an op of the model: a kernel and its
launcher, which `hf_slideformer.host.adam8_torch.adamw8_range` dispatches to.
"""
from .cross_entropy import LinearCrossEntropyFunction, default_chunk_tokens, linear_cross_entropy
from .geglu import GeGLUFunction, geglu
from .rms_norm import RMSNormFunction, RMSNormRowsFunction, rms_norm, rms_norm_rows
from .rope import RopeFunction, rope
from .swiglu import SwiGLUFunction, SwiGLURowsFunction, swiglu, swiglu_rows

__all__ = [
    "GeGLUFunction",
    "LinearCrossEntropyFunction",
    "RMSNormFunction",
    "RMSNormRowsFunction",
    "RopeFunction",
    "SwiGLUFunction",
    "SwiGLURowsFunction",
    "default_chunk_tokens",
    "geglu",
    "linear_cross_entropy",
    "rms_norm",
    "rms_norm_rows",
    "rope",
    "swiglu",
    "swiglu_rows",
]
