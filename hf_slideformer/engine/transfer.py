"""Streams and events: h2d and d2h on their own CUDA streams (and a pair of the same for the
updates that run in the backward), ordered by events, never by a device-wide synchronize.

`Streams` is the interface the engine's parts use, chosen once for the engine's device by
`Streams.for_device`: `CudaStreams` on a CUDA device, `HostStreams` on the CPU, where every event
is already complete and every stream is the caller's, so the same schedule runs unchanged in CPU
tests. What else differs between the two devices (how a gradient or a row crosses, where a skip
is decided, whether a resident unit gains anything) is a method of the streams too.
"""
from __future__ import annotations

import abc
import contextlib

import torch

from ..planner.budget import balanced_share
from .staging import staged_copy

__all__ = ["Streams", "HostStreams", "CudaStreams", "DoneEvent"]


class DoneEvent:
    """An event that has already happened (CPU device)."""

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def wait(self, stream=None) -> None:
        pass


class Streams(abc.ABC):
    """The compute stream (the caller's current stream), the two copy streams `h2d` and `d2h`,
    and what else differs between a CUDA and a CPU device: the interface of `CudaStreams` and
    `HostStreams`, one of which `Streams.for_device` makes.

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

    Args:
        device: the engine's device.
    """

    tracer = None        # the StepStats whose step trace copy spans join (the engine sets it)

    def __init__(self, device: torch.device):
        self.device = device

    def copy_span_start(self, stream):
        """While a step trace is recorded on a GPU: a timing event on `stream` that opens the span
        of the copies issued there next (`copy_span_end` closes it); else None."""
        tracer = self.tracer
        return self.record(stream, timing=True) if tracer is not None and tracer.tracing_gpu else None

    def copy_span_end(self, start, stream, label: str) -> None:
        """Close the span `start` opened: the work issued on `stream` since, `label` in the trace."""
        if start is not None:
            self.tracer.copy_span(start, self.record(stream, timing=True), label)

    @staticmethod
    def for_device(device: torch.device) -> "Streams":
        """The streams of `device`: `CudaStreams` on a CUDA device, else `HostStreams`."""
        return CudaStreams(device) if device.type == "cuda" else HostStreams(device)

    @property
    @abc.abstractmethod
    def compute(self):
        """The compute stream (the caller's current stream; None on the CPU)."""

    @abc.abstractmethod
    def record(self, stream=None, timing: bool = False):
        """An event marking the work issued so far on `stream` (default: compute)."""

    @abc.abstractmethod
    def timing_event(self):
        """An event for timing GPU compute on the compute stream, or None where nothing is timed."""

    @abc.abstractmethod
    def wait(self, event, stream=None) -> None:
        """Make `stream` (default: compute) wait for `event` without blocking the host."""

    @abc.abstractmethod
    def synchronize(self) -> None:
        """Wait, on the host, for all work issued on the device (a no-op on the CPU). For the ends of
        phases that hand memory or buffers back (eviction, a buffer regrown, close), never the step."""

    @abc.abstractmethod
    def used_by(self, tensor, stream) -> None:
        """Tell the caching allocator that `tensor` (made on another stream) is read by `stream`'s
        queued work (`Tensor.record_stream`; nothing to do on the CPU or for a non-tensor)."""

    @abc.abstractmethod
    def hand_over(self, tensors, event, hold: int = 1) -> None:
        """Keep `tensors` (made on the compute stream) until the copies that read them, which end at
        `event`, are ordered before the compute stream's later work: at the `hold`-th hand-over
        after this one (Note: [Why copy sources are handed over, not recorded]); nothing to keep on
        the CPU."""

    @abc.abstractmethod
    def settle(self) -> None:
        """Make the compute stream wait for the copies of every tensor handed over, and drop them."""

    @property
    @abc.abstractmethod
    def owed(self) -> int:
        """Tensors handed over and not settled yet."""

    @abc.abstractmethod
    def on(self, stream):
        """Context manager: issue work on `stream` (a no-op on CPU)."""

    @abc.abstractmethod
    def copy_unsynced(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy `src` into `dst` without a host sync where the device has one to spare (CUDA:
        `non_blocking`), else a plain copy."""

    @abc.abstractmethod
    def gradients_to_host(self, grads: list, dsts: list[torch.Tensor], ends: list[int] | None, marks: list | None,
                          norm: torch.Tensor, norm_dst: torch.Tensor | None, stage: torch.Tensor | None, stats):
        """Copy device gradients `grads` (None: zero) into host buffers `dsts`, widened to a buffer's
        fp32 where it is (through the device buffer `stage` on CUDA), never narrowed; `norm` into
        `norm_dst` first (if given). The k-th copy appends (ends[k], its event) to `marks` (from
        `copy_marks`); bytes crossing a link count into `stats`. The event after the last copy."""

    @abc.abstractmethod
    def copy_marks(self) -> list | None:
        """A list that `gradients_to_host` fills with an event per gradient (the worker starts on a
        unit's front while the rest is in flight), or None where a copy is done when issued (CPU)."""

    @abc.abstractmethod
    def gather_rows(self, table: torch.Tensor, ids: torch.Tensor, staged) -> torch.Tensor:
        """Rows `ids` of the host tensor `table`, on the device: where the host is the device (CPU)
        an `index_select`, else `staged(table, ids)`, the caller's copy in through pinned memory."""

    @abc.abstractmethod
    def skip_on_host(self, found_inf: torch.Tensor) -> tuple[bool, torch.Tensor | None]:
        """(skip now, the flag handed to the device update) from `found_inf` (1.0 on the device where
        the running norm is not finite): decided on the host on the CPU, on the device on CUDA."""

    @abc.abstractmethod
    def clip_coef(self, max_norm: float, norm_sq: torch.Tensor):
        """The clip factor from `max_norm` and the squared gradient norm `norm_sq` (a device scalar):
        a device scalar on CUDA (no sync), a float with the host tasks' arithmetic on the CPU."""

    @abc.abstractmethod
    def balanced_update_share(self, pinned) -> float:
        """The "auto" share of the host-held layers updated on the device: the one that balances the
        CPU and the link where the copies are DMA from pinned memory (`pinned.enabled`), else 0.0."""

    @abc.abstractmethod
    def plan_resident(self, asked, measure):
        """The resident plan: `asked` (what the config asks for) where nothing is gained on the
        device unless asked (CPU), else `measure()` (what the GPU's memory has room for)."""


class HostStreams(Streams):
    """A CPU device's streams: every event is already complete and every stream is the caller's."""

    h2d = d2h = update_h2d = update_d2h = None

    @property
    def compute(self):
        """None: the caller's own thread runs the work."""
        return None

    def record(self, stream=None, timing: bool = False):
        """A `DoneEvent`: the work issued so far has run."""
        return DoneEvent()

    def timing_event(self):
        """None: no GPU compute to time."""
        return None

    def wait(self, event, stream=None) -> None:
        """Nothing to wait for: every event is done."""

    def synchronize(self) -> None:
        """Nothing issued is still running."""

    def used_by(self, tensor, stream) -> None:
        """No caching allocator to tell."""

    def hand_over(self, tensors, event, hold: int = 1) -> None:
        """Nothing to keep: the copies that read `tensors` have run."""

    def settle(self) -> None:
        """Nothing handed over."""

    @property
    def owed(self) -> int:
        """0: nothing is handed over."""
        return 0

    def on(self, stream):
        """The caller's own context (a no-op)."""
        return contextlib.nullcontext()

    def copy_unsynced(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """A plain copy."""
        dst.copy_(src, non_blocking=False)

    def gradients_to_host(self, grads: list, dsts: list[torch.Tensor], ends: list[int] | None, marks: list | None,
                          norm: torch.Tensor, norm_dst: torch.Tensor | None, stage: torch.Tensor | None, stats):
        """Plain copies (no link crossed); a done event."""
        if norm_dst is not None:
            norm_dst.copy_(norm.reshape(1))
        for grad, dst in zip(grads, dsts):
            if grad is None:
                dst.zero_()
            else:
                _check_lossless(grad, dst)
                dst.copy_(grad.reshape(dst.shape))
        return self.record()

    def copy_marks(self) -> None:
        """None: every copy is done when issued."""
        return None

    def gather_rows(self, table: torch.Tensor, ids: torch.Tensor, staged) -> torch.Tensor:
        """The host table is on the device: an `index_select`."""
        return table.index_select(0, ids)

    def skip_on_host(self, found_inf: torch.Tensor) -> tuple[bool, None]:
        """Decided on the host: nothing changes, counters included; the update reads no flag."""
        return bool(float(found_inf)), None

    def clip_coef(self, max_norm: float, norm_sq: torch.Tensor) -> float:
        """A float, with the host tasks' arithmetic."""
        return min(max_norm / (float(norm_sq) ** 0.5 + 1e-6), 1.0)

    def balanced_update_share(self, pinned) -> float:
        """0.0: no link to balance against."""
        return 0.0

    def plan_resident(self, asked, measure):
        """`asked`: nothing to gain on a CPU device unless asked."""
        return asked


class CudaStreams(Streams):
    """A CUDA device's streams: the caller's current stream computes, `h2d` and `d2h` copy, and
    `update_h2d` / `update_d2h` carry the updates run in the backward (device_update.py: [Why an
    update in the backward has streams of its own]); the tensors read by copies to the host are
    handed over (Note: [Why copy sources are handed over, not recorded])."""

    def __init__(self, device: torch.device):
        super().__init__(device)
        self.h2d = torch.cuda.Stream(device)
        self.d2h = torch.cuda.Stream(device)
        self.update_h2d = torch.cuda.Stream(device)
        self.update_d2h = torch.cuda.Stream(device)
        # [tensors, the event of the copies that read them, hand-overs left before the compute waits]
        self._owed: list[list] = []

    @property
    def compute(self):
        """The caller's current stream on the device."""
        return torch.cuda.current_stream(self.device)

    def record(self, stream=None, timing: bool = False):
        """A CUDA event recorded on `stream` (default: compute)."""
        ev = torch.cuda.Event(enable_timing=timing)
        ev.record(stream if stream is not None else self.compute)
        return ev

    def timing_event(self):
        """A timing event on the compute stream."""
        return self.record(timing=True)

    def wait(self, event, stream=None) -> None:
        """`stream.wait_event` (nothing for None or a done event)."""
        if event is not None and not isinstance(event, DoneEvent):
            (stream if stream is not None else self.compute).wait_event(event)

    def synchronize(self) -> None:
        """`torch.cuda.synchronize` of the device."""
        torch.cuda.synchronize(self.device)

    def used_by(self, tensor, stream) -> None:
        """`Tensor.record_stream` (nothing for a non-tensor)."""
        if torch.is_tensor(tensor):
            tensor.record_stream(stream)

    def hand_over(self, tensors, event, hold: int = 1) -> None:
        """Keep `tensors`: first settle the tensors handed over before whose hold ends here (Note:
        [Why copy sources are handed over, not recorded])."""
        kept = []
        for owed in self._owed:
            owed[2] -= 1
            if owed[2] > 0:
                kept.append(owed)
            else:
                self.wait(owed[1])
        self._owed = kept + [[list(tensors), event, hold]]

    def settle(self) -> None:
        """Make the compute stream wait for the copies of every tensor handed over, and drop them."""
        owed, self._owed = self._owed, []
        for _, event, _ in owed:
            self.wait(event)

    @property
    def owed(self) -> int:
        """Tensors handed over and not settled yet."""
        return sum(len(t) for t, _, _ in self._owed)

    def on(self, stream):
        """`torch.cuda.stream(stream)`."""
        return torch.cuda.stream(stream)

    def copy_unsynced(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """A `non_blocking` copy on the current stream."""
        dst.copy_(src, non_blocking=True)

    def gradients_to_host(self, grads: list, dsts: list[torch.Tensor], ends: list[int] | None, marks: list | None,
                          norm: torch.Tensor, norm_dst: torch.Tensor | None, stage: torch.Tensor | None, stats):
        """On the d2h stream, after the compute work issued so far; the gradients handed over."""
        # Note: [Why the d2h waits for the compute event] gradients are produced on the compute stream.
        self.wait(self.record(), self.d2h)
        span = self.copy_span_start(self.d2h)
        with self.on(self.d2h):
            if norm_dst is not None:
                norm_dst.copy_(norm.reshape(1), non_blocking=True)
            for grad, dst in zip(grads, dsts):
                dst = dst.view(-1)
                if grad is None:
                    dst.zero_()
                else:
                    _check_lossless(grad, dst)
                    gf = grad.reshape(-1)
                    if gf.dtype == dst.dtype:
                        dst.copy_(gf, non_blocking=True)
                    else:                    # widened on the device, all on the d2h stream
                        staged_copy(dst, gf, stage)
                    stats.add_bytes("d2h", dst.numel() * dst.element_size())
                if marks is not None:
                    marks.append((ends[len(marks)], self.record(self.d2h)))
        done = self.record(self.d2h)
        self.copy_span_end(span, self.d2h, "gradients")
        # Note: [Why copy sources are handed over, not recorded]
        self.hand_over([g for g in grads if g is not None], done)
        return done

    def copy_marks(self) -> list:
        """An empty list, filled by `gradients_to_host`."""
        return []

    def gather_rows(self, table: torch.Tensor, ids: torch.Tensor, staged) -> torch.Tensor:
        """`staged(table, ids)`: the rows cross through pinned memory."""
        return staged(table, ids)

    def skip_on_host(self, found_inf: torch.Tensor) -> tuple[bool, torch.Tensor]:
        """Decided on the device: never now, `found_inf` handed to the update."""
        return False, found_inf

    def clip_coef(self, max_norm: float, norm_sq: torch.Tensor) -> torch.Tensor:
        """A device scalar, with torch's clip_grad_norm_ arithmetic."""
        return (max_norm / (norm_sq.sqrt() + 1e-6)).clamp(max=1.0)

    def balanced_update_share(self, pinned) -> float:
        """`budget.balanced_share()` with pinned memory, else 0.0."""
        # Without pinned host memory the copies would crawl (pageable h2d: 8.7 GB/s).
        return balanced_share() if pinned.enabled else 0.0

    def plan_resident(self, asked, measure):
        """What `measure()` finds room for in the GPU's memory."""
        return measure()


def _check_lossless(grad: torch.Tensor, dst: torch.Tensor) -> None:
    if dst.dtype != grad.dtype and dst.dtype != torch.float32:
        raise RuntimeError(f"a {grad.dtype} gradient cannot land in a {dst.dtype} host buffer without rounding")
