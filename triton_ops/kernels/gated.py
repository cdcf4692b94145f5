"""What the gated activations (swiglu.py, geglu.py) share: the launch of an elementwise kernel
c = act(a) * b over two inputs of one shape, of its backward writing da and db (over a and b
when asked), and the autograd Function that saves a and b between them."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 4096


@triton.jit
def forward_operands(a_ptr, b_ptr, n, BLOCK: tl.constexpr):
    """(offs, mask, a, b) of this program's flat block of BLOCK elements, loaded in fp32."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    a = tl.load(a_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    return offs, mask, a, b


@triton.jit
def backward_operands(dc_ptr, a_ptr, b_ptr, n, BLOCK: tl.constexpr):
    """(offs, mask, dc, a, b) of this program's flat block of BLOCK elements, loaded in fp32."""
    offs, mask, a, b = forward_operands(a_ptr, b_ptr, n, BLOCK)
    return offs, mask, tl.load(dc_ptr + offs, mask=mask, other=0.0).to(tl.float32), a, b


def launch_forward(kernel, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Run `kernel(a, b, c, n, BLOCK)` on contiguous a, b of one shape and dtype. Returns c."""
    c = torch.empty_like(a)
    n = a.numel()
    kernel[(triton.cdiv(n, _BLOCK),)](a, b, c, n, BLOCK=_BLOCK, num_warps=8)
    return c


def launch_backward(kernel, dc: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                    in_place: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Run `kernel(dc, a, b, da, db, n, BLOCK)`. With `in_place`, da and db are written over a and b."""
    dc = dc.contiguous()
    da, db = (a, b) if in_place else (torch.empty_like(a), torch.empty_like(b))
    n = a.numel()
    kernel[(triton.cdiv(n, _BLOCK),)](dc, a, b, da, db, n, BLOCK=_BLOCK, num_warps=8)
    return da, db


def checked_inputs(name: str, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gate and up made contiguous; a clear error where their shapes or dtypes differ."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"{name} needs gate and up of one shape and dtype")
    return gate.contiguous(), up.contiguous()


def gated_function(name: str, forward_kernel, backward_kernel) -> type[torch.autograd.Function]:
    """The autograd Function of c = act(gate) * up for one pair of kernels: apply(gate, up,
    in_place_backward); it saves gate and up, and its backward may write over them."""

    class GatedFunction(torch.autograd.Function):
        @staticmethod
        def forward(ctx, gate, up, in_place_backward):
            gate, up = checked_inputs(name.lower(), gate, up)
            c = launch_forward(forward_kernel, gate, up)
            ctx.save_for_backward(gate, up)
            ctx.in_place_backward = in_place_backward
            return c

        @staticmethod
        def backward(ctx, dc):
            gate, up = ctx.saved_tensors
            da, db = launch_backward(backward_kernel, dc, gate, up, ctx.in_place_backward)
            return da, db, None

    GatedFunction.__name__ = GatedFunction.__qualname__ = f"{name}Function"
    GatedFunction.__doc__ = f"c = {name.lower()}(gate, up); gate, up (..., I) of one dtype. Saves gate and up."
    return GatedFunction


def gated_entry(function: type[torch.autograd.Function], formula: str, reference: str):
    """The public op of a gated Function: `op(gate, up, in_place_backward=False)` -> c."""

    def op(gate: torch.Tensor, up: torch.Tensor, in_place_backward: bool = False) -> torch.Tensor:
        return function.apply(gate, up, in_place_backward)

    op.__doc__ = f"""Triton {formula}; see `{reference}`.

    Args:
        gate: (..., I) output of gate_proj.
        up: (..., I) output of up_proj.
        in_place_backward: let the backward overwrite gate and up with their gradients (only
            where nothing else reads them, as inside the MLP).

    Returns:
        (..., I) tensor of the inputs' dtype.
    """
    return op
