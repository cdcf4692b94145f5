"""The CPU worker: one thread that runs the host side of the schedule (gradient accumulation,
AdamW updates) in submission order, overlapping the main thread's GPU work.

torch's CPU kernels release the GIL, so the fused AdamW of this thread runs on all cores while
the main thread keeps issuing GPU work. An exception in the worker is kept and re-raised in the
caller at the next wait or submit, with the worker's traceback; events the failed task should
have set are set anyway, so no one waits forever.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
import traceback

import torch

logger = logging.getLogger(__name__)

__all__ = ["CpuWorker", "WorkerError"]


class WorkerError(RuntimeError):
    """A task of the CPU worker failed; the message carries its traceback."""


class CpuWorker:
    """A FIFO of host tasks run by one daemon thread."""

    def __init__(self, threads: int, name: str = "slide-cpu-worker"):
        self.threads = threads
        self._q: queue.Queue = queue.Queue()
        self._error: tuple[BaseException, str] | None = None
        self._pending = 0
        self._cv = threading.Condition()
        self.busy_s = 0.0
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self):
        torch.set_num_threads(self.threads)
        while True:
            item = self._q.get()
            if item is None:
                return
            fn, args, done_events = item
            t0 = time.perf_counter()
            try:
                if self._error is None:
                    fn(*args)
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller
                self._error = (e, traceback.format_exc())
                logger.error("CPU worker task failed: %s", e)
            finally:
                self.busy_s += time.perf_counter() - t0
                for ev in done_events:
                    ev.set()
                with self._cv:
                    self._pending -= 1
                    self._cv.notify_all()

    def raise_if_failed(self) -> None:
        if self._error is not None:
            e, tb = self._error
            raise WorkerError(f"the CPU worker failed: {e!r}\n--- worker traceback ---\n{tb}") from e

    def submit(self, fn, *args, done: tuple[threading.Event, ...] = ()) -> None:
        """Run fn(*args) on the worker; set each event in `done` when it ends (even on failure)."""
        self.raise_if_failed()
        if not self._thread.is_alive():
            raise WorkerError("the CPU worker thread is not running (was the engine closed?)")
        with self._cv:
            self._pending += 1
        self._q.put((fn, args, done))

    def wait(self, event: threading.Event) -> None:
        """Block until `event` is set, re-raising a worker failure instead of hanging."""
        while not event.wait(0.05):
            self.raise_if_failed()
            if not self._thread.is_alive():
                raise WorkerError("the CPU worker thread died")
        self.raise_if_failed()

    def join(self) -> None:
        """Wait until every submitted task has run; re-raise a failure."""
        with self._cv:
            while self._pending:
                self._cv.wait(0.05)
                if self._error is not None:
                    break
        self.raise_if_failed()

    def close(self) -> None:
        if self._thread.is_alive():
            self._q.put(None)
            self._thread.join(timeout=30)
