"""BackwardMode: what one backward pass does, fixed when it begins.

The engine makes one at `begin_backward` from the accumulation and clipping settings and the
number of backward passes since the last optimizer step; every part of the schedule reads it
instead of re-deriving the same facts from the config and counters.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BackwardMode"]


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
