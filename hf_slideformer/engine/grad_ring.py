"""The gradient ring: the pinned host buffers a layer's gradients cross into, and the d2h copy.

Note: [Why gradients cross in the compute dtype] a layer's parameter gradients are computed in
the compute dtype (its weights' dtype), so widening them to fp32 on the GPU adds no information:
they cross PCIe and land in the ring as they are (bf16: half the bytes), and the host AdamW widens
them in registers (`HostAdam`), exactly.
"""
from __future__ import annotations

import threading

import torch

from ..host.memory import COPY_CHUNK

__all__ = ["GradientRing"]


class GradientRing:
    """`config.grad_buffers` pinned buffers of one layer's size, taken in turn by the layers'
    gradients and given back by the worker task that reads each (`free[k]`); the head's gradient
    borrows the first ones (head.py: [Why the head's gradient borrows the ring]).

    Args:
        engine: the SlideEngine (streams, stats, pinned memory, the running norm).
        size: elements per buffer (the largest layer).
        count: number of buffers.
        stage_numel: elements of the largest gradient that may be widened on the device.
    """

    def __init__(self, engine, size: int, count: int, stage_numel: int):
        self.engine = engine
        self.dtype = engine.dtype if engine.dtype == torch.bfloat16 else torch.float32
        self.size, self.count = size, count
        self._slab: torch.Tensor | None = None         # made when first used (a frozen model never sends one)
        self._buffers: list[torch.Tensor] = []
        self.free = [threading.Event() for _ in range(count)]
        for ev in self.free:
            ev.set()
        self.next = 0
        cast = engine.config.is_cuda and engine.dtype != torch.float32
        self.stage = (torch.empty(min(stage_numel, COPY_CHUNK), dtype=torch.float32, device=engine.device)
                      if cast else None)

    @property
    def slab(self) -> torch.Tensor:
        """The ring's pinned memory, one slab registered once (no power-of-two rounding of large pins)."""
        if self._slab is None:
            self._slab = self.engine.pinned.empty(self.size * self.count, dtype=self.dtype)
            self._buffers = list(self._slab.split(self.size))
        return self._slab

    @property
    def buffers(self) -> list[torch.Tensor]:
        self.slab
        return self._buffers

    def claim(self, index: int, holder: str = "") -> None:
        """Main thread: wait until buffer `index` is free, then hold it for `holder` (a unit's name, for
        the trace; its task's `done` frees it)."""
        self.engine.clock.wait(self.free[index], "grad_buffer", f".ring{index}:{holder}")
        self.free[index].clear()

    def claim_next(self, holder: str = "") -> int:
        """Main thread: hold the ring's next buffer for `holder` (waiting until it is free); its index."""
        index = self.next
        self.next = (index + 1) % len(self.buffers)
        self.claim(index, holder)
        return index

    # ------------------------------------------------------------- the head's loan (head.py)
    def borrow_front(self, numel: int) -> tuple[torch.Tensor, tuple[int, ...]] | None:
        """Main thread: hold the first buffers for a gradient of `numel` elements, when the ring is
        large enough; (the slab's first `numel` elements, the buffers held), or None.
        head.py: [Why the head's gradient borrows the ring]."""
        if numel > self.size * len(self.buffers):
            return None
        count = -(-numel // self.size)
        for index in range(count):
            self.claim(index, "head")
        self.next = count % len(self.buffers)     # the layers' next gradients take the buffers after it
        return self.slab[:numel], tuple(range(count))

    def give_back(self, held: tuple[int, ...]) -> None:
        """Free the ring buffers `held` at once."""
        for index in held:
            self.free[index].set()

    def returner(self, held: tuple[int, ...]):
        """A progress callback for a front-to-back reader of a gradient in the buffers `held` (in
        order): each goes back once the reader has passed its end."""
        pending = list(held)

        def returned(passed: int) -> None:
            while pending and (pending[0] + 1) * self.size <= passed:
                self.free[pending.pop(0)].set()
        return returned

    def d2h(self, grads: list, dsts: list[torch.Tensor], ends: list[int] | None = None, marks: list | None = None,
            norm_dst: torch.Tensor | None = None):
        """Copy device gradients into host buffers on the d2h stream: as they are where the buffer
        has their dtype, else widened to the buffer's fp32 on the device (never narrowed); the
        event after the last copy.

        With `ends` and `marks` (a list from `Streams.copy_marks`; None on the CPU), `marks`
        receives (ends[k], event) after the k-th gradient's copy: the worker can start on the front
        of a unit while the rest is in flight. `norm_dst` (a pinned scalar) receives the running
        squared norm first. The copies are the streams' (`Streams.gradients_to_host`).
        """
        engine = self.engine
        return engine.streams.gradients_to_host(grads, dsts, ends, marks, engine.norm.dev, norm_dst, self.stage,
                                                engine.stats)
