"""Late updates: updates held for the end of a backward and run during the next forward.

Note: [Why the top layers are updated late] with updates in backward, a layer's AdamW on the CPU
worker takes about as long as its backward on the GPU (benchmarks/NOTEBOOK.md, "Small GPUs: what the
worker does..."), so the worker never makes up what it meets at the front of the backward: with
the embedding on the host, the embedding's whole-table update (embedding.py: [Why the embedding
is updated in two parts]), which must follow the head's verdict. The ring then fills, the GPU
waits for it, and the backward ends with the worker still behind, on layers 1, 0 and the
embedding, which the next forward needs first. Yet the top layers' updates are needed only at
the end of the next forward, and during the forward the worker is idle. So the gradients of the
first k host layers of a backward (about the embedding's size in layers) land in buffers of their
own and their updates are held, and queued when the backward ends, after the embedding's, in
forward order: the worker keeps pace with the GPU from the start, and the next forward waits for
layer 0 and the embedding only. Their norms still join the running norm in backward order, so a
non-finite gradient is judged at the next layer's update, before any later one, and the held
updates then skip too. An untied head's update is held the same way, last (head.py: [Why an
untied head is updated when the backward ends]).

Note: [Why layer 0 is updated after the embedding's rows] the next forward needs the embedding's
rows first (they are gathered on the host and copied in), then layer 0. Layer 0's gradient
arrives just before the embedding's, so in backward order the worker would run layer 0's AdamW,
then the rows, and the forward's gather would start only after both. Held like a late layer (from
its ring buffer), layer 0 is updated after the rows, while the main thread gathers the batch and
copies it in: the gather and copy leave the path to the first layer's compute.
"""
import threading

import torch

__all__ = ["LateUpdates"]


class LateUpdates:
    """The updates held for the end of the current backward, and the late layers' pinned gradient buffers.

    Args:
        engine: the SlideEngine.
        size: elements per buffer (the largest layer).
    """

    def __init__(self, engine, size: int):
        self.engine, self.size = engine, size
        self.buffers: list[torch.Tensor] = []
        self.free: list[threading.Event] = []
        self.count = 0                 # how many layers this backward updates late
        self.claimed = 0               # ... of which so far
        self.pending: list[tuple] = []

    def begin(self, count: int) -> None:
        """Main thread, at the start of a backward that updates `count` layers late
        (`BackwardPlan.late_layers`)."""
        self.pending = []
        self.claimed = 0
        self.count = count

    def claim(self) -> int | None:
        """Main thread: the index of a buffer (`buffers`, freed by `free[index]`) for the next layer's
        gradient if that layer is updated late, else None."""
        index = self.claimed
        if index >= self.count:
            return None
        if index == len(self.buffers):
            engine = self.engine
            self.buffers.append(engine.pinned.empty(self.size, dtype=engine.grad_ring.dtype))
            self.free.append(threading.Event())
            self.free[-1].set()
        self.engine.clock.wait(self.free[index], "grad_buffer")
        self.free[index].clear()
        self.claimed += 1
        return index

    def hold(self, order: int, task, args: tuple, done: tuple) -> None:
        """Main thread: queue `task` when the backward ends, by `order` (a layer's index; the head
        after every layer); `done` are the events it sets, as for `CpuWorker.submit`."""
        self.pending.append((order, task, args, done))

    def finish(self) -> None:
        """Main thread, when the backward ends: queue the held updates in forward order."""
        pending, self.pending = self.pending, []
        for _, task, args, done in sorted(pending, key=lambda p: p[0]):
            self.engine.worker.submit(task, *args, done=done)

    def drop(self) -> None:
        """An interrupted backward (the worker joined): the held updates will not run; their
        buffers and every event they would have set are released, so that nothing waits forever."""
        for ev in self.free:
            ev.set()
        for *_, done in self.pending:
            for ev in done:
                ev.set()
        self.pending = []
