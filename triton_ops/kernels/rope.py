"""Rotary position embedding of queries and keys, in place, one program per (batch, position).

With x = (x1, x2) the two halves of a head (D/2 each) and the tables split the same way,
cos = (c1, c2), sin = (s1, s2), HF's `x * cos + rotate_half(x) * sin` is
    y1 = x1 * c1 - x2 * s1
    y2 = x2 * c2 + x1 * s2
and its transpose, the backward, is the same map with (s1, s2) replaced by (-s2, -s1):
    dx1 = dy1 * c1 + dy2 * s2
    dx2 = dy2 * c2 - dy1 * s1
A program loads its position's tables and rotates a tile of heads, (heads, D/2); one launch
covers the query heads and the key heads (GQA: Hk <= Hq). Strides are taken as they come, so the usual
`proj(x).view(B, S, H, D).transpose(1, 2)` layout is rotated where it lies, without a copy.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["RopeFunction", "rope"]


@triton.jit
def _rotate_tile(x_ptr, b, s, sx_b, sx_h, sx_s, heads, n_heads, d, c1, c2, s1, s2, HALF: tl.constexpr):
    mask = (heads < n_heads) & (d < HALF)
    ptr = x_ptr + b * sx_b + s * sx_s + heads * sx_h + d
    x1 = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptr + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(ptr, (x1 * c1 - x2 * s1).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(ptr + HALF, (x2 * c2 + x1 * s2).to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr, cos_ptr, sin_ptr,
    S, n_q_heads, n_k_heads, q_blocks,
    sq_b, sq_h, sq_s, sk_b, sk_h, sk_s, sc_b, sc_s,
    HALF: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BACKWARD: tl.constexpr,
):
    """Rotate a (BLOCK_HEADS, D) tile of q[b, :, s, :] or k[b, :, s, :] in place.

    Grid (B * S, q_blocks + k_blocks): the second axis walks the query head tiles, then the
    key head tiles. cos/sin are (B or 1, S, D) with batch stride sc_b (0 when shared).
    BACKWARD applies the transposed rotation (sin halves swapped and negated).
    """
    pid = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    b = pid // S
    s = pid % S
    d = tl.arange(0, BLOCK_D)[None, :]                                        # (1, Db)
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
    if tile < q_blocks:
        heads = tile * BLOCK_HEADS + tl.arange(0, BLOCK_HEADS)[:, None]      # (Hb, 1)
        _rotate_tile(q_ptr, b, s, sq_b, sq_h, sq_s, heads, n_q_heads, d, c1, c2, s1, s2, HALF)
    else:
        heads = (tile - q_blocks) * BLOCK_HEADS + tl.arange(0, BLOCK_HEADS)[:, None]
        _rotate_tile(k_ptr, b, s, sk_b, sk_h, sk_s, heads, n_k_heads, d, c1, c2, s1, s2, HALF)


def _axes(x: torch.Tensor, head_dim_axis: int) -> tuple[int, int, int, int]:
    """(heads, stride_b, stride_h, stride_s) of a (B, H, S, D) or (B, S, H, D) tensor."""
    seq_axis = 3 - head_dim_axis
    return x.shape[head_dim_axis], x.stride(0), x.stride(head_dim_axis), x.stride(seq_axis)


def rope_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1,
          backward: bool = False) -> None:
    """Launch the rotation of q and k in place (or its transpose, with `backward`), one launch.

    Args:
        q: (B, Hq, S, D) with unsqueeze_dim=1, (B, S, Hq, D) with unsqueeze_dim=2; unit stride on D.
        k: the same layout with Hk heads.
        cos, sin: (B or 1, S, D) (or (S, D)).
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
    block_heads = min(triton.next_power_of_2(max(hq, hk)), max(1, 4096 // block_d))
    q_blocks = triton.cdiv(hq, block_heads)
    grid = (B * S, q_blocks + triton.cdiv(hk, block_heads))
    _rope_kernel[grid](
        q, k, cos, sin, S, hq, hk, q_blocks, sq_b, sq_h, sq_s, sk_b, sk_h, sk_s, sc_b, cos.stride(1),
        HALF=half, BLOCK_HEADS=block_heads, BLOCK_D=block_d, BACKWARD=backward,
        num_warps=8 if block_heads * block_d >= 4096 else 4,
    )


def _writable_grad(g: torch.Tensor) -> torch.Tensor:
    """The incoming gradient if it can be rotated in place (unit stride on D, no expanded
    dimension), else a dense copy."""
    expanded = any(st == 0 and n > 1 for st, n in zip(g.stride(), g.shape))
    return g.contiguous() if expanded or g.stride(-1) != 1 else g


class RopeFunction(torch.autograd.Function):
    """(q, k) -> (rotate(q), rotate(k)) in place; q (B, Hq, S, D), k (B, Hk, S, D).

    Note: [Why rope bumps the version instead of marking dirty] q and k are usually views of
    the projections' outputs, and autograd refuses `mark_dirty` on views for a Function with
    two outputs (and would clone the whole base gradient in backward for one). So the Function
    returns views of its rotated inputs and bumps their version counter: a tensor saved for
    backward before the rotation then fails loudly instead of silently reading rotated values.
    The backward rotates the incoming gradients in place (fresh buffers from the attention's
    backward) by the transposed rotation.
    """

    @staticmethod
    def forward(ctx, q, k, cos, sin, unsqueeze_dim):
        rope_(q, k, cos, sin, unsqueeze_dim)
        torch.autograd.graph.increment_version((q, k))
        ctx.save_for_backward(cos, sin)
        ctx.unsqueeze_dim = unsqueeze_dim
        ctx.q_shape, ctx.k_shape, ctx.dtype = q.shape, k.shape, q.dtype
        return q.view_as(q), k.view_as(k)

    @staticmethod
    def backward(ctx, dq, dk):
        cos, sin = ctx.saved_tensors
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
