"""Step telemetry: where the time of a step goes, and how many bytes moved.

Host-side waits are timed directly (`MainClock`, the service through which the schedule's parts
block on the CPU worker and time their GPU work). GPU compute time is measured with CUDA events recorded
around each unit's kernels (after the stream has waited for its inputs, so copy stalls are not
counted as compute) and folded in lazily, once the events have completed: no synchronization is
added to the schedule.
"""
from __future__ import annotations

import threading
import time
from collections import defaultdict

import torch

__all__ = ["StepStats", "MainClock"]


class StepStats:
    """Cumulative counters behind `model.slide_stats()`."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.bytes = defaultdict(int)          # h2d, d2h, act_d2h, act_h2d
        self.wait_s = defaultdict(float)       # main thread blocked on the CPU worker, by reason
        self.steps = 0
        self.tokens = 0
        self.forward_s = 0.0
        self.backward_s = 0.0
        self.adam_s = 0.0
        self.gpu_adam_params = 0               # parameters updated on the GPU (resident layers)
        self.updated_params = 0
        self.gpu_compute_s = 0.0
        self._pending: list[tuple] = []        # (start, end, thread, label): GPU spans not yet folded
        self._t_step = None
        self.step_wall_s = 0.0
        self.worker_wait_s = 0.0               # the worker blocked on GPU copies / readers
        self.trace: list | None = None         # (thread, label, t0, t1) when tracing
        self._ref = None                       # (host time, CUDA event) that maps GPU spans to host time

    def start_trace(self) -> None:
        """Record a timeline of worker tasks, waits and GPU compute spans from now on."""
        self.fold(block=True)
        self.trace = []
        if self.cuda:
            torch.cuda.synchronize()
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            ev.synchronize()
            self._ref = (time.perf_counter(), ev)

    def stop_trace(self) -> list:
        """Stop tracing; the events (thread, label, t0, t1) sorted by start, times in seconds."""
        self.fold(block=True)
        out, self.trace, self._ref = sorted(self.trace or [], key=lambda e: e[2]), None, None
        return out

    def event(self, label: str, t0: float, t1: float | None = None) -> None:
        """Record a timed span (or a mark, t1=None) when tracing is on."""
        if self.trace is not None:
            self.trace.append((threading.current_thread().name, label, t0, t0 if t1 is None else t1))

    def add_bytes(self, kind: str, nbytes: int) -> None:
        self.bytes[kind] += nbytes

    def add_h2d(self, nbytes: int) -> None:
        self.bytes["h2d"] += nbytes

    @property
    def tracing_gpu(self) -> bool:
        """Is a step trace recorded, with GPU spans to time?"""
        return self.cuda and self.trace is not None

    def gpu_span(self, start, end) -> None:
        """A span of compute (two timing events on the compute stream): counted, and traced."""
        if self.cuda:
            self._queue((start, end, "gpu", "compute"))

    def copy_span(self, start, end, label: str) -> None:
        """A span of copies on a copy stream (`Streams.copy_span_start`): traced under "copy" only."""
        if self.tracing_gpu:
            self._queue((start, end, "copy", label))

    def _queue(self, span: tuple) -> None:
        self._pending.append(span)
        if len(self._pending) > 4096:
            self.fold(block=True)

    def fold(self, block: bool = False) -> None:
        """Add the elapsed time of completed compute spans; trace the completed spans."""
        keep = []
        for span in self._pending:
            start, end, thread, label = span
            if block:
                end.synchronize()
            if end.query():
                if thread == "gpu":
                    self.gpu_compute_s += start.elapsed_time(end) / 1000.0
                if self.trace is not None and self._ref is not None:
                    t_ref, ref = self._ref
                    self.trace.append((thread, label, t_ref + ref.elapsed_time(start) / 1000.0,
                                       t_ref + ref.elapsed_time(end) / 1000.0))
            else:
                keep.append(span)
        self._pending = keep

    def mark_step(self) -> None:
        now = time.perf_counter()
        if self._t_step is not None:
            self.step_wall_s += now - self._t_step
        self._t_step = now
        self.steps += 1
        self.event("step", now)

    def snapshot(self, worker_busy_s: float) -> dict:
        self.fold(block=True)
        out = {
            "steps": self.steps,
            "tokens": self.tokens,
            "h2d_bytes": self.bytes["h2d"],
            "d2h_bytes": self.bytes["d2h"],
            "activation_bytes": self.bytes["act_d2h"] + self.bytes["act_h2d"],
            "forward_s": self.forward_s,
            "backward_s": self.backward_s,
            "gpu_compute_s": self.gpu_compute_s,
            "cpu_adam_s": self.adam_s,
            "updated_params": self.updated_params,
            "gpu_updated_params": self.gpu_adam_params,
            "worker_busy_s": worker_busy_s,
            "worker_wait_s": self.worker_wait_s,
            "wait_update_s": self.wait_s["update"],
            "wait_grad_buffer_s": self.wait_s["grad_buffer"],
            "wait_other_s": sum(v for k, v in self.wait_s.items() if k not in ("update", "grad_buffer")),
            # Wall time between optimizer steps (the first step has no start mark), and what follows.
            "step_wall_s": self.step_wall_s,
        }
        if self.step_wall_s > 0 and self.steps > 1:
            out["tokens_per_s"] = self.tokens * (self.steps - 1) / self.steps / self.step_wall_s
            if self.cuda:
                out["gpu_busy"] = min(1.0, self.gpu_compute_s * (self.steps - 1) / self.steps / self.step_wall_s)
        if self.cuda:
            dev = torch.cuda.current_device()
            out["gpu_peak_allocated_bytes"] = torch.cuda.max_memory_allocated(dev)
            out["gpu_peak_reserved_bytes"] = torch.cuda.max_memory_reserved(dev)
        try:
            with open("/proc/self/status") as status:
                for line in status:
                    if line.startswith("VmHWM:"):
                        out["host_peak_rss_bytes"] = int(line.split()[1]) * 1024
                    elif line.startswith("VmRSS:"):
                        out["host_rss_bytes"] = int(line.split()[1]) * 1024
        except OSError:
            pass
        return out


class MainClock:
    """The main thread's waits on the CPU worker and its GPU compute spans, timed into `StepStats`:
    the one service every part of the schedule blocks and times through.

    Args:
        stats: the counters the waits and spans go to.
        streams: the engine's `Streams` (spans are recorded on the compute stream).
        worker: the `CpuWorker` waited on (its failures are re-raised by every wait).
    """

    def __init__(self, stats: StepStats, streams, worker):
        self.stats, self.streams, self.worker = stats, streams, worker

    def wait(self, event: threading.Event, reason: str, detail: str = "") -> None:
        """Block until `event` is set by the worker; timed under `reason` (the trace's event also names
        `detail`: which buffer, for whom), worker failures re-raised."""
        if event.is_set():
            self.worker.raise_if_failed()
            return
        t0 = time.perf_counter()
        self.worker.wait(event)
        t1 = time.perf_counter()
        self.stats.wait_s[reason] += t1 - t0
        self.stats.event(f"main_wait:{reason}{detail}", t0, t1)

    def wait_master(self, unit, start: int) -> int:
        """Block until element `start` of `unit.master` holds the update in progress (the worker
        reports finished prefixes, see `Unit.set_progress`); returns how many leading elements are
        final (`unit.numel` once the update is complete). Worker failures re-raised."""
        if unit.updated.is_set():
            self.worker.raise_if_failed()
            return unit.numel
        t0 = time.perf_counter()
        with unit.progress_cv:
            while not unit.updated.is_set() and unit.progress <= start:
                unit.progress_cv.wait(0.05)
                self.worker.check_alive()
            ready = unit.numel if unit.updated.is_set() else unit.progress
        t1 = time.perf_counter()
        self.stats.wait_s["update"] += t1 - t0
        self.stats.event("main_wait:update", t0, t1)
        self.worker.raise_if_failed()
        return ready

    def span_start(self):
        """Mark the start of GPU compute to be timed (None without CUDA); pass it to `span_end`."""
        return self.streams.timing_event()

    def span_end(self, start) -> None:
        """Close the span opened by `span_start`: its elapsed time joins `gpu_compute_s` once done."""
        if start is not None:
            self.stats.gpu_span(start, self.streams.record(timing=True))
