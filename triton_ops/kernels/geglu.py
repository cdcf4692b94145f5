"""GeGLU activation: gelu_tanh(gate) * up in one pass, fp32 inside, rounded as HF's Gemma MLP.

HF's Gemma MLP computes `act_fn(gate) * up` with `act_fn = F.gelu(approximate="tanh")`
(`gelu_pytorch_tanh`): the activation is rounded to the input dtype, then the product is.
This kernel rounds at the same two places, so in bfloat16 its output is HF's up to the last bit
of the activation. Forward, elementwise on gate a and up b, with k = sqrt(2 / pi):
    u = k * (a + 0.044715 * a**3)
    g = a * sigmoid(2u)                 # = 0.5 * a * (1 + tanh(u))
    c = (g.to(dtype) * b).to(dtype)
Backward, with s = sigmoid(2u) (1 - tanh(u)**2 = 4 s (1 - s)):
    g'  = s + 2 * a * s * (1 - s) * k * (1 + 3 * 0.044715 * a**2)
    da  = dc * b * g'                   # fp32, one rounding (HF rounds dc * b first)
    db  = dc * g.to(dtype)              # the rounded activation, as HF's product saw it
The backward can write da over a and db over b (the saved inputs): inside an MLP they are
temporaries that nothing else reads, and this saves two activations of size (..., I), as the
SwiGLU kernel does (`kernels/swiglu.py`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gated import backward_operands, forward_operands, gated_entry, gated_function

__all__ = ["GeGLUFunction", "geglu"]

_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)     # sqrt(2 / pi)
_CUBIC = tl.constexpr(0.044715)


@triton.jit
def _gelu_tanh_parts(a):
    """(gelu_tanh(a), sigmoid(2u)) in fp32 for fp32 a; u = sqrt(2 / pi) * (a + 0.044715 a**3)."""
    u = _SQRT_2_OVER_PI * (a + _CUBIC * a * a * a)
    s = tl.sigmoid(2.0 * u)
    return a * s, s


@triton.jit
def _geglu_fwd_kernel(a_ptr, b_ptr, c_ptr, n, BLOCK: tl.constexpr):
    """c = (gelu_tanh(a).to(dtype) * b).to(dtype) over a flat block of BLOCK elements."""
    offs, mask, a, b = forward_operands(a_ptr, b_ptr, n, BLOCK)
    g, _ = _gelu_tanh_parts(a)
    g = g.to(c_ptr.dtype.element_ty).to(tl.float32)          # HF's act_fn output, in the input dtype
    tl.store(c_ptr + offs, (g * b).to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _geglu_bwd_kernel(dc_ptr, a_ptr, b_ptr, da_ptr, db_ptr, n, BLOCK: tl.constexpr):
    """da, db of c = gelu_tanh(a) * b; da/db may alias a/b (each element is read before written)."""
    offs, mask, dc, a, b = backward_operands(dc_ptr, a_ptr, b_ptr, n, BLOCK)
    g, s = _gelu_tanh_parts(a)
    dg = s + 2.0 * a * s * (1.0 - s) * _SQRT_2_OVER_PI * (1.0 + 3.0 * _CUBIC * a * a)
    da = dc * b * dg
    db = dc * g.to(a_ptr.dtype.element_ty).to(tl.float32)
    tl.store(da_ptr + offs, da.to(da_ptr.dtype.element_ty), mask=mask)
    tl.store(db_ptr + offs, db.to(db_ptr.dtype.element_ty), mask=mask)


GeGLUFunction = gated_function("GeGLU", _geglu_fwd_kernel, _geglu_bwd_kernel)


geglu = gated_entry(GeGLUFunction, "gelu_tanh(gate) * up", "triton_ops.reference.geglu")
