"""The CPU worker: one thread that runs the host side of the schedule (gradient accumulation,
AdamW updates) in submission order, overlapping the main thread's GPU work.

torch's CPU kernels release the GIL, so the fused AdamW of this thread runs on all cores while
the main thread keeps issuing GPU work. An exception in the worker is kept and re-raised in the
caller at the next wait or submit, with the worker's traceback; events the failed task should
have set are set anyway, so no one waits forever.
"""
from __future__ import annotations

import atexit
import logging
import weakref
import queue
import threading
import time
import traceback

import torch

from ..errors import NonFiniteGradientError

logger = logging.getLogger(__name__)

__all__ = ["CpuWorker", "WorkerError"]


_LIVE: "weakref.WeakSet[CpuWorker]" = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    # Note: [Why workers stop at exit] a daemon thread still inside a torch CPU kernel while the
    # interpreter tears down can abort the process: "terminate called without an active
    # exception" was seen on the GPU at the exit of a script whose last (clipping) step left
    # deferred updates queued; this is our reading of it, not reproduced on the CPU. Pending tasks are
    # dropped (the process is ending) and the running one is waited for.
    for worker in list(_LIVE):
        worker.close()


class WorkerError(RuntimeError):
    """A task of the CPU worker failed; the message carries its traceback."""


class CpuWorker:
    """Host tasks run by one daemon thread, in submission order.

    (Running the updates still pending at the end of a backward in the order the next forward
    needs them measured no faster on the H200 than arrival order: docs/benchmarks.md.)
    """

    def __init__(self, threads: int, name: str = "slide-cpu-worker"):
        self.threads = threads
        self._q: queue.Queue = queue.Queue()
        self._error: tuple[BaseException, str] | None = None
        self._pending = 0
        self._cv = threading.Condition()
        self.busy_s = 0.0
        self.on_task = None          # callable(label, t0, t1): a tracing hook
        self._closing = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()
        _LIVE.add(self)

    def _loop(self):
        torch.set_num_threads(self.threads)
        while True:
            item = self._q.get()
            if item is None:
                return
            fn, args, done_events = item
            t0 = time.perf_counter()
            try:
                if self._error is None and not self._closing:
                    fn(*args)
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller
                self._error = (e, traceback.format_exc())
                logger.error("CPU worker task failed: %s", e)
            finally:
                t1 = time.perf_counter()
                self.busy_s += t1 - t0
                if self.on_task is not None:
                    self.on_task(getattr(fn, "__name__", "task"), t0, t1)
                for ev in done_events:
                    ev.set()
                with self._cv:
                    self._pending -= 1
                    self._cv.notify_all()

    def raise_if_failed(self) -> None:
        if self._error is not None:
            error, tb = self._error
            if isinstance(error, NonFiniteGradientError):        # a training error, not a fault: its own type
                raise NonFiniteGradientError(f"{error}\n--- worker traceback ---\n{tb}") from error
            raise WorkerError(f"the CPU worker failed: {error!r}\n--- worker traceback ---\n{tb}") from error

    def submit(self, fn, *args, done: tuple[threading.Event, ...] = ()) -> None:
        """Run fn(*args) on the worker after every task submitted before; set each event in `done`
        when it ends (even on failure)."""
        self.raise_if_failed()
        if not self._thread.is_alive():
            raise WorkerError("the CPU worker thread is not running (was the engine closed?)")
        with self._cv:
            self._pending += 1
        self._q.put((fn, args, done))

    def wait(self, event: threading.Event) -> None:
        """Block until `event` is set, re-raising a worker failure instead of hanging."""
        while not event.wait(0.05):
            self.check_alive()
        self.raise_if_failed()

    def check_alive(self) -> None:
        """Raise if the worker failed or its thread is gone (for callers polling a condition)."""
        self.raise_if_failed()
        if not self._thread.is_alive():
            raise WorkerError("the CPU worker thread died")

    def join(self) -> None:
        """Wait until every submitted task has run; re-raise a failure."""
        with self._cv:
            while self._pending:
                self._cv.wait(0.05)
                if self._error is not None:
                    break
        self.raise_if_failed()

    def close(self) -> None:
        """Stop the thread: the task running finishes, the pending ones are dropped (their events set)."""
        self._closing = True
        if self._thread.is_alive():
            self._q.put(None)            # after the pending tasks, which closing skips
            self._thread.join(timeout=30)
