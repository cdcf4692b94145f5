"""SwiGLU activation: SiLU(gate) * up in one pass, fp32 inside, one rounding at the end.

Forward, elementwise on gate a and up b:
    c = a * sigmoid(a) * b
Backward, with sig = sigmoid(a):
    da = dc * b * sig * (1 + a * (1 - sig))
    db = dc * a * sig
The backward can write da over a and db over b (the saved inputs): inside an MLP they are
temporaries that nothing else reads, and this saves two activations of size (..., I).

`SwiGLURowsFunction` is the same activation for an output that an FP8 GEMM reads next (the down
projection): its forward runs one program per row and also writes c's e4m3 form with one
power-of-two scale per row, bit for bit `triton_ops.reference.fp8_quantize_rows(c)`; rows up to
`_ONE_PASS_MAX` long stay in registers, longer ones are read back from c for the second pass.
Its backward is the plain activation's.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fp8_quant import _ONE_PASS_MAX, _ROW_BLOCK, _pow2_scale
from .gated import backward_operands, forward_operands, checked_inputs, gated_entry, gated_function

__all__ = ["SwiGLUFunction", "SwiGLURowsFunction", "swiglu", "swiglu_rows"]



@triton.jit
def _swiglu_fwd_kernel(a_ptr, b_ptr, c_ptr, n, BLOCK: tl.constexpr):
    """c = silu(a) * b over a flat block of BLOCK elements."""
    offs, mask, a, b = forward_operands(a_ptr, b_ptr, n, BLOCK)
    c = a * tl.sigmoid(a) * b
    tl.store(c_ptr + offs, c.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_rows_kernel(a_ptr, b_ptr, c_ptr, q_ptr, inv_ptr, I, BLOCK: tl.constexpr, ONE_PASS: tl.constexpr):
    """Row r of a, b, c, q (M, I) contiguous: c = silu(a) * b, q = c's row in e4m3, inv[r] its
    inverse scale. With ONE_PASS (I <= BLOCK) the row stays in registers; otherwise c is written
    in chunks while the maximum is taken, then read back and quantized."""
    r = tl.program_id(0).to(tl.int64)
    base = r * I
    if ONE_PASS:
        offs = tl.arange(0, BLOCK)
        mask = offs < I
        a = tl.load(a_ptr + base + offs, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + base + offs, mask=mask, other=0.0).to(tl.float32)
        c = (a * tl.sigmoid(a) * b).to(c_ptr.dtype.element_ty)
        tl.store(c_ptr + base + offs, c, mask=mask)
        cf = c.to(tl.float32)
        scale, inv = _pow2_scale(tl.max(tl.abs(cf), axis=0))
        tl.store(q_ptr + base + offs, tl.clamp(cf * scale, -448.0, 448.0).to(tl.float8e4nv), mask=mask)
    else:
        amax = tl.zeros((BLOCK,), tl.float32)
        for k in range(0, I, BLOCK):
            offs = k + tl.arange(0, BLOCK)
            mask = offs < I
            a = tl.load(a_ptr + base + offs, mask=mask, other=0.0).to(tl.float32)
            b = tl.load(b_ptr + base + offs, mask=mask, other=0.0).to(tl.float32)
            c = (a * tl.sigmoid(a) * b).to(c_ptr.dtype.element_ty)
            tl.store(c_ptr + base + offs, c, mask=mask)
            amax = tl.maximum(amax, tl.abs(c.to(tl.float32)))
        scale, inv = _pow2_scale(tl.max(amax, axis=0))
        for k in range(0, I, BLOCK):
            offs = k + tl.arange(0, BLOCK)
            mask = offs < I
            cf = tl.load(c_ptr + base + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(q_ptr + base + offs, tl.clamp(cf * scale, -448.0, 448.0).to(tl.float8e4nv), mask=mask)
    tl.store(inv_ptr + r, inv)


@triton.jit
def _swiglu_bwd_kernel(dc_ptr, a_ptr, b_ptr, da_ptr, db_ptr, n, BLOCK: tl.constexpr):
    """da, db of c = silu(a) * b; da/db may alias a/b (each element is read before written)."""
    offs, mask, dc, a, b = backward_operands(dc_ptr, a_ptr, b_ptr, n, BLOCK)
    sig = tl.sigmoid(a)
    silu = a * sig
    da = dc * b * sig * (1.0 + a * (1.0 - sig))
    db = dc * silu
    tl.store(da_ptr + offs, da.to(da_ptr.dtype.element_ty), mask=mask)
    tl.store(db_ptr + offs, db.to(db_ptr.dtype.element_ty), mask=mask)


def swiglu_rows_forward(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the row kernel on contiguous a, b (..., I). Returns c, q (M, I) e4m3, inv (M, 1) fp32."""
    c = torch.empty_like(a)
    I = a.shape[-1]
    M = a.numel() // I if I else 0
    q = torch.empty((M, I), dtype=torch.float8_e4m3fn, device=a.device)
    inv = torch.empty((M, 1), dtype=torch.float32, device=a.device)
    if M and I:
        one_pass = I <= _ONE_PASS_MAX
        block = triton.next_power_of_2(max(I, 16)) if one_pass else _ROW_BLOCK
        warps = 16 if block >= 8192 else 8 if block >= 2048 else 4
        _swiglu_rows_kernel[(M,)](a, b, c, q, inv, I, BLOCK=block, ONE_PASS=one_pass, num_warps=warps)
    return c, q, inv


SwiGLUFunction = gated_function("SwiGLU", _swiglu_fwd_kernel, _swiglu_bwd_kernel)


class SwiGLURowsFunction(torch.autograd.Function):
    """`SwiGLUFunction` whose forward also returns c's rows in e4m3: (c, q, inv), q and inv without
    gradient. The backward is the plain activation's."""

    @staticmethod
    def forward(ctx, gate, up, in_place_backward):
        gate, up = checked_inputs("swiglu", gate, up)
        c, q, inv = swiglu_rows_forward(gate, up)
        ctx.save_for_backward(gate, up)
        ctx.in_place_backward = in_place_backward
        ctx.mark_non_differentiable(q, inv)
        return c, q, inv

    @staticmethod
    def backward(ctx, dc, _dq, _dinv):
        return SwiGLUFunction.backward(ctx, dc)


def swiglu_rows(gate: torch.Tensor, up: torch.Tensor,
                in_place_backward: bool = False) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """`swiglu` that also returns its output's rows in e4m3, as the fp8 recipe quantizes them.

    Returns:
        c (..., I), and (q (M, I) float8_e4m3fn, inv (M, 1) float32) with M = c.numel() // I.
    """
    c, q, inv = SwiGLURowsFunction.apply(gate, up, in_place_backward)
    return c, (q, inv)


swiglu = gated_entry(SwiGLUFunction, "SiLU(gate) * up", "triton_ops.reference.swiglu")
