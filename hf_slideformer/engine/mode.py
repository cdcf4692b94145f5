"""The backward's lifecycle: what one backward does (`BackwardMode`, fixed when it begins) and
whether one an error stopped half way left the state inconsistent (`BackwardGuard`).

The engine makes a `BackwardMode` at `begin_backward` from the accumulation and clipping settings
and the number of backward passes since the last optimizer step; every part of the schedule reads
it instead of re-deriving the same facts from the config and counters. What a part does with a
unit's update as it takes the unit's gradient is an object the backward's plan hands it
(`BackwardPlan.updating`: `UpdatesInBackward`, or `UpdatesAtStep`), not a flag it tests.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..errors import SlideStateError

__all__ = ["BackwardMode", "BackwardGuard", "UpdatesInBackward", "UpdatesAtStep", "UPDATES_IN_BACKWARD",
           "UPDATES_AT_STEP"]


@dataclass(frozen=True)
class BackwardMode:
    """One backward's mode.

    Attributes:
        ends_step: this backward is the optimizer step's last micro-batch (its gradients complete
            the step's sums).
        updates: the units are updated during this backward, as their gradients land: it ends
            the step and no global quantity (the clipping norm) is needed first. Otherwise the
            gradients wait in the host accumulators for `optimizer.step()`.
    """

    ends_step: bool = False
    updates: bool = False

    @classmethod
    def of(cls, micro: int, gradient_accumulation_steps: int, clipping: bool) -> "BackwardMode":
        """The mode of backward number `micro` (0-based) of a step of `gradient_accumulation_steps`."""
        ends = micro + 1 == gradient_accumulation_steps
        return cls(ends_step=ends, updates=ends and not clipping)


class UpdatesInBackward:
    """What a part does with a unit's gradient when the backward updates (`BackwardPlan.updating`):
    the unit's update is begun now, runs as the gradient lands, and its task signals the unit
    updated."""

    def begin(self, engine, unit) -> None:
        """Mark `unit` as being updated (`SlideEngine.begin_update`)."""
        engine.begin_update(unit)

    def signals(self, unit) -> tuple:
        """The events the unit's task sets when done, besides its buffer's: the unit is updated."""
        return (unit.updated,)

    def late_buffer(self, late):
        """A late buffer for the gradient, when the late layers have one left (late_updates.py:
        [Why the top layers are updated late]), else None."""
        return late.claim()

    def queue(self, engine, unit, task, *args) -> None:
        """Begin `unit`'s update and queue `task(*args)` on the worker, which signals it updated."""
        engine.begin_update(unit)
        engine.worker.submit(task, *args, done=(unit.updated,))

    def now(self, run) -> None:
        """Run the update `run()` now (on the device)."""
        run()

    def update_or_keep(self, update, keep) -> None:
        """Run the update `update()` now, from the gradient still on the device (`keep`, which
        keeps it for `optimizer.step()`, is not called)."""
        update()

    def buffer(self, shared, own):
        """Where a gradient that is updated from at once is summed: `shared()`, a buffer the units
        share (each update uses it up before the next unit's gradient), not the unit's `own()`."""
        return shared()

    def updated_here(self, units: list) -> list:
        """Those of `units` this backward updates as their gradients land: all of them."""
        return units


class UpdatesAtStep:
    """What a part does with a unit's gradient when the backward does not update: the gradient
    waits for `optimizer.step()`; nothing is begun, queued or signalled."""

    def begin(self, engine, unit) -> None:
        pass

    def signals(self, unit) -> tuple:
        return ()

    def late_buffer(self, late) -> None:
        return None

    def queue(self, engine, unit, task, *args) -> None:
        pass

    def now(self, run) -> None:
        pass

    def update_or_keep(self, update, keep) -> None:
        """Keep the gradient for `optimizer.step()`: `keep()`."""
        keep()

    def buffer(self, shared, own):
        """The unit's own buffer, `own()`, where the gradient waits for `optimizer.step()`."""
        return own()

    def updated_here(self, units: list) -> list:
        """None of `units`: their gradients wait for `optimizer.step()`."""
        return []


UPDATES_IN_BACKWARD = UpdatesInBackward()
UPDATES_AT_STEP = UpdatesAtStep()


class BackwardGuard:
    """Whether a backward is running, and whether one an error stopped half way left the weights
    and the optimizer state inconsistent (some layers of the step updated, others not): then every
    later training call raises until both are restored (`note_restored`).

    Args:
        release: called once for an interrupted backward, to let every waiter go (nothing may hang).
    """

    MESSAGE = ("the previous backward() was interrupted by an error after some layers were updated: the weights "
               "and AdamW state are inconsistent for this step. Reload the model, or restore both its weights and "
               "optimizer state (load_training_state, a Trainer resume, or model.load_state_dict and "
               "optimizer.load_state_dict), before training on.")

    def __init__(self, release: Callable[[], None]):
        self.open = False
        self.inconsistent: str | None = None
        self._restored: set[str] = set()
        self._release = release

    def close_interrupted(self) -> None:
        """If a backward is still open, an error stopped it: release its waiters, mark the state."""
        if not self.open:
            return
        self.open = False
        try:
            self._release()
        finally:
            self.inconsistent = self.MESSAGE
            self._restored = set()

    def check(self) -> None:
        """Raise if an interrupted backward left the state inconsistent and it was not restored."""
        self.close_interrupted()
        if self.inconsistent is not None:
            raise SlideStateError(self.inconsistent)

    def note_restored(self, weights: bool = False, optimizer: bool = False) -> None:
        """The weights and/or the optimizer state were just loaded from a consistent source; once
        both have been since an interrupted backward, training may go on."""
        self.close_interrupted()
        if weights:
            self._restored.add("weights")
        if optimizer:
            self._restored.add("optimizer")
        if self._restored >= {"weights", "optimizer"}:
            self.inconsistent = None
