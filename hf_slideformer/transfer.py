"""Streams and events: h2d and d2h on their own CUDA streams, ordered by events, never by a
device-wide synchronize. On the CPU every event is already complete and every stream is the
caller's, so the same schedule runs unchanged in CPU tests.
"""
from __future__ import annotations

import torch

__all__ = ["Streams", "DoneEvent"]


class DoneEvent:
    """An event that has already happened (CPU device)."""

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def wait(self, stream=None) -> None:
        pass


class Streams:
    """The compute stream (the caller's current stream) and the two copy streams."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.h2d = torch.cuda.Stream(device)
            self.d2h = torch.cuda.Stream(device)
        else:
            self.h2d = self.d2h = None

    @property
    def compute(self):
        return torch.cuda.current_stream(self.device) if self.cuda else None

    def record(self, stream=None, timing: bool = False):
        """An event marking the work issued so far on `stream` (default: compute)."""
        if not self.cuda:
            return DoneEvent()
        ev = torch.cuda.Event(enable_timing=timing)
        ev.record(stream if stream is not None else self.compute)
        return ev

    def wait(self, event, stream=None) -> None:
        """Make `stream` (default: compute) wait for `event` without blocking the host."""
        if self.cuda and event is not None and not isinstance(event, DoneEvent):
            (stream if stream is not None else self.compute).wait_event(event)

    def on(self, stream):
        """Context manager: issue work on `stream` (a no-op on CPU)."""
        if self.cuda:
            return torch.cuda.stream(stream)
        import contextlib
        return contextlib.nullcontext()
