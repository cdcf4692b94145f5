"""Causal depthwise convolution with an optional SiLU, as the linear-attention layers of Qwen3.5
run it (transformers' `causal_conv1d_fn` without the causal-conv1d package): forward and backward
without a copy of the input into the (B, C, T) layout that cuDNN's grouped convolution works in.

x is (B, C, T) with any strides (the layers pass the projection's (B, T, C) output transposed, so
channels are contiguous), w is (C, K). Per channel c and position t, with x = 0 before t = 0:
    pre[b, c, t] = round(sum_k w[c, k] * x[b, c, t - (K - 1) + k])          (fp32 sum, then w's dtype)
    y[b, c, t]   = round(silu(pre))   (or pre without the activation), then in x's dtype
the roundings are HF's: the convolution's output in the weight's dtype, the activation's, the cast.
Backward, with dpre = round(dy * sig(pre) * (1 + pre * (1 - sig(pre)))) (torch's SiLU backward,
rounded to the dtype its output has in HF's graph):
    dx[b, c, t] = sum_k w[c, k] * dpre[b, c, t + (K - 1) - k]
    dw[c, k]    = sum_{b, t} dpre[b, c, t] * x[b, c, t - (K - 1) + k]
Two backward kernels: the first recomputes pre, writes dpre and each tile's dw partial sums; the
second is dx, a convolution of dpre. The partials are summed in fp32 by torch.

Tiles are (BLOCK_T positions, BLOCK_C channels), channels along the vector lanes (the contiguous
dimension in the layers' layout); the K shifted rows come from cache.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["CausalConvFunction", "causal_conv"]

_BLOCK_T = 32
_BLOCK_C = 128


@triton.jit
def _load_x(x_ptr, b, t, c, sB, sC, sT, T, C):
    """x[b, c, t] for a (BLOCK_T,) column of t and a (BLOCK_C,) row of c, 0 outside [0, T) x [0, C)."""
    m = ((t >= 0) & (t < T))[:, None] & (c < C)[None, :]
    return tl.load(x_ptr + b * sB + t[:, None] * sT + c[None, :] * sC, mask=m, other=0.0).to(tl.float32)


@triton.jit
def _pre(x_ptr, w_ptr, b, t, c, sB, sC, sT, T, C, K: tl.constexpr):
    """The convolution at positions t (fp32 sum), rounded to w's dtype and widened again."""
    acc = tl.zeros((t.shape[0], c.shape[0]), tl.float32)
    for k in tl.static_range(K):
        wk = tl.load(w_ptr + c * K + k, mask=c < C, other=0.0).to(tl.float32)
        acc += wk[None, :] * _load_x(x_ptr, b, t - (K - 1) + k, c, sB, sC, sT, T, C)
    return acc.to(w_ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def _fwd_kernel(x_ptr, w_ptr, y_ptr, sB, sC, sT, T, C, K: tl.constexpr, SILU: tl.constexpr,
                BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    pre = _pre(x_ptr, w_ptr, b, t, c, sB, sC, sT, T, C, K)
    y = pre * tl.sigmoid(pre) if SILU else pre
    y = y.to(w_ptr.dtype.element_ty).to(y_ptr.dtype.element_ty)
    m = (t < T)[:, None] & (c < C)[None, :]
    tl.store(y_ptr + b * sB + t[:, None] * sT + c[None, :] * sC, y, mask=m)


@triton.jit
def _bwd_pre_kernel(x_ptr, w_ptr, dy_ptr, dp_ptr, part_ptr, sB, sC, sT, dB, dC, dT, T, C, n_t,
                    K: tl.constexpr, SILU: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """dpre of a tile into dp (x's strides), and the tile's dw partials into part[(b, tile), c, k]."""
    b = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    t = tile * BLOCK_T + tl.arange(0, BLOCK_T)
    c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    m = (t < T)[:, None] & (c < C)[None, :]
    dy = tl.load(dy_ptr + b * dB + t[:, None] * dT + c[None, :] * dC, mask=m, other=0.0).to(tl.float32)
    if SILU:
        pre = _pre(x_ptr, w_ptr, b, t, c, sB, sC, sT, T, C, K)
        sig = tl.sigmoid(pre)
        dp = dy * sig * (1.0 + pre * (1.0 - sig))
    else:
        dp = dy
    dp = tl.where(m, dp, 0.0).to(dp_ptr.dtype.element_ty)
    tl.store(dp_ptr + b * sB + t[:, None] * sT + c[None, :] * sC, dp, mask=m)
    dpf = dp.to(tl.float32)
    row = (b * n_t + tile) * C * K
    for k in tl.static_range(K):
        xk = _load_x(x_ptr, b, t - (K - 1) + k, c, sB, sC, sT, T, C)
        tl.store(part_ptr + row + c * K + k, tl.sum(dpf * xk, axis=0), mask=c < C)


@triton.jit
def _bwd_dx_kernel(dp_ptr, w_ptr, dx_ptr, sB, sC, sT, T, C, K: tl.constexpr,
                   BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """dx = sum_k w[:, k] * dpre shifted forward by K - 1 - k (dp and dx in x's strides)."""
    b = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    acc = tl.zeros((BLOCK_T, BLOCK_C), tl.float32)
    for k in tl.static_range(K):
        wk = tl.load(w_ptr + c * K + k, mask=c < C, other=0.0).to(tl.float32)
        acc += wk[None, :] * _load_x(dp_ptr, b, t + (K - 1) - k, c, sB, sC, sT, T, C)
    m = (t < T)[:, None] & (c < C)[None, :]
    tl.store(dx_ptr + b * sB + t[:, None] * sT + c[None, :] * sC, acc.to(dx_ptr.dtype.element_ty), mask=m)


def _dense(x: torch.Tensor) -> bool:
    """Whether x's elements fill its storage span without overlap: its strides then suit a new tensor."""
    return x.is_contiguous() or x.transpose(1, 2).is_contiguous()


def _grid(x: torch.Tensor) -> tuple[int, int, int]:
    B, C, T = x.shape
    return B, triton.cdiv(T, _BLOCK_T), triton.cdiv(C, _BLOCK_C)


class CausalConvFunction(torch.autograd.Function):
    """y = act(causal depthwise conv(x, w)); saves x and w, recomputes the convolution in backward."""

    @staticmethod
    def forward(ctx, x, weight, silu):
        _, C, T = x.shape
        if not _dense(x):
            x = x.contiguous()
        w = weight.contiguous()
        y = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device)
        if x.numel():
            _fwd_kernel[_grid(x)](x, w, y, *x.stride(), T, C, K=w.shape[1], SILU=silu,
                                  BLOCK_T=_BLOCK_T, BLOCK_C=_BLOCK_C, num_warps=4)
        ctx.save_for_backward(x, w)
        ctx.silu = silu
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        B, C, T = x.shape
        K = w.shape[1]
        dp = torch.empty_strided(x.shape, x.stride(), dtype=w.dtype, device=x.device)
        dx = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device)
        grid = _grid(x)
        part = torch.empty((B * grid[1], C, K), dtype=torch.float32, device=x.device)
        if x.numel():
            _bwd_pre_kernel[grid](x, w, dy, dp, part, *x.stride(), *dy.stride(), T, C, grid[1], K=K,
                                  SILU=ctx.silu, BLOCK_T=_BLOCK_T, BLOCK_C=_BLOCK_C, num_warps=4)
            _bwd_dx_kernel[grid](dp, w, dx, *x.stride(), T, C, K=K, BLOCK_T=_BLOCK_T, BLOCK_C=_BLOCK_C,
                                 num_warps=4)
        dw = part.sum(0).to(w.dtype)                  # no tiles (an empty x): zeros
        return dx, dw, None


def causal_conv(x: torch.Tensor, weight: torch.Tensor, silu: bool) -> torch.Tensor:
    """act(causal depthwise convolution) of x (B, C, T) by weight (C, K): the output in x's dtype
    and strides, rounded through the weight's (`triton_ops.reference.causal_conv` is the mathematics)."""
    if x.dim() != 3 or weight.dim() != 2 or weight.shape[0] != x.shape[1]:
        raise ValueError(f"causal_conv takes x (B, C, T) and weight (C, K), got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    return CausalConvFunction.apply(x, weight, silu)
