"""The slid model's answer to `fused_lm_head=True`: per-token statistics of the next-token
distribution from the engine's own loss head, instead of logits (the fields of TRL's fused LM head).

`fused_head` runs the head once without gradients in forward (`LossHead.token_statistics`); where
the hidden states need a gradient, `functions.TokenHeadFunction` computes the head's gradients at
the start of the backward, weighing each token's cross-entropy by the gradient its log-probability
receives (note [Why a per-token head computes its gradients in backward]).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from transformers.utils import ModelOutput

from .functions import TokenHeadFunction

__all__ = ["FusedLMHeadOutput", "fused_head"]


@dataclasses.dataclass
class FusedLMHeadOutput(ModelOutput):
    """What `model(..., labels=labels, fused_lm_head=True)` returns: per-token statistics of the
    next-token distribution instead of logits (the fields of TRL's fused LM head output).

    Attributes:
        loss: minus the summed `log_probs` over `num_items_in_batch` (the valid tokens' count
            when not given): the causal-LM loss.
        log_probs: (B, S - 1) log-probability of each next-token label (zero where it is -100);
            (B, S) with `shift_labels`. Differentiable: any loss made from it trains the model.
        entropy: entropy of each next-token distribution (no gradient, as the fields below).
        is_top1: whether each label is the most likely token.
        mean_logits: the mean of each position's logits over the vocabulary.
        log_sum_sq_probs: log(sum_v p_v**2) of each next-token distribution.
        label_mask: whether each label is not -100.
        aux_loss: a mixture of experts' load-balancing loss when the forward or the config asks
            (`output_router_logits`), differentiable: the caller adds it to its loss, as TRL adds
            `router_aux_loss_coef * aux_loss` (router_aux.py); else None.
    """

    loss: torch.Tensor | None = None
    log_probs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    log_sum_sq_probs: torch.Tensor | None = None
    mean_logits: torch.Tensor | None = None
    is_top1: torch.Tensor | None = None
    label_mask: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None


def fused_head(engine, hidden: torch.Tensor, labels: torch.Tensor | None, shift_labels: torch.Tensor | None,
               num_items_in_batch=None) -> FusedLMHeadOutput:
    """The per-token statistics of the final hidden states `hidden` (B, S, H) against the next-token labels.

    Args:
        engine: the slid model's `SlideEngine` (its head scores `hidden`).
        hidden: the decoder's output, before the final norm (the head applies it).
        labels: (B, S) token ids, shifted here (the last position has no next token); or None with
            `shift_labels` (B, S), already aligned with the positions.
        num_items_in_batch: the loss's divisor; the count of labels that are not -100 when None.
    """
    sl = shift_labels if shift_labels is not None else F.pad(labels, (0, 1), value=-100)[..., 1:]
    sl = sl.to(engine.device, torch.long)                          # (B, S)
    if torch.is_grad_enabled() and hidden.requires_grad:
        stats = TokenHeadFunction.apply(hidden, engine, sl)
    else:
        stats = engine.head.token_statistics(hidden, sl)
    if shift_labels is None:                                       # the last position has no next token
        stats, sl = [x[:, :-1] for x in stats], sl[:, :-1]
    log_probs, entropy, is_top1, mean_logits, log_sum_sq_probs = stats
    mask = sl != -100
    count = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
    loss = -log_probs.sum() / (count.to(log_probs.device) if torch.is_tensor(count) else count)
    return FusedLMHeadOutput(loss=loss, log_probs=log_probs, entropy=entropy, is_top1=is_top1, label_mask=mask,
                             mean_logits=mean_logits, log_sum_sq_probs=log_sum_sq_probs)
