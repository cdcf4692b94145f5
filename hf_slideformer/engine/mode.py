"""The backward's lifecycle: what one backward does (`BackwardMode`, fixed when it begins) and
whether one an error stopped half way left the state inconsistent (`BackwardGuard`).

The engine makes a `BackwardMode` at `begin_backward` from the accumulation and clipping settings
and the number of backward passes since the last optimizer step; every part of the schedule reads
it instead of re-deriving the same facts from the config and counters.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..errors import SlideStateError

__all__ = ["BackwardMode", "BackwardGuard"]


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
