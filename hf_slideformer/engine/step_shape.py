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
| a device-updated layer's gradient | its own path: updated now, or kept in its pinned accumulator | a host layer's: the worker folds it in |
| a resident layer's gradient | its norm joins the running norm; copied into the buffer its update reads | summed on the device; the last backward adds the sum's norm |
| the resident plan (resident.py) | from the config and the measured peak | the config's layers alone, no embedding |
| the device updates' share without clipping | the config's number | none |
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

    # ------------------------------------------------------------- the device-updated layers (device_update.py)
    def device_layer_gradient(self, place, grads: list) -> None:
        """A device-updated layer's gradient: updated from now, or kept for the next copy in
        (`DeviceUpdateLayer.take_step_gradient`)."""
        place.take_step_gradient(grads)

    def share_in_backward(self, share: float) -> float:
        """The share of the host-held layers updated on the device in the backward (no clipping):
        the config's `share`."""
        return share

    # ------------------------------------------------------------- the resident layers (resident.py)
    def resident_gradient(self, place, grads: list, plan) -> torch.Tensor:
        """A resident layer's gradient, into the fp32 gradient its update reads (returned):
        `ResidentLayer.take_step_gradient`."""
        return place.take_step_gradient(grads, plan)

    def resident_plan(self, residents) -> tuple[bool, int]:
        """The resident units: from the config and the measured peak (`ResidentPlan.measured_plan`)."""
        return residents.measured_plan()


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

    def device_layer_gradient(self, place, grads: list) -> None:
        """The worker folds it in, as a host layer's (`DeviceUpdateLayer.fold_gradient`)."""
        place.fold_gradient(grads)

    def share_in_backward(self, share: float) -> float:
        """None: without clipping the device updates run in a backward that ends the step, which
        needs one backward per step."""
        return 0.0

    def resident_gradient(self, place, grads: list, plan) -> torch.Tensor:
        """Summed over the micro-batches on the device (`ResidentLayer.sum_micro_gradient`)."""
        return place.sum_micro_gradient(grads, plan)

    def resident_plan(self, residents) -> tuple[bool, int]:
        """The resident units: no embedding, and the layers the config asks for."""
        # Note: [Why accumulation keeps resident layers opt-in] with accumulation a resident
        # layer sums its micro-batches' gradients on the GPU and is updated there when the step
        # ends (`ResidentLayer.take_gradient`); the embedding stays on the host (its tied head
        # gradient and per-row folding have no device path across micro-batches). The layers
        # are taken only as many as `resident_layers` asks: "auto" keeps none here until the
        # mode has been measured on a GPU.
        wanted = residents.engine.config.resident_layers
        return False, (0 if wanted == "auto" else int(wanted))
