"""Errors of the engine that a training loop can cause."""
from __future__ import annotations

__all__ = ["SlideStateError"]


class SlideStateError(RuntimeError):
    """The training loop called the engine in an order it cannot honour exactly."""
