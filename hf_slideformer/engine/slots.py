"""GPU slot queue: preallocated flat buffers, each holding the weights of one unit, reused.

A slot is filled from the host masters on the h2d stream (fp32 over PCIe, cast to the compute
dtype on the GPU: the CPU never converts), and read by the compute stream. Slots are keyed by
(unit, version): a slot still holding the current version of a unit is reused without a copy,
which is how the last layers of the forward serve the start of the backward.
"""
from __future__ import annotations

import logging

import torch

from ..host.memory import COPY_CHUNK
from ..host.store import Unit
from .staging import staged_copy
from .transfer import Streams

logger = logging.getLogger(__name__)

__all__ = ["Slot", "SlotQueue", "staged_copy"]


class Slot:
    """One preallocated device buffer and what it holds."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device):
        self.flat = torch.empty(numel, dtype=dtype, device=device)
        self.key: tuple | None = None            # ((unit, version), ...) currently held
        self.units: tuple[Unit, ...] = ()
        self.ready = None                         # h2d event: weights are in
        self.free = None                          # compute event: last read issued so far
        self.last_use = 0
        self.fills = 0                            # completed fills (layer_matmuls.py: [Why FP8 weights are cached by the slot's fill])

    def views(self, unit: Unit) -> list[torch.Tensor]:
        base = 0
        for held in self.units:
            if held is unit:
                return [self.flat[base + e.offset: base + e.offset + e.numel].view(e.shape) for e in held.entries]
            base += held.numel
        raise KeyError(unit.name)


class SlotQueue:
    """A fixed set of device slots for units of at most `numel` parameters.

    Args:
        n: number of slots (the window).
        numel: capacity of each slot, in elements.
        dtype: compute dtype of the slots.
        streams: the engine's streams.
        staging: optional device fp32 buffer of at least `numel` for the on-GPU cast.
        bytes_counter: callable(nbytes) accounting h2d traffic.
        waiter: callable(unit, start) -> n that blocks until element `start` of the unit's master
            holds its pending update and returns how many leading elements do (worker failures
            re-raised); default: wait for the whole update.
        filler: callable(unit, dst) -> an iterator that fills `dst` (the unit's part of the slot)
            one step at a time, or None to copy the master: a unit whose pending update runs on
            the device as it is copied in (see `device_update.py`).
    """

    def __init__(self, count: int, numel: int, dtype: torch.dtype, streams: Streams, staging=None, bytes_counter=None,
                 waiter=None, filler=None):
        self.streams = streams
        self.dtype = dtype
        self.slots = [Slot(numel, dtype, streams.device) for _ in range(count)]
        self.staging = staging
        self.clock = 0
        self.count = bytes_counter or (lambda n: None)
        self.chunk = COPY_CHUNK                 # elements per step of load_steps without a staging buffer
        self.wait_host = waiter or _wait_updated
        self.filler = filler

    @staticmethod
    def key_of(units: tuple[Unit, ...]) -> tuple:
        return tuple((u.name, u.version) for u in units)

    def find(self, units: tuple[Unit, ...]) -> Slot | None:
        key = self.key_of(units)
        for slot in self.slots:
            if slot.key == key:
                return slot
        return None

    def load(self, units: tuple[Unit, ...], busy: tuple[Slot, ...] = ()) -> Slot:
        """Issue the h2d copy of `units` into a slot (the least recently used one not in `busy`)."""
        for _ in self.load_steps(units, busy):
            pass
        return self.find(units)

    def load_steps(self, units: tuple[Unit, ...], busy: tuple[Slot, ...] = ()):
        """`load` one chunk at a time: a generator that issues one chunk of the h2d copy per step.

        The slot holds `units` (and `find` / `acquire` see it) once the generator is exhausted;
        one dropped half way leaves its slot empty, and the next load starts it over. This lets a
        large unit's copy fill the h2d stream's idle time between several layers' copies instead
        of arriving in one block when it is needed.
        """
        if self.find(units) is not None:
            return
        candidates = [s for s in self.slots if all(s is not b for b in busy)]
        if not candidates:
            raise RuntimeError("no free slot: the window is too small for this schedule")
        slot = min(candidates, key=lambda s: s.last_use)
        st = self.streams
        # Note: [Why the slot waits for the compute event] the h2d stream may overwrite a slot only
        # after every kernel that reads its previous contents has run: wait for its `free` event.
        st.wait(slot.free, st.h2d)
        span = st.copy_span_start(st.h2d)
        slot.key, slot.units = None, ()
        base = 0
        cast = self.staging is not None and self.dtype != torch.float32
        cap = min(self.chunk, self.staging.numel()) if self.staging is not None else self.chunk
        for unit in units:
            dst = slot.flat[base:base + unit.numel]
            fill = self.filler(unit, dst) if self.filler is not None else None
            if fill is not None:
                yield from fill
                base += unit.numel
                continue
            # The host store's copy of a device update lands on the d2h stream (see device_update.py).
            st.wait(unit.host_write, st.h2d)
            for start in range(0, unit.numel, cap):
                end = min(start + cap, unit.numel)
                lo = start
                while lo < end:
                    # Note: [Why the copy waits for the update] the master must hold the finished
                    # update of the previous step before it is read: block until the CPU worker
                    # has finished element `lo` (it reports finished prefixes), copy what is final.
                    hi = min(end, self.wait_host(unit, lo))
                    with st.on(st.h2d):        # entered per copy: never held across a yield
                        if cast and unit.master.dtype != self.dtype:     # fp32 -> compute dtype on the GPU
                            staged_copy(dst[lo:hi], unit.master[lo:hi], self.staging)
                        else:
                            dst[lo:hi].copy_(unit.master[lo:hi], non_blocking=True)
                    lo = hi
                yield
            self.count(unit.numel * unit.master.element_size())
            base += unit.numel
        slot.ready = st.record(st.h2d)
        st.copy_span_end(span, st.h2d, "fill:" + "+".join(u.name for u in units))
        for unit in units:
            unit.add_reader(slot.ready)          # every copy is on the one h2d stream
        slot.key, slot.units = self.key_of(units), units
        slot.fills += 1
        self.clock += 1
        slot.last_use = self.clock

    def acquire(self, units: tuple[Unit, ...], busy: tuple[Slot, ...] = ()) -> Slot:
        """A slot holding `units`, ready for the compute stream."""
        slot = self.load(units, busy)
        self.streams.wait(slot.ready)
        self.clock += 1
        slot.last_use = self.clock
        return slot

    def release(self, slot: Slot) -> None:
        """Mark the compute work issued so far as the slot's last reader."""
        slot.free = self.streams.record()


def _wait_updated(unit: Unit, start: int) -> int:
    unit.updated.wait()
    return unit.numel
