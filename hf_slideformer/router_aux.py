"""The router's auxiliary load-balancing loss of a mixture of experts, carried through the slide.

HF's causal LM adds `router_aux_loss_coef * aux` to its loss when `config.output_router_logits`
is set, with (Switch Transformer, HF's `load_balancing_loss_func`)

    aux = E * sum_e T_e * P_e,   T_e = (1/N) sum_{l,t} m_t [e in topk(p_l[t])],
                                 P_e = (1/N) sum_{l,t} m_t p_l[t, e],   p_l = softmax(router logits of layer l)

over the MoE layers l and tokens t, m the attention mask, N = sum_{l,t} m_t. The layers run
without a graph in the forward, so the loss cannot be a function of their logits there: the
forward sums T and P from each router's output (hooks on the routers) and adds the value; `T`
has no gradient, so d aux / d p_l[t, e] = E * T_e * m_t / N, and each layer's recompute in
backward adds that term (`surrogate`, whose gradient is exactly this) to its own backward,
weighted by the loss gradient.
"""
from __future__ import annotations

import torch
import torch.nn as nn

__all__ = ["RouterAux"]


class RouterAux:
    """The aux loss's sums for the current forward and its term in each layer's recompute.

    Args:
        model: the MoE causal LM (its config names the experts and the coefficient).
        layers: its decoder layers.
        router_class: the class name of the family's router module (returns the logits first).
    """

    def __init__(self, model: nn.Module, layers, router_class: str):
        cfg = model.config
        self.coef = float(cfg.router_aux_loss_coef)
        self.experts = int(getattr(cfg, "num_experts", None) or cfg.num_local_experts)
        self.top_k = int(cfg.num_experts_per_tok)
        self.live = False                   # the current graph's loss holds the aux term
        self.captured: dict[int, torch.Tensor] = {}
        self.loss_grad = None
        self._mask = None
        self._sums = None
        for i, layer in enumerate(layers):
            for m in layer.modules():
                if type(m).__name__ == router_class:
                    m.register_forward_hook(lambda mod, args, out, _i=i: self._seen(_i, out[0]))

    def begin(self, attention_mask: torch.Tensor | None) -> None:
        """A forward starts: reset the sums."""
        self._mask = None if attention_mask is None else attention_mask.reshape(-1).float()
        self._sums = None
        self.live = False
        self.captured = {}

    def _seen(self, i: int, logits: torch.Tensor) -> None:
        if torch.is_grad_enabled():         # the recompute: its term joins the layer's backward
            self.captured[i] = logits
            return
        with torch.no_grad():
            p = torch.softmax(logits.float(), dim=-1)                                    # (T, E)
            top = torch.topk(p, self.top_k, dim=-1).indices                              # (T, k)
            m = torch.ones(p.shape[0], device=p.device) if self._mask is None else self._mask.to(p.device)
            tokens = torch.zeros(self.experts, device=p.device).scatter_add_(
                0, top.reshape(-1), m.repeat_interleave(self.top_k))
            probs = (p * m[:, None]).sum(0)
            t, pr, n = self._sums if self._sums is not None else (0.0, 0.0, 0.0)
            self._sums = (t + tokens, pr + probs, n + m.sum())

    def value(self) -> torch.Tensor | None:
        """aux of the forward that just ran (None when no router ran)."""
        if self._sums is None:
            return None
        tokens, probs, n = self._sums
        return self.experts * torch.sum((tokens / n) * (probs / n))

    def surrogate(self, i: int) -> torch.Tensor | None:
        """A scalar of layer i's recomputed router logits whose gradient is aux's, times the
        coefficient and the loss gradient (None when layer i has no term)."""
        logits = self.captured.pop(i, None)
        if not self.live or logits is None or self.loss_grad is None:
            return None
        tokens, _, n = self._sums
        p = torch.softmax(logits.float(), dim=-1)
        m = torch.ones(p.shape[0], device=p.device) if self._mask is None else self._mask.to(p.device)
        weight = self.coef * self.loss_grad.float() * self.experts * (tokens / n) / n            # (E,)
        return ((p * m[:, None]).sum(0) * weight).sum()
