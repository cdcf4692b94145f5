"""Where the token embedding's table lives and how it is updated: in the host store, updated by
the CPU worker (`HostTable`), or resident on the GPU, updated there (`ResidentTable`). The
embedding (embedding.py) holds one (`Embedding.table`); the resident plan (resident.py) swaps it
when it moves the embedding (`Embedding.make_resident`, `Embedding.return_to_host`). The
embedding, a tied lm_head (lm_weight.py), the head (head.py), the schedule and the resident plan
ask it and never which case it is in.

What the two differ in, each a method:

| | `HostTable` | `ResidentTable` |
|---|---|---|
| a training forward | makes the dense host gradient (a trainable embedding) | nothing |
| the gather | the batch's rows on the host, copied in (`Embedding.gather_on_host`) | on the device from its master, a recipe for layer 0's input |
| the backward's row sums | to the host; the worker folds and updates them (`Embedding.send_sums`) | into the device gradient; fused AdamW there when the backward updates |
| the whole-table update at the worker's front | when trainable (head.py, schedule.py) | none |
| `optimizer.step()` | the worker's deferred update (`Embedding.step`) | `ResidentPlan.step`, on the device |
| the resident plan | may move it to the device | may write it back to the host |
| a tied lm_head | travels in the head slot; its gradient crosses to the host | the device compute copy; its gradient starts the device gradient |
"""
from __future__ import annotations

import torch

from ..errors import SlideStateError
from .placements import DeferredStep
from .resident_state import ResidentState

__all__ = ["HostTable", "ResidentTable"]


class HostTable:
    """The embedding's master, moments and dense gradient in the host store.

    Args:
        embedding: the `Embedding` it belongs to.
    """

    state = None                         # no device state (`Embedding.resident`)

    def __init__(self, embedding):
        self.embedding = embedding

    # ------------------------------------------------------------- forward and backward
    def prepare_gradient(self) -> None:
        """A training forward: the dense host gradient of a trainable embedding, made on first use."""
        emb = self.embedding
        emb.training.prepare_gradient(emb)

    def gather(self, ids: torch.Tensor, shape: torch.Size, with_grad: bool) -> torch.Tensor:
        """The embedded batch (`shape` + (H,)) in the compute dtype from the token ids `ids` (host)."""
        return self.embedding.gather_on_host(ids, shape)

    def take_sums(self, sums: torch.Tensor, span) -> None:
        """The backward's per-row gradient sums (distinct rows, H, on the device): to the host and
        the worker, then the backward ends."""
        self.embedding.send_sums(sums, span)

    def updates_on_worker(self) -> bool:
        """Does the worker update the whole table (every row but the batch's) at its front, in the
        head's task (head.py; the late layers cover it, schedule.py)?"""
        return self.embedding.training.updates_on_worker()

    def step_on_device(self, deferred: DeferredStep) -> set[int]:
        """`optimizer.step()`: the ids of the units this updated on the device (none: the worker's)."""
        return set()

    # ------------------------------------------------------------- the resident plan (resident.py)
    def device_states(self) -> list[ResidentState]:
        """The device states it holds."""
        return []

    def to_device(self, wanted=None) -> None:
        """Make a trainable embedding resident, when `wanted()` (if given) agrees."""
        emb = self.embedding
        emb.training.to_device(emb, wanted)

    def to_host(self) -> None:
        """The plan keeps the embedding on the host: it is there."""

    def prepare_eviction(self) -> None:
        """Before the resident units are written back: nothing of the embedding's to keep."""

    def keep_backward_gradient(self) -> None:
        """The resident units are written back mid-step: the embedding's gradient is on the host already."""

    # ------------------------------------------------------------- a tied lm_head (lm_weight.py)
    def tied_slot_units(self, head_unit) -> tuple:
        """What the head slot carries for a tied lm_head: the head unit and the embedding unit."""
        return head_unit, self.embedding.unit

    def tied_weight(self, slot) -> torch.Tensor:
        """A tied lm_head's weight: the embedding unit's view in the head slot."""
        return slot.views(self.embedding.unit)[0]

    def tied_host_numel(self) -> int:
        """Elements a tied lm_head's gradient takes in the head's host buffer: with accumulation
        it joins the head's there (else it goes straight into the embedding's; the engine's step
        shape says, step_shape.py)."""
        emb = self.embedding
        return emb.engine.step_shape.tied_host_numel(emb)

    def tied_destinations(self, pgrads: list, rest: torch.Tensor) -> list:
        """Where a tied lm_head's gradient crosses to: with one backward per step straight into the
        embedding's pinned gradient buffer (which the previous step's update has released), else
        the head's host buffer after the head unit's (`rest`)."""
        emb = self.embedding
        return emb.engine.step_shape.tied_destinations(emb, rest)

    def scale_tied_on_device(self, loss_grad: torch.Tensor) -> None:
        """backward: the loss gradient scales a tied lm_head's gradient kept on the device (none here)."""

    def scale_tied_on_host(self, rest: torch.Tensor, scale: float) -> None:
        """The worker's head task: a tied lm_head's gradient times the loss gradient `scale`, in
        the embedding's dense host gradient (folded in from `rest` with accumulation)."""
        emb = self.embedding
        emb.engine.step_shape.scale_tied_on_host(emb, rest, scale)


class ResidentTable:
    """The embedding resident on the GPU: its fp32 master, Adam moments and compute-dtype weights
    there (`state`), its gradient the embedding's device gradient (`Embedding.rgrad`), updated by
    torch's fused CUDA AdamW (resident.py).

    Args:
        embedding: the `Embedding` it belongs to.
        state: its device state.
    """

    def __init__(self, embedding, state: ResidentState):
        self.embedding, self.state = embedding, state

    # ------------------------------------------------------------- forward and backward
    def prepare_gradient(self) -> None:
        """A training forward: the device gradient is there already."""

    def gather(self, ids: torch.Tensor, shape: torch.Size, with_grad: bool) -> torch.Tensor:
        """Gathered on the device from the resident master; with gradients the gather is kept as
        the recipe of layer 0's input (activation_tiers.py: [Why the first layer's input can be
        gathered again])."""
        emb = self.embedding
        engine = emb.engine
        ids_dev = ids.to(engine.device, non_blocking=True)

        def gather():
            if emb.table is not self:
                raise SlideStateError("internal: the resident embedding left the device before the first "
                                      "layer's input was saved")
            rows_out = self.state.master.view(emb.vocab, emb.hidden).index_select(0, ids_dev)
            return rows_out.to(engine.dtype).view(*shape, emb.hidden)
        out = gather()
        if with_grad:
            emb.keep_gather(out, gather)
        return out

    def take_sums(self, sums: torch.Tensor, span) -> None:
        """The batch rows' sums join the device gradient (after a tied lm_head's); updated now
        when the backward updates, else `optimizer.step()` clips and updates it."""
        emb = self.embedding
        engine = emb.engine
        grad = emb.rgrad.view(emb.vocab, emb.hidden)
        engine.head.lm_weight.start_resident_grad(grad)     # tied: it holds the lm_head's gradient already
        grad.index_add_(0, emb.rows_dev[0], sums)           # distinct rows: one add per element, deterministic
        engine.backward_plan.updating.now(lambda: engine.residents.resident_step(
            emb.unit, self.state, emb.rgrad, found_inf=engine.norm.found_inf()))
        engine.clock.span_end(span)
        engine.end_backward()

    def updates_on_worker(self) -> bool:
        return False

    def step_on_device(self, deferred: DeferredStep) -> set[int]:
        """`optimizer.step()`: clipped and updated on the device; the embedding unit's id."""
        emb = self.embedding
        coef, found_inf = deferred.resident_clip()
        emb.engine.residents.resident_step(emb.unit, self.state, emb.rgrad, deferred.hp, clip_coef=coef,
                                           found_inf=found_inf)
        self.state.grad_valid = False
        return {id(emb.unit)}

    # ------------------------------------------------------------- the resident plan (resident.py)
    def device_states(self) -> list[ResidentState]:
        return [self.state]

    def to_device(self, wanted=None) -> None:
        """Resident already."""

    def to_host(self) -> None:
        """Resident from the first step, not in the measured plan: the resident units go back."""
        self.embedding.engine.residents.evict()

    def prepare_eviction(self) -> None:
        """A layer input gathered from the resident master becomes a tensor of its own."""
        self.embedding.engine.tier.materialize()

    def keep_backward_gradient(self) -> None:
        """Evicted mid-step: a forward's backward is still to come and takes the host path, with the
        host gradient holding what the head put in the device one (a tied lm_head's gradient)."""
        emb = self.embedding
        if emb.engine.live_generation is not None:
            emb.ensure_grad()
            emb.engine.head.lm_weight.resident_grad_to_host()

    # ------------------------------------------------------------- a tied lm_head (lm_weight.py)
    def tied_slot_units(self, head_unit) -> tuple:
        """The head unit alone: the tied weight is the resident compute copy."""
        return (head_unit,)

    def tied_weight(self, slot) -> torch.Tensor:
        emb = self.embedding
        return self.state.weights.view(emb.vocab, emb.hidden)

    def tied_host_numel(self) -> int:
        return 0

    def tied_destinations(self, pgrads: list, rest: torch.Tensor) -> list:
        """None: the device gradient starts as the lm_head's, on the device (scaled by the loss
        gradient in backward, the batch rows added in the embedding's backward)."""
        emb = self.embedding
        emb.rgrad.view(emb.vocab, emb.hidden).copy_(pgrads.pop())
        return []

    def scale_tied_on_device(self, loss_grad: torch.Tensor) -> None:
        self.embedding.rgrad.mul_(loss_grad)

    def scale_tied_on_host(self, rest: torch.Tensor, scale: float) -> None:
        """Nothing crossed to the host."""
