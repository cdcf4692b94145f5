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
weighted by the gradient the loss gives aux.

That gradient is aux's own: the forward returns aux as the output of `AuxLossFunction`, a node
of the graph that takes the decoder's output as an input (its gradient there is zero). Whatever
loss is built from it (HF's `loss + coef * aux`, TRL's `loss + coef * aux / steps`) sends it its
gradient, and the node runs before the last layer's backward (autograd runs a node only after
every node its output feeds): the recomputes read it there. A loss without aux sends nothing,
and no layer adds a term.

`logged()` is the mean aux of the training forwards since it was last read (the Trainer's log).
"""
from __future__ import annotations

import torch
import torch.nn as nn

__all__ = ["RouterAux", "AuxLossFunction"]


class AuxLossFunction(torch.autograd.Function):
    """(hidden, aux value) -> aux, a node whose backward hands aux's gradient to the `RouterAux`."""

    @staticmethod
    def forward(ctx, hidden, value, router_aux):
        ctx.router_aux = router_aux
        return value.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.router_aux.aux_grad = grad.detach()
        return None, None, None


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
        self.enabled = False
        self.captured: dict[int, torch.Tensor] = {}
        self.aux_grad = None                # d loss / d aux of the current backward (AuxLossFunction)
        self._logged = (0.0, 0)
        self._mask = None
        self._sums = None
        for index, layer in enumerate(layers):
            for module in layer.modules():
                if type(module).__name__ == router_class:
                    module.register_forward_hook(lambda mod, args, out, _i=index: self._seen(_i, out[0]))

    def begin(self, attention_mask: torch.Tensor | None, enabled: bool) -> None:
        """A forward starts: reset the sums; with `enabled` False (the forward's or the config's
        `output_router_logits`), the routers' outputs are not read and there is no aux."""
        self.enabled = enabled
        self._mask = None if attention_mask is None else attention_mask.reshape(-1).float()
        self._sums = None
        self.aux_grad = None
        self.captured = {}

    def _seen(self, index: int, logits: torch.Tensor) -> None:
        if not self.enabled:
            return
        if torch.is_grad_enabled():         # the recompute: its term joins the layer's backward
            self.captured[index] = logits
            return
        with torch.no_grad():
            p = torch.softmax(logits.float(), dim=-1)                                    # (T, E)
            top = torch.topk(p, self.top_k, dim=-1).indices                              # (T, k)
            mask = torch.ones(p.shape[0], device=p.device) if self._mask is None else self._mask.to(p.device)
            tokens = torch.zeros(self.experts, device=p.device).scatter_add_(
                0, top.reshape(-1), mask.repeat_interleave(self.top_k))
            probs = (p * mask[:, None]).sum(0)
            prev_tokens, prev_probs, prev_n = self._sums if self._sums is not None else (0.0, 0.0, 0.0)
            self._sums = (prev_tokens + tokens, prev_probs + probs, prev_n + mask.sum())

    def value(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """aux of the forward that just ran, as a node of the graph of the decoder's output `hidden`
        when it has one (None when no router ran)."""
        if self._sums is None:
            return None
        tokens, probs, n = self._sums
        aux = self.experts * torch.sum((tokens / n) * (probs / n))
        if not (torch.is_grad_enabled() and hidden.requires_grad):
            return aux
        total, count = self._logged
        self._logged = (total + aux.item(), count + 1)
        return AuxLossFunction.apply(hidden, aux, self)

    def logged(self) -> float | None:
        """The mean aux of the training forwards since the last call (None when none ran)."""
        total, count = self._logged
        self._logged = (0.0, 0)
        return total / count if count else None

    def surrogate(self, index: int) -> torch.Tensor | None:
        """A scalar of layer `index`'s recomputed router logits whose gradient is aux's, times the
        gradient the loss gives aux (None when that layer has no term)."""
        logits = self.captured.pop(index, None)
        if logits is None or self.aux_grad is None:
            return None
        tokens, _, n = self._sums
        p = torch.softmax(logits.float(), dim=-1)
        mask = torch.ones(p.shape[0], device=p.device) if self._mask is None else self._mask.to(p.device)
        weight = self.aux_grad.float() * self.experts * (tokens / n) / n                         # (E,)
        return ((p * mask[:, None]).sum(0) * weight).sum()
