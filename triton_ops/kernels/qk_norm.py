"""The queries' and keys' preparation of the chunked gated delta rule (`triton_ops.gated_delta`), in
one pass each way: each head's rows L2-normalized in fp32 and scaled, moved to the heads-first fp32
layout the rule computes in, each key head repeated for the value heads it serves.

x is (B, T, Hk, D) in any strides, the output (B, Hk * R, T, D) fp32 contiguous; with
xf = x[b, t, k] in fp32, for each of the R heads h = k * R + j:
    y[b, h, t] = (xf * rstd) * scale,   rstd = 1 / sqrt(sum(xf**2) + eps)
the two products rounded as transformers' l2norm and its separate scale round them. Backward, with
g_j = dy[b, k * R + j, t] * scale and the same rstd:
    dx[b, t, k] = sum_j (rstd * g_j - rstd**3 * xf * sum(g_j * xf))
each head's term rounded to x's dtype (transformers' cast back from fp32), then summed over the R
heads in fp32 and rounded to x's dtype (the repeat's backward).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["QKNormFunction", "qk_l2norm"]

_BLOCK_T = 16


@triton.jit
def _tile(x_ptr, sB, sT, sH, T, D, eps, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """This program's (BLOCK_T, BLOCK_D) rows of key head k: (b, k, t, d, x fp32, mask, rstd)."""
    b = tl.program_id(0).to(tl.int64)
    k = tl.program_id(1).to(tl.int64)
    t = tl.program_id(2) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.arange(0, BLOCK_D)
    m = (t < T)[:, None] & (d < D)[None, :]
    x = tl.load(x_ptr + b * sB + t[:, None] * sT + k * sH + d[None, :], mask=m, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) + eps)
    return b, k, t, d, x, m, rstd


@triton.jit
def _head(b, k, j, t, d, T, D, Hk, R: tl.constexpr):
    """Offsets of the rows t of output head k * R + j in the (B, Hk * R, T, D) layout."""
    return ((b * Hk * R + k * R + j) * T + t[:, None]) * D + d[None, :]


@triton.jit
def _fwd_kernel(x_ptr, y_ptr, sB, sT, sH, T, D, Hk, scale, eps, R: tl.constexpr,
                BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    b, k, t, d, x, m, rstd = _tile(x_ptr, sB, sT, sH, T, D, eps, BLOCK_T, BLOCK_D)
    y = (x * rstd[:, None]) * scale
    for j in tl.static_range(R):
        tl.store(y_ptr + _head(b, k, j, t, d, T, D, Hk, R), y, mask=m)


@triton.jit
def _bwd_kernel(x_ptr, dy_ptr, dx_ptr, sB, sT, sH, T, D, Hk, scale, eps, R: tl.constexpr,
                BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    b, k, t, d, x, m, rstd = _tile(x_ptr, sB, sT, sH, T, D, eps, BLOCK_T, BLOCK_D)
    acc = tl.zeros((BLOCK_T, BLOCK_D), tl.float32)
    for j in tl.static_range(R):
        g = tl.load(dy_ptr + _head(b, k, j, t, d, T, D, Hk, R), mask=m, other=0.0) * scale
        gx = tl.sum(g * x, axis=1)
        dxj = rstd[:, None] * g - (rstd * rstd * rstd * gx)[:, None] * x
        acc += dxj.to(dx_ptr.dtype.element_ty).to(tl.float32)        # each head's, rounded as HF's cast
    tl.store(dx_ptr + ((b * T + t[:, None]) * Hk + k) * D + d[None, :], acc.to(dx_ptr.dtype.element_ty), mask=m)


def _launch(kernel, x: torch.Tensor, tensors: tuple, scale: float, eps: float, R: int) -> None:
    """kernel(x, *tensors, x's strides, T, D, Hk, scale, eps) over (B, Hk, T / BLOCK_T) programs."""
    B, T, Hk, D = x.shape
    if x.numel():
        grid = (B, Hk, triton.cdiv(T, _BLOCK_T))
        kernel[grid](x, *tensors, x.stride(0), x.stride(1), x.stride(2), T, D, Hk, scale, eps, R=R,
                     BLOCK_T=_BLOCK_T, BLOCK_D=triton.next_power_of_2(max(D, 16)), num_warps=4)


class QKNormFunction(torch.autograd.Function):
    """(B, T, Hk, D) -> (B, Hk * repeat, T, D) fp32: each row L2-normalized, then scaled."""

    @staticmethod
    def forward(ctx, x, repeat, scale, eps):
        if x.stride(-1) != 1:
            x = x.contiguous()
        B, T, Hk, D = x.shape
        y = torch.empty((B, Hk * repeat, T, D), dtype=torch.float32, device=x.device)
        _launch(_fwd_kernel, x, (y,), float(scale), float(eps), repeat)
        ctx.save_for_backward(x)
        ctx.repeat, ctx.scale, ctx.eps = repeat, float(scale), float(eps)
        return y

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        _launch(_bwd_kernel, x, (dy.contiguous(), dx), ctx.scale, ctx.eps, ctx.repeat)
        return dx, None, None, None


def qk_l2norm(x: torch.Tensor, repeat: int = 1, scale: float = 1.0, eps: float = 1e-6) -> torch.Tensor:
    """Queries or keys (B, T, Hk, D) L2-normalized per row in fp32, scaled, heads first and each head
    repeated `repeat` times: (B, Hk * repeat, T, D) fp32 (`triton_ops.reference.qk_l2norm`)."""
    if x.dim() != 4 or repeat < 1:
        raise ValueError(f"qk_l2norm takes x (B, T, heads, dim) and repeat >= 1, got {tuple(x.shape)}, {repeat}")
    return QKNormFunction.apply(x, int(repeat), scale, eps)
