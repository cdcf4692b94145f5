"""Late layer updates: the first layers of a backward updated during the next forward.

Note: [Why the top layers are updated late] with updates in backward and the embedding on the
host, the worker starts the backward with the embedding's whole-table update (embedding.py: [Why
the embedding is updated in two parts]), which must follow the head's verdict: at 8B, 525 M
parameters, about 190 ms, while the GPU's backward of the top layers runs on. A layer's AdamW
takes about as long as its backward on the GPU (63-66 ms at 8B, 12 GiB), so the worker never
catches that up: the ring fills, the GPU waits for it, and the backward ends with the worker
still four layers behind, on layers 3 .. 0 and the embedding, which the next forward needs
first. Yet the top layers' updates are needed only at the end of the next forward, and during
the forward the worker is idle. So the gradients of the first k host layers of a backward
(about the embedding's size in layers) land in buffers of their own and their updates are
queued when the backward ends, after the embedding's, in forward order: the worker keeps pace
with the GPU from the start, and the next forward waits for layer 0 and the embedding only.
Their norms still join the running norm in backward order, so a non-finite gradient is judged
at the next layer's update, before any later one, and the late updates then skip too.
"""
from __future__ import annotations

import math
import threading

import torch

__all__ = ["LateUpdates"]


class LateUpdates:
    """The late layers of the current backward and their pinned gradient buffers.

    Args:
        engine: the SlideEngine.
        size: elements per buffer (the largest layer).
    """

    def __init__(self, engine, size: int):
        self.engine, self.size = engine, size
        self.buffers: list[torch.Tensor] = []
        self.free: list[threading.Event] = []
        self.count = 0                 # how many layers this backward updates late
        self.pending: list[tuple] = []

    def plan(self) -> int:
        """How many layers the backward starting now updates late (`SlideConfig.late_layer_updates`):
        "auto", enough to cover the embedding's whole-table update at the worker's front, when there is one."""
        e = self.engine
        emb = e.embedding
        want = e.config.late_layer_updates
        if (want == 0 or not e.mode.updates or not e.single_micro or e.config.max_grad_norm is not None or e.dp is not None
                or emb.resident is not None or not e.embed_unit.trainable
                or any(e.store.on_disk(u) for u in e.layer_units)):   # disk-bound steps: no gain to pay memory for
            return 0
        return math.ceil(e.embed_unit.numel / self.size) if want == "auto" else int(want)

    def begin(self) -> None:
        """Main thread, at the start of a backward."""
        self.pending = []
        self.count = self.plan()

    def claim(self) -> torch.Tensor | None:
        """Main thread: a buffer for the next layer's gradient if it is updated late, else None."""
        j = len(self.pending)
        if j >= self.count:
            return None
        if j == len(self.buffers):
            e = self.engine
            self.buffers.append(e.pinned.empty(self.size, dtype=e.grads.dtype))
            self.free.append(threading.Event())
            self.free[-1].set()
        self.engine._wait(self.free[j], "grad_buffer")
        self.free[j].clear()
        return self.buffers[j]

    def hold(self, layer_no: int, task, args: tuple, done: tuple) -> None:
        """Main thread: queue this layer's task for the end of the backward (its buffer is the last claimed)."""
        j = len(self.pending)
        self.pending.append((layer_no, task, args, (self.free[j],) + done))

    def finish(self) -> None:
        """Main thread, when the backward ends: queue the late updates in forward order."""
        pending, self.pending = self.pending, []
        for _, task, args, done in sorted(pending, key=lambda p: p[0]):
            self.engine.worker.submit(task, *args, done=done)

    def drop(self) -> None:
        """An interrupted backward: the held updates will not run; their buffers are free again."""
        for ev in self.free:           # the worker has been joined: none is being read
            ev.set()
        self.pending = []

    @property
    def host_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers)
