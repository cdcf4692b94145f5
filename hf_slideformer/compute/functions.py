"""The autograd pieces of the sliding engine: the three Functions that carry the gradient
through the slid model (`EmbedFunction` -> `LayerFunction` x L -> `HeadFunction`, or
`TokenHeadFunction` where the caller makes the loss from per-token log-probabilities), the swap of
a unit's parameters for device tensors, and the recompute's output-free projection.

Each Function hands its work to the engine (`slide_engine.py`), whose schedule (`schedule.py`) orders the step.
"""
from __future__ import annotations

import contextlib

import torch

from ..host.store import Unit

__all__ = ["swapped", "leaves", "GradOnlyLinear", "grad_only", "RngReplay", "EmbedFunction", "LayerFunction",
           "HeadFunction", "TokenHeadFunction"]


@contextlib.contextmanager
def swapped(unit: Unit, tensors: list[torch.Tensor]):
    """Make the HF modules of `unit` compute with `tensors` instead of their host masters.

    Note: [Why a parametrized weight is swapped in as a Parameter] PEFT's `ParamWrapper` (LoRA on
    a parameter, as a mixture of experts' 3-D expert weights) registers a parametrization on the
    weight's module for each forward and removes it after; the removal registers the original
    back as a parameter only if it is an `nn.Parameter`, else as a buffer, which would leave the
    module with both. The registration also calls `set_` on the original, which bumps its version
    counter, and a view's counter is that of the whole slot: the layer's other weights, saved for
    backward by the ops before the experts (the router's linear), would then read as modified in
    place. So the Parameter is an alias of the device view with a version counter of its own. Such
    a weight is frozen (its layer is a `FrozenLayer`: no gradient is taken with respect to it, and
    the parametrization's output, not the weight, is what the experts' ops save), so the alias
    loses nothing.
    """
    for entry, tensor in zip(unit.entries, tensors):
        if entry.parametrized and not isinstance(tensor, torch.nn.Parameter):
            tensor = _own_parameter(tensor)
        for mod, attr in entry.holders:
            mod._parameters[attr] = tensor
    try:
        yield
    finally:
        for entry in unit.entries:
            for mod, attr in entry.holders:
                mod._parameters[attr] = entry.param


def _own_parameter(tensor: torch.Tensor) -> torch.nn.Parameter:
    """A frozen nn.Parameter on `tensor`'s memory whose version counter is not `tensor`'s."""
    alias = tensor.new_empty(0).set_(tensor.untyped_storage(), tensor.storage_offset(), tensor.shape, tensor.stride())
    return torch.nn.Parameter(alias, requires_grad=False)


class RngReplay:
    """The random state each layer's forward drew its dropout masks from, so that its recompute in
    backward draws the same masks (what `torch.utils.checkpoint` does with `preserve_rng_state`).

    Args:
        device: the compute device (its CUDA generator is saved beside the CPU one).
    """

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.states: dict[int, tuple] = {}

    def save(self, index: int) -> None:
        cuda = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
        self.states[index] = (torch.get_rng_state(), cuda)

    @contextlib.contextmanager
    def replay(self, index: int):
        """Layer `index`'s recompute under the state its forward started from (if one was saved); the
        global random state is left as it was."""
        state = self.states.pop(index, None)
        if state is None:
            yield
            return
        cpu, cuda = state
        with torch.random.fork_rng(devices=[self.device] if cuda is not None else []):
            torch.set_rng_state(cpu)
            if cuda is not None:
                torch.cuda.set_rng_state(cuda, self.device)
            yield


class GradOnlyLinear(torch.autograd.Function):
    """`nn.Linear` for a recompute that never reads the product: the forward returns zeros of the
    output's shape; the backward is the linear's own (the same two matrix products as aten's)."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return x.new_zeros(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, gy):
        x, weight = ctx.saved_tensors
        g2 = gy.reshape(-1, gy.shape[-1])
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            gx = g2.mm(weight).view(*gy.shape[:-1], weight.shape[1])
        if ctx.needs_input_grad[1]:
            gw = g2.t().mm(x.reshape(-1, x.shape[-1]))
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = g2.sum(0)
        return gx, gw, gb


@contextlib.contextmanager
def grad_only(proj: torch.nn.Linear | None):
    """While recomputing, `proj` skips its product (see `DecoderAdapter.output_projection`)."""
    if proj is None:
        yield
        return
    had = "forward" in proj.__dict__
    prev = proj.__dict__.get("forward")
    proj.forward = lambda x: GradOnlyLinear.apply(x, proj.weight, proj.bias)
    try:
        yield
    finally:
        if had:
            proj.forward = prev
        else:
            del proj.forward


def leaves(tensors):
    return [t.detach().requires_grad_() for t in tensors]


class EmbedFunction(torch.autograd.Function):
    """input_ids -> x_0 (B, S, H) gathered from the host table; backward scatters into it."""

    @staticmethod
    def forward(ctx, anchor, engine, input_ids):
        ctx.engine, ctx.gen = engine, engine.generation
        return engine.embedding.forward(input_ids, with_grad=True)

    @staticmethod
    def backward(ctx, gx):
        ctx.engine.check_generation(ctx.gen)
        ctx.engine.check_head_passed()
        ctx.engine.embedding.backward(gx)
        return None, None, None


class LayerFunction(torch.autograd.Function):
    """x_i -> x_{i+1} through decoder layer i; backward recomputes the layer from x_i."""

    @staticmethod
    def forward(ctx, x, engine, i, args, kwargs):
        ctx.engine, ctx.i, ctx.args, ctx.kwargs, ctx.gen = engine, i, args, kwargs, engine.generation
        return engine.layer_forward(i, x, args, kwargs, save=True)

    @staticmethod
    def backward(ctx, gy):
        ctx.engine.check_generation(ctx.gen)
        ctx.engine.check_head_passed()
        return ctx.engine.layer_backward(ctx.i, gy, ctx.args, ctx.kwargs), None, None, None, None


class HeadFunction(torch.autograd.Function):
    """hidden (B, S, H) -> loss; the head's gradients are computed here and sent to the host at once."""

    @staticmethod
    def forward(ctx, hidden, engine, labels, num_items_in_batch):
        ctx.engine, ctx.gen = engine, engine.generation
        loss, gh = engine.head.forward(hidden, labels, num_items_in_batch, with_grad=True)
        ctx.gh = gh
        return loss

    @staticmethod
    def backward(ctx, gloss):
        eng = ctx.engine
        eng.check_generation(ctx.gen)
        eng.begin_backward()
        eng.head.backward(gloss)
        gh, ctx.gh = ctx.gh, None
        return gh * gloss.to(gh.dtype), None, None, None


class TokenHeadFunction(torch.autograd.Function):
    """hidden (B, S, H) -> per-token statistics (`LossHead.token_statistics`), each (B, S), through the
    head; only the first, log p(label), carries a gradient.

    Note: [Why a per-token head computes its gradients in backward] a loss that the caller makes
    from per-token log-probabilities (an SFT mean, DPO's per-sequence sums, weighted tokens)
    weighs each token's gradient by g_t = d loss / d log p_t, known only when backward starts.
    The head's gradients are then those of sum_t w_t CE_t with w = -g (CE_t = -log p_t): the same
    fused linear cross-entropy, with per-token weights, run at the start of the backward, after
    which the backward goes on as `HeadFunction`'s. The cost is one more head forward per step
    (the statistics are computed without gradients in forward).
    """

    @staticmethod
    def forward(ctx, hidden, engine, shift_labels):
        ctx.engine, ctx.gen, ctx.labels = engine, engine.generation, shift_labels
        log_probs, *rest = engine.head.token_statistics(hidden, shift_labels)
        ctx.save_for_backward(hidden)
        ctx.mark_non_differentiable(*rest)
        return (log_probs, *rest)

    @staticmethod
    def backward(ctx, g_log_probs, *_):
        eng = ctx.engine
        eng.check_generation(ctx.gen)
        (hidden,) = ctx.saved_tensors
        weights = -g_log_probs.reshape(-1).float()                 # (B*S,) d loss / d CE_t
        _, gh = eng.head.forward(hidden.detach(), None, None, with_grad=True, shift_labels=ctx.labels,
                                 token_weights=weights)
        eng.begin_backward()
        eng.head.backward(weights.new_ones(()))
        return gh, None, None
