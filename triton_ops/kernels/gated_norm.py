"""The gated RMSNorm of Qwen3.5's linear attention (`Qwen3_5RMSNormGated`): the attention's output
normalized per head and multiplied by SiLU of the gate projection, in one pass each way.

Forward, per row x (H,) with its gate z (H,), with HF's roundings (d = x's dtype):
    rstd = 1 / sqrt(mean(x_f32**2) + eps)
    n = (x_f32 * rstd).to(d)
    a = (w * n).to(d)                     # HF multiplies in the weight's and input's dtype
    y = (a_f32 * silu(z_f32)).to(d)
Backward, with s = silu(z_f32), sig = sigmoid(z_f32), fp32 inside:
    da = (dy * s).to(d)                   # the gradient reaching a (a tensor of dtype d)
    dz = dy * a * sig * (1 + z * (1 - sig))
    dn = (da * w).to(d),   dw = sum over rows of da * n
    dx = rstd * (dn - x_hat * mean(dn * x_hat)),   x_hat = x_f32 * rstd
Rows are processed in tiles of BLOCK_R rows, sized as the RMSNorm kernel sizes its tiles (H is a
head's dimension, 128 in Qwen3.5); the weight gradient is one fp32 partial per program, then a sum.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .rms_norm import _tile as _row_tiles

__all__ = ["GatedRMSNormFunction", "gated_rms_norm"]


@triton.jit
def _tile(x_ptr, z_ptr, w_ptr, H, n_rows, eps, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)[:, None]
    cols = tl.arange(0, BLOCK_H)[None, :]
    mask = (rows < n_rows) & (cols < H)
    x = tl.load(x_ptr + rows * H + cols, mask=mask, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + rows * H + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < H, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / H + eps)
    n = (x * rstd[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32)
    a = (w * n).to(x_ptr.dtype.element_ty).to(tl.float32)
    return rows, cols, mask, x, z, w, rstd, n, a


@triton.jit
def _fwd_kernel(x_ptr, z_ptr, w_ptr, y_ptr, H, n_rows, eps, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
    rows, cols, mask, x, z, w, rstd, n, a = _tile(x_ptr, z_ptr, w_ptr, H, n_rows, eps, BLOCK_R, BLOCK_H)
    y = a * (z * tl.sigmoid(z))
    tl.store(y_ptr + rows * H + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _bwd_kernel(x_ptr, z_ptr, w_ptr, dy_ptr, dx_ptr, dz_ptr, part_ptr, H, n_rows, eps,
                BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
    rows, cols, mask, x, z, w, rstd, n, a = _tile(x_ptr, z_ptr, w_ptr, H, n_rows, eps, BLOCK_R, BLOCK_H)
    dy = tl.load(dy_ptr + rows * H + cols, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(z)
    da = (dy * (z * sig)).to(x_ptr.dtype.element_ty).to(tl.float32)
    dz = dy * a * sig * (1.0 + z * (1.0 - sig))
    dn = (da * w).to(x_ptr.dtype.element_ty).to(tl.float32)       # HF's product in the dtype d
    x_hat = x * rstd[:, None]
    dx = rstd[:, None] * (dn - x_hat * (tl.sum(dn * x_hat, axis=1) / H)[:, None])
    tl.store(dx_ptr + rows * H + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
    tl.store(dz_ptr + rows * H + cols, dz.to(dz_ptr.dtype.element_ty), mask=mask)
    c = tl.arange(0, BLOCK_H)
    tl.store(part_ptr + tl.program_id(0).to(tl.int64) * H + c, tl.sum(tl.where(mask, da * n, 0.0), axis=0), mask=c < H)


class GatedRMSNormFunction(torch.autograd.Function):
    """y = (w * rmsnorm(x)) * silu(z) over the last dimension (the module docstring's roundings)."""

    @staticmethod
    def forward(ctx, x, gate, weight, eps):
        H = x.shape[-1]
        x2, z2 = x.reshape(-1, H).contiguous(), gate.reshape(-1, H).contiguous()
        w = weight.contiguous()
        y = torch.empty_like(x2)
        block_r, block_h, warps = _row_tiles(H)
        if x2.shape[0]:
            _fwd_kernel[(triton.cdiv(x2.shape[0], block_r),)](x2, z2, w, y, H, x2.shape[0], eps, BLOCK_R=block_r,
                                                             BLOCK_H=block_h, num_warps=warps)
        ctx.save_for_backward(x2, z2, w)
        ctx.eps, ctx.shape = eps, x.shape               # gate has x's shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2, z2, w = ctx.saved_tensors
        H = x2.shape[-1]
        dy2 = dy.reshape(-1, H).contiguous()
        dx, dz = torch.empty_like(x2), torch.empty_like(z2)
        block_r, block_h, warps = _row_tiles(H)
        grid = triton.cdiv(x2.shape[0], block_r)
        part = torch.empty((grid, H), dtype=torch.float32, device=x2.device)     # no rows: the sum is zeros
        if x2.shape[0]:
            _bwd_kernel[(grid,)](x2, z2, w, dy2, dx, dz, part, H, x2.shape[0], ctx.eps, BLOCK_R=block_r,
                                 BLOCK_H=block_h, num_warps=warps)
        dw = part.sum(0).to(w.dtype)
        return dx.view(ctx.shape), dz.view(ctx.shape), dw, None


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """(weight * RMSNorm(x)) * SiLU(gate) over the last dimension, in x's dtype
    (`triton_ops.reference.gated_rms_norm` is the mathematics)."""
    if gate.shape != x.shape or weight.shape != x.shape[-1:] or not x.dtype == gate.dtype == weight.dtype:
        raise ValueError(f"gated_rms_norm takes x, gate (..., H) and weight (H,) of one dtype, got x "
                         f"{tuple(x.shape)} {x.dtype}, gate {tuple(gate.shape)} {gate.dtype}, weight {tuple(weight.shape)} {weight.dtype}")
    return GatedRMSNormFunction.apply(x, gate, weight, eps)
