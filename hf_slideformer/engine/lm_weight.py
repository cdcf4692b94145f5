"""Where the loss head's lm_head weight lives: in the head unit (`OwnWeight`), or in the input
embedding's table (`TiedWeight`, a tied lm_head). Chosen once, when the head is made
(`lm_weight_of`); the head (head.py) asks it and never which case it is in.

What the two differ in, each a method:

| | `OwnWeight` | `TiedWeight` |
|---|---|---|
| head slot | the head unit | and the embedding unit, unless the embedding is resident (its device copy is the weight): the embedding's table says (embedding_table.py) |
| trains | with the head unit | with the head unit or the embedding |
| its gradient | an entry of the head's | joins the embedding's: on the device (resident), straight into its pinned gradient (one backward per step), or after the head's in the head's host buffer, folded into the embedding's by the worker |
| updated last | may be ([Why an untied head is updated when the backward ends]) | never: it is the embedding's table |
| the embedding's gradient (embedding.py) | the batch rows' alone: cleared after each update | starts as the lm_head's every step: overwritten, never cleared; its host copy pinned, its norm the sum's |
"""
from __future__ import annotations

import torch

from ..host.optim import sq_norm as _sq_norm
from ..host.store import Unit

__all__ = ["OwnWeight", "TiedWeight", "lm_weight_of"]


def lm_weight_of(engine, unit: Unit, lm_module) -> "OwnWeight | TiedWeight":
    """The lm_head weight's place for the head unit `unit` of `engine`'s model."""
    return TiedWeight(engine, unit) if engine.tied else OwnWeight(unit, lm_module)


class OwnWeight:
    """An untied lm_head: its weight is an entry of the head unit, updated with it.

    Args:
        unit: the head unit.
        lm_module: the lm_head `nn.Linear` (its weight is found among the unit's entries).
    """

    def __init__(self, unit: Unit, lm_module):
        self.unit = unit
        self.units = (unit,)                    # what the head slot carries
        self.lm_index = next((entry_no for entry_no, entry in enumerate(unit.entries)
                              if any(attr == "weight" and mod is lm_module for mod, attr in entry.holders)), None)
        if self.lm_index is None:
            raise RuntimeError("lm_head weight not found in the head unit")

    def trainable(self) -> bool:
        """Does the head take gradients?"""
        return self.unit.trainable

    def may_update_last(self) -> bool:
        """May the head's update wait for the end of the backward (head.py, `LossHead.updates_last`)?"""
        return True

    def slot_units(self) -> tuple:
        """What the head slot carries now."""
        return self.units

    def weights(self, slots):
        """(slot, the head unit's views, the lm_head weight) from the head's slot queue."""
        slot = slots.acquire(self.units)
        views = slot.views(self.unit)
        return slot, views, views[self.lm_index]

    def leaf(self, leaves: list, weight: torch.Tensor) -> tuple[torch.Tensor, list]:
        """(the lm_head weight to differentiate against, the leaves to add to the head's own)."""
        return leaves[self.lm_index], []

    def take_norm(self, pgrads: list) -> None:
        """One backward per step: the tied gradient's norm terms (none here)."""

    def host_numel(self) -> int:
        """Elements the head's host gradient buffer holds after the head unit's."""
        return 0

    def destinations(self, pgrads: list, rest: torch.Tensor) -> list:
        """Where the lm_head's own gradient (`pgrads`' tail) crosses to (none here: it is an entry)."""
        return []

    def hand_to_shards(self, pgrads: list, scale: torch.Tensor) -> None:
        """Data parallel (sharded.py): the lm_head's gradient goes where the embedding's shards
        are made (nothing here: it is the head's own entry)."""

    def scale_on_device(self, loss_grad: torch.Tensor) -> None:
        """backward: the loss gradient scales the part of the gradient kept on the device."""

    def scale_on_host(self, rest: torch.Tensor, scale: float, table) -> None:
        """The worker's head task: the loss gradient scales the part that crossed to the host
        (`table`: the embedding's table when the backward began, embedding_table.py)."""

    # ------------------------------------------------------------- the embedding's gradient (embedding.py)
    overwrites_embedding_grad = False   # does the lm_head's gradient write every row of the embedding's?

    def start_resident_grad(self, grad: torch.Tensor) -> None:
        """The resident embedding's (V, H) device gradient before the batch rows' sums join it."""
        grad.zero_()

    def embedding_sq(self, sums: torch.Tensor) -> torch.Tensor:
        """The embedding's squared gradient norm from the batch rows' sums `sums` (distinct rows, H)."""
        return sums.square().sum()

    def clear_rows(self, table_grad: torch.Tensor, touched: list) -> None:
        """The embedding's dense host gradient back to zeros: the rows batches touched."""
        for ids in touched:
            table_grad.index_fill_(0, ids, 0.0)

    def adopt_embedding_grad(self, grad: torch.Tensor, planned) -> None:
        """The embedding's dense host gradient was just made (`planned`: the resident plan's target)."""

    def embedding_stays_on_host(self) -> None:
        """The resident plan keeps the embedding on the host from this step (resident.py, `promote`)."""

    def resident_grad_to_host(self) -> None:
        """The resident embedding is evicted mid-step: its host gradient takes what the head put
        in the device one (resident.py, `evict`)."""


class TiedWeight:
    """A tied lm_head: its weight is the input embedding's table, its gradient the embedding's.

    Args:
        engine: the SlideEngine (its embedding, the embedding unit, the worker's host updates).
        unit: the head unit (the final norm).
    """

    def __init__(self, engine, unit: Unit):
        self.engine, self.unit = engine, unit
        self.units = (unit, engine.embed_unit)  # what the head slot carries with the embedding on the host

    def trainable(self) -> bool:
        return self.unit.trainable or self.engine.embed_unit.trainable

    def may_update_last(self) -> bool:
        return False                           # the embedding's table: updated with the embedding

    def slot_units(self) -> tuple:
        return self.engine.embedding.table.tied_slot_units(self.unit)

    def weights(self, slots):
        table = self.engine.embedding.table   # in the slot, or the resident embedding's compute copy
        slot = slots.acquire(table.tied_slot_units(self.unit))
        return slot, slot.views(self.unit), table.tied_weight(slot)

    def leaf(self, leaves: list, weight: torch.Tensor) -> tuple[torch.Tensor, list]:
        wl = weight.detach().requires_grad_()
        return wl, [wl]

    def take_norm(self, pgrads: list) -> None:
        """The tied gradient's squared norm and batch rows, for the embedding's norm (embedding.py)."""
        emb, dw = self.engine.embedding, pgrads[-1]
        emb.dw_sq = _sq_norm([dw])
        emb.dw_rows = dw.index_select(0, emb.rows_dev[0]).float()

    def host_numel(self) -> int:
        return self.engine.embedding.table.tied_host_numel()

    def destinations(self, pgrads: list, rest: torch.Tensor) -> list:
        return self.engine.embedding.table.tied_destinations(pgrads, rest)

    def scale_on_device(self, loss_grad: torch.Tensor) -> None:
        self.engine.embedding.table.scale_tied_on_device(loss_grad)

    def hand_to_shards(self, pgrads: list, scale: torch.Tensor) -> None:
        """The gradient (`pgrads`' tail, after the head unit's) and the loss gradient that scales
        it join the embedding's dense gradient (`ShardedEmbedding`)."""
        self.engine.embedding.dw, self.engine.embedding.dw_scale = pgrads[len(self.unit.entries)], scale

    overwrites_embedding_grad = True

    def start_resident_grad(self, grad: torch.Tensor) -> None:
        pass                               # it holds the lm_head's gradient (`destinations`, `scale_on_device`)

    def embedding_sq(self, sums: torch.Tensor) -> torch.Tensor:
        """|dW + S|^2 = |dW|^2 - |dW[rows]|^2 + |dW[rows] + S|^2, without the (V, H) gradient."""
        engine, emb = self.engine, self.engine.embedding
        scale = engine.head.scale_dev
        rows = emb.dw_rows * scale
        return emb.dw_sq * scale ** 2 - rows.square().sum() + (rows + sums).square().sum()

    def clear_rows(self, table_grad: torch.Tensor, touched: list) -> None:
        pass                               # the head's contribution overwrites every row first

    def adopt_embedding_grad(self, grad: torch.Tensor, planned) -> None:
        """Pinned: the lm_head's gradient lands there straight from the GPU (embedding.py: [Why only
        a tied embedding's dense gradient is pinned]), unless the embedding is going resident."""
        if planned is None or not planned[0]:
            self.engine.pinned.adopt(grad)

    def embedding_stays_on_host(self) -> None:
        engine, emb = self.engine, self.engine.embedding
        if not engine.pinned.enabled:
            return
        if emb.grad is not None and not emb.grad.is_pinned():
            # The dense gradient is written by d2h copies every step again, so it is pinned again
            # (after an eviction for a checkpoint the embedding comes back at once, and one step's
            # pageable copy costs less than pinning 2 GB). embedding.py: [Why only a tied
            # embedding's dense gradient is pinned]
            engine.pinned.adopt(emb.grad)
        if not engine.embed_unit.master.is_pinned():
            engine.pinned.adopt(engine.embed_unit.master)     # the head slot copies it in again

    def resident_grad_to_host(self) -> None:
        emb = self.engine.embedding
        if emb.rgrad is not None:
            emb.grad.copy_(emb.rgrad)

    def scale_on_host(self, rest: torch.Tensor, scale: float, table) -> None:
        table.scale_tied_on_host(rest, scale)
