"""What the parts do differently with one backward per optimizer step and with gradient
accumulation, outside one backward's plan (schedule.py: `BackwardPlan`, `StepPlan`): the
engine chooses one of the two whenever the accumulation setting is set (at `slide()` and in
`SlideEngine.configure_steps`), and the parts ask it instead of the setting.

| | `OneBackwardStep` | `AccumulatedStep` |
|---|---|---|
| the head's forward | takes the norm terms of its gradients (and a tied lm_head's) for the running norm | none: the norm is taken from the step's sums |
| a tied lm_head's gradient on the host | straight into the embedding's pinned dense gradient | after the head unit's in the head's host buffer, folded into the embedding's by the worker |
| the embedding's rows update in backward | the batch rows' sums added inside their AdamW | the sums folded into the dense gradient first |
| the head's update held to the end of the backward | may be (head.py) | never |
| `last_grad_norm()` | the device's running norm | the worker's sums' norms and the device's part |
"""
from __future__ import annotations

import torch

from ..host.optim import sq_norm as _sq_norm

__all__ = ["OneBackwardStep", "AccumulatedStep"]


class OneBackwardStep:
    """One backward per optimizer step (`gradient_accumulation_steps=1`): the step's norm is the
    device's running norm, taken as the gradients are made.

    Args:
        engine: the SlideEngine (its worker and host updates).
    """

    def __init__(self, engine):
        self.engine = engine

    def head_norm_terms(self, lm_weight, pgrads: list, own: int) -> torch.Tensor:
        """The head's forward: the squared norm of its own gradients (`pgrads`' first `own`),
        and a tied lm_head's terms for the embedding's norm (lm_weight.py, `take_norm`)."""
        sq = _sq_norm([g for g in pgrads[:own] if g is not None])
        lm_weight.take_norm(pgrads)
        return sq

    def head_may_update_last(self) -> bool:
        """May the head's update wait for the end of the backward (head.py, `LossHead.updates_last`)?"""
        return True

    # ------------------------------------------------------------- a tied lm_head on the host (embedding_table.py)
    def tied_host_numel(self, emb) -> int:
        """Elements a tied lm_head's gradient takes in the head's host buffer: none, it goes
        straight into the embedding's."""
        return 0

    def tied_destinations(self, emb, rest: torch.Tensor) -> list:
        """Where a tied lm_head's gradient crosses to: straight into the embedding's pinned gradient
        buffer (which the previous step's update has released)."""
        return [emb.grad]

    def scale_tied_on_host(self, emb, rest: torch.Tensor, scale: float) -> None:
        """The worker's head task: the loss gradient `scale` scales the embedding's dense gradient,
        where the tied lm_head's gradient already is (head.py: forward)."""
        if scale != 1.0:
            emb.grad.mul_(scale)

    # ------------------------------------------------------------- the embedding's update (embedding.py)
    def rows_update(self, emb, rows: torch.Tensor, sums: torch.Tensor, hp) -> bool:
        """The worker's embedding task, after the bulk update: the batch's rows updated with their
        sums added inside their AdamW (`Embedding.update_rows_with_sums`); whether it ran here."""
        emb.update_rows_with_sums(rows, sums, hp)
        return True

    def last_norm(self, norm) -> float:
        """`last_grad_norm()`: from the device's running norm (`StepNorm.running_last`)."""
        return norm.running_last()


class AccumulatedStep:
    """Several backward passes per optimizer step (gradient accumulation): the gradients are
    summed, on the host or the device, and the step's norm is taken from the sums.

    Args:
        engine: the SlideEngine.
    """

    def __init__(self, engine):
        self.engine = engine

    def head_norm_terms(self, lm_weight, pgrads: list, own: int) -> None:
        """None: no running norm to add to."""
        return None

    def head_may_update_last(self) -> bool:
        return False                        # every update waits for the step's last backward

    def tied_host_numel(self, emb) -> int:
        """The embedding's: a tied lm_head's gradient joins the head's in its host buffer."""
        return emb.unit.numel

    def tied_destinations(self, emb, rest: torch.Tensor) -> list:
        """The head's host buffer after the head unit's gradient (`rest`)."""
        return [rest]

    def scale_tied_on_host(self, emb, rest: torch.Tensor, scale: float) -> None:
        """The worker's head task: the gradient in `rest` times `scale`, folded into the embedding's
        dense host gradient."""
        self.engine.host_updates.fold(emb.grad, rest, scale, first=not emb.unit.grad_valid)
        emb.unit.grad_valid = True

    def rows_update(self, emb, rows: torch.Tensor, sums: torch.Tensor, hp) -> bool:
        """False: the sums are folded into the dense gradient first (`Embedding._embed_task`)."""
        return False

    def last_norm(self, norm) -> float:
        """From the worker's norms of the sums and the device's part (`StepNorm.summed_last`)."""
        return norm.summed_last()
