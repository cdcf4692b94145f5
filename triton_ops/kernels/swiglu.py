"""SwiGLU activation: SiLU(gate) * up in one pass, fp32 inside, one rounding at the end.

Forward, elementwise on gate a and up b:
    c = a * sigmoid(a) * b
Backward, with sig = sigmoid(a):
    da = dc * b * sig * (1 + a * (1 - sig))
    db = dc * a * sig
The backward can write da over a and db over b (the saved inputs): inside an MLP they are
temporaries that nothing else reads, and this saves two activations of size (..., I).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["SwiGLUFunction", "swiglu"]

_BLOCK = 4096


@triton.jit
def _swiglu_fwd_kernel(a_ptr, b_ptr, c_ptr, n, BLOCK: tl.constexpr):
    """c = silu(a) * b over a flat block of BLOCK elements."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    a = tl.load(a_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    c = a * tl.sigmoid(a) * b
    tl.store(c_ptr + offs, c.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(dc_ptr, a_ptr, b_ptr, da_ptr, db_ptr, n, BLOCK: tl.constexpr):
    """da, db of c = silu(a) * b; da/db may alias a/b (each element is read before written)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    dc = tl.load(dc_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    a = tl.load(a_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(a)
    silu = a * sig
    da = dc * b * sig * (1.0 + a * (1.0 - sig))
    db = dc * silu
    tl.store(da_ptr + offs, da.to(da_ptr.dtype.element_ty), mask=mask)
    tl.store(db_ptr + offs, db.to(db_ptr.dtype.element_ty), mask=mask)


def swiglu_forward(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Launch the forward on contiguous a, b of one shape and dtype. Returns c."""
    c = torch.empty_like(a)
    n = a.numel()
    _swiglu_fwd_kernel[(triton.cdiv(n, _BLOCK),)](a, b, c, n, BLOCK=_BLOCK, num_warps=8)
    return c


def swiglu_backward(dc: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                    in_place: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the backward. With `in_place`, da and db are written over a and b."""
    dc = dc.contiguous()
    da, db = (a, b) if in_place else (torch.empty_like(a), torch.empty_like(b))
    n = a.numel()
    _swiglu_bwd_kernel[(triton.cdiv(n, _BLOCK),)](dc, a, b, da, db, n, BLOCK=_BLOCK, num_warps=8)
    return da, db


class SwiGLUFunction(torch.autograd.Function):
    """c = silu(gate) * up; gate, up (..., I) of one dtype. Saves gate and up."""

    @staticmethod
    def forward(ctx, gate, up, in_place_backward):
        if gate.shape != up.shape or gate.dtype != up.dtype:
            raise ValueError("swiglu needs gate and up of one shape and dtype")
        gate, up = gate.contiguous(), up.contiguous()
        c = swiglu_forward(gate, up)
        ctx.save_for_backward(gate, up)
        ctx.in_place_backward = in_place_backward
        return c

    @staticmethod
    def backward(ctx, dc):
        gate, up = ctx.saved_tensors
        da, db = swiglu_backward(dc, gate, up, ctx.in_place_backward)
        return da, db, None


def swiglu(gate: torch.Tensor, up: torch.Tensor, in_place_backward: bool = False) -> torch.Tensor:
    """Triton SiLU(gate) * up; see `triton_ops.reference.swiglu`.

    Args:
        gate: (..., I) output of gate_proj.
        up: (..., I) output of up_proj.
        in_place_backward: let the backward overwrite gate and up with their gradients (only
            where nothing else reads them, as inside the MLP).

    Returns:
        (..., I) tensor of the inputs' dtype.
    """
    return SwiGLUFunction.apply(gate, up, in_place_backward)
