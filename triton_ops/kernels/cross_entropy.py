"""Fused linear cross-entropy: lm_head projection + softmax cross-entropy without (T, V) logits.

The tokens are processed in chunks of C rows. Per chunk:

    logits = h_c @ W.T                 (C, V)  cuBLAS, bf16 in, fp32 accumulate, bf16 out
    loss_c, dlogits = ce(logits, y_c)  (C,)    one Triton kernel, fp32 softmax, in place
    dh_c   = dlogits @ W               (C, H)  cuBLAS, written straight into dh
    dW    += dlogits.T @ h_c           (V, H)  cuBLAS addmm (beta = 1) into the gradient

so the working memory is one (C, V) buffer besides the two gradients, and every byte of the
logits is read twice and written once by the kernel. The gradients are complete when the
forward returns: the loss ends the graph, and backward only scales them by the incoming
gradient (skipped when it is 1).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["LinearCrossEntropyFunction", "cast_rne", "default_chunk_tokens", "linear_cross_entropy"]

_MAX_BLOCK = 16384


@triton.jit
def cast_rne(x, dtype: tl.constexpr, EMULATE: tl.constexpr):
    """x (fp32) rounded to `dtype` to nearest-even. Triton's interpreter truncates fp32 -> bf16
    (Triton 3.9); with EMULATE the rounding is done on the bits first, so that CPU runs round as
    the GPU does."""
    if EMULATE and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit
def _tanh(x):
    # tanh from exp: portable across Triton releases (libdevice's module path moved).
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _ce_fwd_bwd_kernel(
    logits_ptr,
    logits_stride,
    labels_ptr,
    loss_ptr,
    inv_denom_ptr,
    V,
    ignore_index,
    softcap,
    z_loss,
    HAS_SOFTCAP: tl.constexpr,
    HAS_Z_LOSS: tl.constexpr,
    WRITE_GRAD: tl.constexpr,
    ROW_SCALE: tl.constexpr,
    BLOCK: tl.constexpr,
    EMULATE_RNE: tl.constexpr,
):
    """Per-token loss and, in place of the logits, its gradient. One program per row.

    x (V,) logits of the row, z = c * tanh(x / c) when soft-capped else x, y its label:
        lse  = log(sum(exp(z)))                       (online over blocks, fp32)
        loss = lse - z[y] + z_loss * lse**2           (0 when y == ignore_index)
        g    = (softmax(z) * (1 + 2 * z_loss * lse) - onehot(y)) * (1 - tanh**2) * inv_denom
    `g` overwrites x (rows with an ignored label get zeros). inv_denom is read from memory so
    that the mean's token count never has to reach the host; with ROW_SCALE it holds one factor
    per row (a token's weight) instead of one for all.
    """
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * logits_stride
    offs = tl.arange(0, BLOCK)
    y = tl.load(labels_ptr + row).to(tl.int64)
    if y == ignore_index:
        tl.store(loss_ptr + row, 0.0)
        if WRITE_GRAD:
            zeros = tl.zeros([BLOCK], dtype=tl.float32)
            for start in range(0, V, BLOCK):
                cols = start + offs
                tl.store(row_ptr + cols, zeros.to(logits_ptr.dtype.element_ty), mask=cols < V)
    else:
        # Pass 1: running max m and running sum s of exp(z - m).
        m = float("-inf")
        s = 0.0
        for start in range(0, V, BLOCK):
            cols = start + offs
            mask = cols < V
            z = tl.load(row_ptr + cols, mask=mask, other=float("-inf")).to(tl.float32)
            if HAS_SOFTCAP:
                z = tl.where(mask, softcap * _tanh(z / softcap), float("-inf"))
            m_new = tl.maximum(m, tl.max(z, axis=0))
            s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), axis=0)
            m = m_new
        lse = m + tl.log(s)
        z_y = tl.load(row_ptr + y).to(tl.float32)
        if HAS_SOFTCAP:
            z_y = softcap * _tanh(z_y / softcap)
        loss = lse - z_y
        if HAS_Z_LOSS:
            loss += z_loss * lse * lse
        tl.store(loss_ptr + row, loss)
        if WRITE_GRAD:
            # Pass 2: the gradient, written over the logits it was computed from.
            if ROW_SCALE:
                scale = tl.load(inv_denom_ptr + row)
            else:
                scale = tl.load(inv_denom_ptr)
            p_scale = scale
            if HAS_Z_LOSS:
                p_scale = scale * (1.0 + 2.0 * z_loss * lse)
            for start in range(0, V, BLOCK):
                cols = start + offs
                mask = cols < V
                x = tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32)
                if HAS_SOFTCAP:
                    t = _tanh(x / softcap)
                    z = softcap * t
                else:
                    z = x
                g = tl.exp(z - lse) * p_scale
                g = tl.where(cols == y, g - scale, g)
                if HAS_SOFTCAP:
                    g = g * (1.0 - t * t)
                tl.store(row_ptr + cols, cast_rne(g, logits_ptr.dtype.element_ty, EMULATE_RNE), mask=mask)


def cross_entropy_rows_(
    logits: torch.Tensor,
    labels: torch.Tensor,
    loss_out: torch.Tensor,
    inv_denom: torch.Tensor,
    ignore_index: int = -100,
    softcap: float | None = None,
    z_loss: float = 0.0,
    write_grad: bool = True,
    row_scale: bool = False,
) -> None:
    """Launch the row kernel: loss per row into `loss_out`, gradient over `logits` in place.

    Args:
        logits: (C, V) logits, last dimension contiguous; overwritten by d loss / d logits.
        labels: (C,) int targets.
        loss_out: (C,) fp32 per-token losses (0 for ignored tokens).
        inv_denom: (1,) fp32 factor applied to the gradient (1 / the mean's denominator), or (C,)
            one factor per row with `row_scale`.
    """
    C, V = logits.shape
    if C == 0:
        return
    block = min(_MAX_BLOCK, triton.next_power_of_2(V))
    num_warps = 16 if block >= 8192 else (8 if block >= 2048 else 4)
    _ce_fwd_bwd_kernel[(C,)](
        logits, logits.stride(0), labels, loss_out, inv_denom, V, ignore_index,
        float(softcap) if softcap is not None else 1.0, float(z_loss),
        HAS_SOFTCAP=softcap is not None, HAS_Z_LOSS=bool(z_loss), WRITE_GRAD=write_grad,
        ROW_SCALE=row_scale,
        BLOCK=block, EMULATE_RNE=not logits.is_cuda, num_warps=num_warps,
    )


def default_chunk_tokens(n_tokens: int, hidden_size: int, vocab_size: int, dtype: torch.dtype,
                         device: torch.device | str | None = None) -> int:
    """Tokens per chunk: the (C, V) logits buffer gets as many bytes as the hidden states.

    The budget is max(T * H, V * H / 8) elements (the op's input, or an eighth of the weight
    gradient it must hold anyway, whichever is larger; 32 MiB at least), capped at a quarter of
    the device's free memory; C is rounded down to a multiple of 64 for the matmuls.
    """
    elt = torch.empty((), dtype=dtype).element_size()
    budget = max(max(n_tokens * hidden_size, vocab_size * hidden_size // 8) * elt, 32 << 20)
    device = torch.device(device) if device is not None else None
    if device is not None and device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = min(budget, free // 4)
    rows = budget // (vocab_size * elt)
    rows = max(64, rows // 64 * 64) if rows >= 64 else max(1, rows)
    return int(max(1, min(rows, n_tokens)))


def _inv_denominator(labels, ignore_index, reduction, num_items_in_batch, device) -> torch.Tensor:
    """(1,) fp32 tensor 1 / denominator, computed on the device (no host synchronization)."""
    if reduction == "sum":
        return torch.ones(1, dtype=torch.float32, device=device)
    if reduction != "mean":
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    if num_items_in_batch is None:
        denom = (labels != ignore_index).sum().to(torch.float32)
    elif torch.is_tensor(num_items_in_batch):
        denom = num_items_in_batch.to(device=device, dtype=torch.float32)
    else:
        denom = torch.tensor(float(num_items_in_batch), dtype=torch.float32, device=device)
    return (1.0 / denom).reshape(1)


def chunked_loss_and_grads(hidden, weight, labels, inv_denom, ignore_index, softcap, z_loss, chunk,
                           need_dh, need_dw, row_scale=False):
    """The chunk loop. Returns loss_rows (T,) fp32, dh (T, H) or None, dW (V, H) or None.
    `inv_denom` is (1,), or (T,) per-token factors with `row_scale`.

    Every matmul writes into preallocated memory (`out=`), dW is updated by `addmm_` with
    beta = 1 (the first chunk writes it), and the chunk's logits buffer is reused in place.
    """
    T, H = hidden.shape
    V = weight.shape[0]
    device = hidden.device
    loss_rows = torch.empty(T, dtype=torch.float32, device=device)           # (T,)
    logits_buf = torch.empty((chunk, V), dtype=weight.dtype, device=device)  # (C, V), reused
    dh = torch.empty_like(hidden) if need_dh else None                       # (T, H)
    dw = torch.empty_like(weight) if need_dw else None                       # (V, H)
    for i, start in enumerate(range(0, T, chunk)):
        end = min(start + chunk, T)
        h_c = hidden[start:end]                                              # (c, H)
        buf = logits_buf[: end - start]                                      # (c, V)
        torch.mm(h_c, weight.t(), out=buf)
        cross_entropy_rows_(buf, labels[start:end], loss_rows[start:end],
                            inv_denom[start:end] if row_scale else inv_denom,
                            ignore_index, softcap, z_loss, write_grad=need_dh or need_dw, row_scale=row_scale)
        if need_dh:
            torch.mm(buf, weight, out=dh[start:end])
        if need_dw:
            if i == 0:
                torch.mm(buf.t(), h_c, out=dw)
            else:
                dw.addmm_(buf.t(), h_c)
    return loss_rows, dh, dw


class LinearCrossEntropyFunction(torch.autograd.Function):
    """loss = CE(hidden @ weight.T, labels), gradients computed during the forward.

    hidden (T, H), weight (V, H) of the same floating dtype, labels (T,) int. Returns the scalar
    fp32 loss. dW is accumulated in the weight's dtype by cuBLAS (fp32 accumulation inside each
    chunk's matmul, one rounding per chunk).
    """

    @staticmethod
    def forward(ctx, hidden, weight, labels, ignore_index, reduction, num_items_in_batch, softcap, z_loss,
                chunk_tokens, token_weights=None):
        T, H = hidden.shape
        V = weight.shape[0]
        out_dtype = hidden.dtype
        hidden = hidden.to(weight.dtype).contiguous()                         # (T, H)
        weight = weight.contiguous()                                          # (V, H)
        labels = labels.reshape(-1).contiguous()                              # (T,)
        weighted = token_weights is not None
        if weighted:
            scale = token_weights.reshape(-1).to(device=hidden.device, dtype=torch.float32).contiguous()  # (T,)
        else:
            scale = _inv_denominator(labels, ignore_index, reduction, num_items_in_batch, hidden.device)  # (1,)
        chunk = int(chunk_tokens or default_chunk_tokens(T, H, V, weight.dtype, hidden.device))
        chunk = max(1, min(chunk, T))
        loss_rows, dh, dw = chunked_loss_and_grads(
            hidden, weight, labels, scale, ignore_index, softcap, z_loss, chunk,
            ctx.needs_input_grad[0], ctx.needs_input_grad[1], row_scale=weighted)
        loss = (loss_rows * scale).sum() if weighted else loss_rows.sum() * scale.squeeze(0)
        ctx.dh = dh.to(out_dtype) if dh is not None else None
        ctx.dw = dw
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        dh, dw = ctx.dh, ctx.dw
        ctx.dh = ctx.dw = None
        # Scaled in place on the device by the incoming (usually 1.0) gradient: reading it on the
        # host to skip the multiply would synchronize the host with the whole forward; the
        # multiply is one elementwise pass over dh and dW (not timed separately).
        g = grad_loss.reshape(())
        if dh is not None:
            dh.mul_(g.to(dh.dtype))
        if dw is not None:
            dw.mul_(g.to(dw.dtype))
        return dh, dw, None, None, None, None, None, None, None, None


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, ignore_index: int = -100,
                         reduction: str = "mean", num_items_in_batch=None, softcap: float | None = None,
                         z_loss: float = 0.0, chunk_tokens: int | None = None,
                         token_weights: torch.Tensor | None = None) -> torch.Tensor:
    """Triton/cuBLAS cross-entropy of `hidden @ weight.T`: the arguments and the math are
    `triton_ops.reference.linear_cross_entropy`'s; `chunk_tokens` defaults to
    `default_chunk_tokens`. A scalar fp32 loss."""
    return LinearCrossEntropyFunction.apply(
        hidden, weight, labels, ignore_index, reduction, num_items_in_batch, softcap, z_loss, chunk_tokens,
        token_weights,
    )
