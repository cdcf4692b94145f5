"""Rotary position embedding of queries and keys, in place, one program per (batch, position).

With x = (x1, x2) the two halves of a head (D/2 each) and the tables split the same way,
cos = (c1, c2), sin = (s1, s2), HF's `x * cos + rotate_half(x) * sin` is
    y1 = x1 * c1 - x2 * s1
    y2 = x2 * c2 + x1 * s2
and its transpose, the backward, is the same map with (s1, s2) replaced by (-s2, -s1):
    dx1 = dy1 * c1 + dy2 * s2
    dx2 = dy2 * c2 - dy1 * s1
A program loads its position's tables once and rotates every query head and every key head
(GQA: Hk <= Hq) as a (heads, D/2) tile. Strides are taken as they come, so the usual
`proj(x).view(B, S, H, D).transpose(1, 2)` layout is rotated where it lies, without a copy.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["RopeFunction", "rope"]


@triton.jit
def _rotate_heads(base, stride_h, n_heads, c1, c2, s1, s2, HALF: tl.constexpr,
                  BLOCK_HEADS: tl.constexpr, BLOCK_D: tl.constexpr):
    heads = tl.arange(0, BLOCK_HEADS)[:, None]                                # (Hb, 1)
    d = tl.arange(0, BLOCK_D)[None, :]                                        # (1, Db)
    mask = (heads < n_heads) & (d < HALF)
    ptr = base + heads * stride_h + d
    x1 = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptr + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(ptr, (x1 * c1 - x2 * s1).to(base.dtype.element_ty), mask=mask)
    tl.store(ptr + HALF, (x2 * c2 + x1 * s2).to(base.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr, cos_ptr, sin_ptr,
    S, n_q_heads, n_k_heads,
    sq_b, sq_h, sq_s, sk_b, sk_h, sk_s, sc_b, sc_s,
    HALF: tl.constexpr,
    BLOCK_QH: tl.constexpr,
    BLOCK_KH: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BACKWARD: tl.constexpr,
):
    """Rotate q[b, :, s, :] (Hq, D) and k[b, :, s, :] (Hk, D) in place by the angle of (b, s).

    cos/sin are (B or 1, S, D) with the batch stride sc_b (0 when shared across the batch).
    BACKWARD applies the transposed rotation (sin halves swapped and negated).
    """
    pid = tl.program_id(0).to(tl.int64)
    b = pid // S
    s = pid % S
    d = tl.arange(0, BLOCK_D)[None, :]
    dmask = d < HALF
    t = b * sc_b + s * sc_s + d
    c1 = tl.load(cos_ptr + t, mask=dmask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + t + HALF, mask=dmask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + t, mask=dmask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + t + HALF, mask=dmask, other=0.0).to(tl.float32)
    if BACKWARD:
        neg_s2 = -s2
        s2 = -s1
        s1 = neg_s2
    _rotate_heads(q_ptr + b * sq_b + s * sq_s, sq_h, n_q_heads, c1, c2, s1, s2, HALF, BLOCK_QH, BLOCK_D)
    _rotate_heads(k_ptr + b * sk_b + s * sk_s, sk_h, n_k_heads, c1, c2, s1, s2, HALF, BLOCK_KH, BLOCK_D)


def _axes(x: torch.Tensor, head_dim_axis: int) -> tuple[int, int, int, int]:
    """(heads, stride_b, stride_h, stride_s) of a (B, H, S, D) or (B, S, H, D) tensor."""
    seq_axis = 3 - head_dim_axis
    return x.shape[head_dim_axis], x.stride(0), x.stride(head_dim_axis), x.stride(seq_axis)


def rope_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
          unsqueeze_dim: int = 1, backward: bool = False) -> None:
    """Launch the rotation of q and k in place (or its transpose, with `backward`).

    Args:
        q: (B, Hq, S, D) with unsqueeze_dim=1, (B, S, Hq, D) with unsqueeze_dim=2; unit stride on D.
        k: the same layout with Hk heads.
        cos, sin: (B or 1, S, D).
    """
    if unsqueeze_dim not in (1, 2):
        raise ValueError(f"unsqueeze_dim must be 1 or 2, got {unsqueeze_dim}")
    B, D = q.shape[0], q.shape[-1]
    S = q.shape[3 - unsqueeze_dim]
    if D % 2 or q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("rope needs an even head dimension with unit stride")
    if cos.dim() == 2:
        cos, sin = cos[None], sin[None]
    if cos.stride(-1) != 1 or cos.stride() != sin.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    hq, sq_b, sq_h, sq_s = _axes(q, unsqueeze_dim)
    hk, sk_b, sk_h, sk_s = _axes(k, unsqueeze_dim)
    sc_b = cos.stride(0) if cos.shape[0] > 1 else 0
    half = D // 2
    block_d = triton.next_power_of_2(half)
    block_qh = triton.next_power_of_2(hq)
    num_warps = 8 if block_qh * block_d >= 4096 else 4
    _rope_kernel[(B * S,)](
        q, k, cos, sin, S, hq, hk, sq_b, sq_h, sq_s, sk_b, sk_h, sk_s, sc_b, cos.stride(1),
        HALF=half, BLOCK_QH=block_qh, BLOCK_KH=triton.next_power_of_2(hk), BLOCK_D=block_d,
        BACKWARD=backward, num_warps=num_warps,
    )


def _writable_grad(g: torch.Tensor) -> torch.Tensor:
    """The incoming gradient if it can be rotated in place (unit stride on D, no expanded
    dimension), else a dense copy."""
    expanded = any(st == 0 and n > 1 for st, n in zip(g.stride(), g.shape))
    return g.contiguous() if expanded or g.stride(-1) != 1 else g


class RopeFunction(torch.autograd.Function):
    """(q, k) -> (rotate(q), rotate(k)) in place; q (B, Hq, S, D), k (B, Hk, S, D).

    The inputs are marked dirty and returned. The backward rotates the incoming gradients in
    place (they are fresh buffers from the attention's backward) by the transposed rotation.
    """

    @staticmethod
    def forward(ctx, q, k, cos, sin, unsqueeze_dim):
        rope_(q, k, cos, sin, unsqueeze_dim)
        ctx.mark_dirty(q, k)
        ctx.save_for_backward(cos, sin)
        ctx.unsqueeze_dim = unsqueeze_dim
        ctx.q_shape, ctx.k_shape, ctx.dtype = q.shape, k.shape, q.dtype
        return q, k

    @staticmethod
    def backward(ctx, dq, dk):
        cos, sin = ctx.saved_tensors
        if dq is None and dk is None:
            return None, None, None, None, None
        # A gradient that does not reach the loss is zero; rotating zeros keeps one launch path.
        dq = _writable_grad(dq) if dq is not None else torch.zeros(ctx.q_shape, dtype=ctx.dtype, device=cos.device)
        dk = _writable_grad(dk) if dk is not None else torch.zeros(ctx.k_shape, dtype=ctx.dtype, device=cos.device)
        rope_(dq, dk, cos, sin, ctx.unsqueeze_dim, backward=True)
        return dq, dk, None, None, None


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
         unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton rotary embedding of q and k, in place; see `triton_ops.reference.rope` for the math.

    Args:
        q: (B, Hq, S, D) queries (unsqueeze_dim=1) or (B, S, Hq, D) (unsqueeze_dim=2).
        k: keys in the same layout, Hk heads.
        cos, sin: (B or 1, S, D) tables.
        unsqueeze_dim: the head axis of q and k.

    Returns:
        (q, k), the same tensors, rotated.
    """
    return RopeFunction.apply(q, k, cos, sin, unsqueeze_dim)
