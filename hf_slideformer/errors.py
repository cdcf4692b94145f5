"""Errors of the engine that a training loop, its inputs or its launch can cause."""
from __future__ import annotations

__all__ = ["NonFiniteGradientError", "NonFiniteWeightError", "SlideStateError", "RankMismatchError",
           "RankTimeoutError"]


class SlideStateError(RuntimeError):
    """The training loop called the engine in an order it cannot honour exactly."""


class NonFiniteGradientError(RuntimeError):
    """A gradient of the step was inf or NaN and `SlideConfig.nonfinite_grads` is 'raise'."""


class NonFiniteWeightError(ValueError):
    """A weight of the model (at `slide()` or in a loaded checkpoint) holds inf or NaN; the message
    names the parameter. `SlideConfig.check_finite_weights=False` lets the model in anyway."""


class RankMismatchError(ValueError):
    """The ranks of a data-parallel launch differ in a setting that changes the mathematics (or in
    the model); the message names it and the values of both ranks."""


class RankTimeoutError(RuntimeError):
    """A rank waited `SlideConfig.rank_timeout` seconds for its peers at a step boundary."""
