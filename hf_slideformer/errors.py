"""Errors of the engine that a training loop can cause."""
from __future__ import annotations

__all__ = ["NonFiniteGradientError", "SlideStateError"]


class SlideStateError(RuntimeError):
    """The training loop called the engine in an order it cannot honour exactly."""


class NonFiniteGradientError(RuntimeError):
    """A gradient of the step was inf or NaN and `SlideConfig.nonfinite_grads` is 'raise'."""
