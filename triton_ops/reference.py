"""Pure-torch reference implementations of the fused ops.

They are the test oracle for the Triton kernels, the benchmark baseline, and the fallback where
Triton or a GPU is absent. Each function computes the same mathematics as its kernel.
"""
from __future__ import annotations

import torch

__all__ = ["linear_cross_entropy", "LinearCrossEntropyFunction", "loss_denominator"]


def loss_denominator(labels: torch.Tensor, ignore_index: int, reduction: str, num_items_in_batch) -> float | torch.Tensor:
    """What the summed token losses are divided by, as Hugging Face's causal-LM loss does it."""
    if reduction == "sum":
        return 1.0
    if reduction != "mean":
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):
            return num_items_in_batch.to(device=labels.device, dtype=torch.float32)
        return float(num_items_in_batch)
    # HF's mean over the non-ignored tokens (NaN when there are none, as F.cross_entropy gives).
    return (labels != ignore_index).sum().to(torch.float32)


class LinearCrossEntropyFunction(torch.autograd.Function):
    """loss = CE(hidden @ weight.T, labels), chunked over tokens; gradients computed in forward.

    hidden (T, H), weight (V, H), labels (T,) int64. The (T, V) logits are never held whole:
    each chunk of `chunk_tokens` rows is projected, soft-maxed in fp32 and turned into its
    gradient contribution at once. The loss ends the graph, so backward only scales.
    """

    @staticmethod
    def forward(ctx, hidden, weight, labels, ignore_index, reduction, num_items_in_batch, softcap, z_loss, chunk_tokens):
        T, H = hidden.shape
        denom = loss_denominator(labels, ignore_index, reduction, num_items_in_batch)
        need_dh = ctx.needs_input_grad[0]
        need_dw = ctx.needs_input_grad[1]
        dh = torch.zeros_like(hidden) if need_dh else None
        dw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_dw else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        chunk = int(chunk_tokens or T or 1)
        for s in range(0, T, chunk):
            h = hidden[s:s + chunk]                                   # (C, H)
            y = labels[s:s + chunk]                                   # (C,)
            logits = (h @ weight.t()).float()                         # (C, V) fp32
            if softcap is not None:
                t = torch.tanh(logits / softcap)
                logits = softcap * t
            lse = torch.logsumexp(logits, dim=-1)                     # (C,)
            valid = y != ignore_index
            safe_y = torch.where(valid, y, torch.zeros_like(y))
            target = logits.gather(1, safe_y[:, None]).squeeze(1)
            tok_loss = lse - target
            if z_loss:
                tok_loss = tok_loss + z_loss * lse * lse
            total += torch.where(valid, tok_loss, torch.zeros_like(tok_loss)).sum()
            if not (need_dh or need_dw):
                continue
            g = torch.softmax(logits, dim=-1)                          # (C, V) d lse / d logits
            if z_loss:
                g = g * (1.0 + 2.0 * z_loss * lse)[:, None]
            g.scatter_add_(1, safe_y[:, None], -torch.ones_like(lse)[:, None])
            g = g * valid[:, None].to(g.dtype)
            if softcap is not None:
                g = g * (1.0 - t * t)
            g = g / denom
            if need_dh:
                dh[s:s + chunk] = (g.to(weight.dtype) @ weight).to(hidden.dtype)
            if need_dw:
                dw += g.t() @ h.float()
        loss = total / denom
        ctx.save_for_backward(dh if dh is not None else torch.empty(0), dw.to(weight.dtype) if dw is not None else torch.empty(0))
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        dh, dw = ctx.saved_tensors
        gh = dh * grad_loss.to(dh.dtype) if ctx.needs_input_grad[0] else None
        gw = dw * grad_loss.to(dw.dtype) if ctx.needs_input_grad[1] else None
        return gh, gw, None, None, None, None, None, None, None


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    num_items_in_batch=None,
    softcap: float | None = None,
    z_loss: float = 0.0,
    chunk_tokens: int | None = None,
) -> torch.Tensor:
    """Cross-entropy of `hidden @ weight.T` against `labels` without materializing the logits.

    Args:
        hidden: (T, H) final hidden states.
        weight: (V, H) lm_head weight.
        labels: (T,) target ids; `ignore_index` entries contribute nothing.
        reduction: "mean" (over non-ignored tokens, or over `num_items_in_batch` when given) or "sum".
        num_items_in_batch: HF's token count across gradient-accumulation micro-batches.
        softcap: optional logit soft-capping, logits = softcap * tanh(logits / softcap).
        z_loss: coefficient of the auxiliary lse**2 term.
        chunk_tokens: tokens per chunk (default: 4096 rows at a time).

    Returns:
        Scalar fp32 loss; its backward yields the gradients already computed in forward.
    """
    if chunk_tokens is None:
        chunk_tokens = 4096
    return LinearCrossEntropyFunction.apply(
        hidden, weight, labels, ignore_index, reduction, num_items_in_batch, softcap, z_loss, chunk_tokens
    )
