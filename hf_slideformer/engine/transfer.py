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
    """The compute stream (the caller's current stream) and the two copy streams.

    Note: [Why copy sources are handed over, not recorded] a tensor made on the compute stream
    and read by a copy on another stream must not be reused before the copy has run.
    `Tensor.record_stream` says so to the caching allocator, but the allocator then gives the block
    back only once it sees the copy's event complete, and the issuing thread runs layers ahead of
    the GPU: every layer input and layer gradient it has issued since is memory owed to a copy
    stream, which no other tensor can take (under a tight cap, the path to the allocator's
    synchronising free-everything-and-retry). `hand_over` keeps the tensors instead, and at the
    next hand-over (one layer later: its kernels are queued by then) makes the compute stream
    wait for the copy's event and drops them. Freed on the stream that made them, after that
    wait in stream order, their blocks serve the next layer at once; the GPU reaches the wait a
    layer's compute after the copy began, so it does not stall on it.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.h2d = torch.cuda.Stream(device)
            self.d2h = torch.cuda.Stream(device)
        else:
            self.h2d = self.d2h = None
        self._owed: list[tuple[list, object]] = []      # (tensors, the event of the copies that read them)

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

    def synchronize(self) -> None:
        """Wait, on the host, for all work issued on the device (a no-op on the CPU). For the ends of
        phases that hand memory or buffers back (eviction, a buffer regrown, close), never the step."""
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def used_by(self, tensor, stream) -> None:
        """Tell the caching allocator that `tensor` (made on another stream) is read by `stream`'s
        queued work (`Tensor.record_stream`; nothing to do on the CPU or for a non-tensor)."""
        if self.cuda and torch.is_tensor(tensor):
            tensor.record_stream(stream)

    def hand_over(self, tensors, event) -> None:
        """Keep `tensors` (made on the compute stream) until the copies that read them, which end at
        `event`, are ordered before the compute stream's later work: first settle the tensors
        handed over before (Note: [Why copy sources are handed over, not recorded])."""
        if not self.cuda:
            return
        self.settle()
        self._owed.append((list(tensors), event))

    def settle(self) -> None:
        """Make the compute stream wait for the copies of every tensor handed over, and drop them."""
        owed, self._owed = self._owed, []
        for _, event in owed:
            self.wait(event)

    @property
    def owed(self) -> int:
        """Tensors handed over and not settled yet."""
        return sum(len(t) for t, _ in self._owed)

    def on(self, stream):
        """Context manager: issue work on `stream` (a no-op on CPU)."""
        if self.cuda:
            return torch.cuda.stream(stream)
        import contextlib
        return contextlib.nullcontext()
