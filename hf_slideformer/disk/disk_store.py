"""Decoder layers whose state lives on disk: which ones and which part, and their residency in a few pinned buffers.

A model larger than host memory keeps part of its last decoder layers' state in one preallocated
`disk.UnitStateFile` under `nvme_path`, as much as `SlideConfig.host_memory_limit` leaves out of
host memory, in two tiers (`disk_plan.split_layers`): first the AdamW moments alone of the last
layers (the master stays in host memory), and only when the moments of every trainable layer are
on disk and the host's part still does not fit, the whole state (master and moments) of the last
of them. A `disk_record.StateRecord` says which arrays a unit's record holds, in the dtypes of
the unit's optimizer state format (fp32 moments, or 8-bit ones with their block scales; an fp32
or bf16 master). `DiskStates` owns the file and a `disk.HostBufferPool` of a few buffers, each the
size of the largest record. A unit is *resident* while its record is in a buffer: the arrays the
record holds (`exp_avg` and `exp_avg_sq`, and `master` for the whole state) are then views of
that buffer, as a host unit's are views of the host store; otherwise they are None. A unit with
only its moments on disk keeps its master in the host store at all times.

`disk_record.record_bytes` and `pool_buffers` are the arithmetic of the records; which layers and which part go
to disk is `disk_plan.py`'s, whose functions the planner shares, so the engine and the plan cannot
drift apart.

Note: [Why a disk unit's state is in one place at a time] while a unit is resident, its buffer
holds the arrays of its record; otherwise the file's current generation does. A buffer leaves
its unit (eviction) only when nobody holds the unit (`pin` / `unpin`), its last write has
completed, so the file holds what the buffer holds, and, when the record holds the master,
every device copy that read the master from the buffer has completed (the unit's `readers`
events). A read is issued only for a unit that is not resident, and the file runs a unit's
operations in the order they were asked for, so a read returns the last write. Whoever reads or
changes the arrays of a record holds a pin: a slot copy of a whole-state unit (`DiskLayer`, for
a forward or a recompute), an update on the CPU worker, a checkpoint (`access`). An update waits
for the unit's previous write before it changes the buffer, and queues the next write after it.
A copy and an update of the same unit read and write one master (the buffer's, or for a
moments-only unit the host store's, which a slot copy reads as a host layer's and without a
pin), so the copy's wait for the update's finished prefix (`Unit.set_progress`) and the update's
wait for copies of the old master (`Unit.readers`) are the host store's, unchanged.

Note: [Why a copy reads the master alone] a slot copy needs a whole-state layer's master and
nothing else, so a pin or a read-ahead for a copy reads the first array of the record (its
master: 4 of 12 bytes per parameter under 'adamw', 2 of 4.03 under 'adamw_8bit_bf16') and marks
the residency partial; a pin or read-ahead for an update or a checkpoint reads the rest into the
same buffer first (the unit's operations run in order, so
both reads see one generation: a partial residency never has a write pending, since a write
follows an update, which needs the whole record). A partial residency is evicted like any other:
nothing of it is newer than the file. A write of a partial one would write moments never read,
and is refused.

Note: [Why a record read is checked] a record's header has a CRC, its payload none: a damaged
block scale of a compact format would turn a block of moments into NaNs or garbage at the next
update, silently. So once a record's moments have been read in, the values its format cannot
hold are looked for (`StateFormat.check`: a scale that is not a finite absmax >= 0), before
anyone uses them; a bad one raises `CorruptOptimizerStateError`, naming the unit and the array.
The scales are one value per 256 parameters, so the check costs little; fp32 AdamW has none.

Note: [Why pinning cannot deadlock] only a pin of a unit that is not resident waits, for a
buffer. The main thread holds at most one pin while it waits for the worker (a slot copy of a
whole-state unit waits for its unit's update; a moments-only unit's copy holds none); its other
pins belong to updates already queued, which the worker releases without waiting for the main
thread. The worker pins only for a deferred update (clipping, or a step that ends early), only
the unit it updates, and then holds no other pin; no update pin of the main thread is
outstanding then, since the next backward comes after a forward whose copies waited for every
layer's update. So with two buffers the worker always finds one that is free or frees itself:
writes, reads and device copies complete without either thread. A single buffer serves a
single disk unit, which every pin shares.
"""
from __future__ import annotations

import contextlib
import os
import threading
import time
from typing import Sequence

import torch

from .buffers import HostBufferPool
from .names import engine_file, remove_leftovers
from .unit_state import UnitStateFile
from .disk_record import MOMENTS, WHOLE, StateRecord, record_bytes

# `Unit` in the annotations is `store.Unit`, which imports this module (annotations are not evaluated).

__all__ = ["DiskStates", "StateRecord", "MOMENTS", "WHOLE", "STATE_BUFFERS", "record_bytes", "pool_buffers"]

# Buffers of the pool: one read ahead, one for the copy or update in progress, one written
# behind, one spare (fewer when fewer layers are on disk).
STATE_BUFFERS = 4
_POLL_S = 0.005            # how often a wait for a buffer looks at device copies again

def pool_buffers(n_disk: int) -> int:
    """Buffers of the pool for `n_disk` layers on disk."""
    return min(n_disk, STATE_BUFFERS)


class _Residency:
    """One resident unit: its buffer, its reads and last write, who holds it, when last used, and
    whether all of its record is in the buffer or only the master (`whole`: [Why a copy reads
    the master alone])."""

    __slots__ = ("buf", "reads", "write", "pins", "used", "whole", "checked")

    def __init__(self, buf, read, whole: bool):
        self.buf, self.reads, self.write, self.pins, self.used, self.whole = buf, [read] if read else [], None, 0, 0, whole
        self.checked = read is None or not whole     # [Why a record read is checked]: nothing read to check yet

    def reading(self) -> bool:
        return any(not f.done() for f in self.reads)


class DiskStates:
    """The records of the layers on disk (their moments, or their whole state): one preallocated
    file, a pool of pinned buffers, and which units are resident in them (the module's Notes).

    Args:
        units: the layer units on disk, in schedule order (consecutive layers).
        parts: each unit's part on disk, MOMENTS or WHOLE (default: WHOLE for every unit).
        directory: where the state file goes (created if missing); its name is removed at once,
            so its space comes back when it is closed, or when the process ends however it ends.
        buffers: buffers of the pool (default `pool_buffers(len(units))`).
        pin: page-lock the buffers (the slot copies read them by DMA).
        backend: the file backend (default `disk.make_backend("auto")`).

    Raises:
        DiskSpaceError: the disk cannot hold the file (reported before anything trains).
    """

    def __init__(self, units: Sequence[Unit], directory: str, *, parts: Sequence[str] | None = None,
                 buffers: int | None = None, pin: bool = False, backend=None):
        self.units = list(units)
        self._index = {id(u): k for k, u in enumerate(self.units)}
        parts = [WHOLE] * len(self.units) if parts is None else list(parts)
        if len(parts) != len(self.units):
            raise ValueError(f"{len(parts)} parts for {len(self.units)} disk units")
        self.records = [StateRecord.of(u, p) for u, p in zip(self.units, parts)]
        os.makedirs(directory, exist_ok=True)
        remove_leftovers(directory)                 # what killed runs left (disk/names.py)
        path = engine_file(directory, "state")
        self.file = UnitStateFile(path, [r.layout for r in self.records], backend)
        try:
            self.pool = HostBufferPool(buffers or pool_buffers(len(self.units)), self.file.max_payload_bytes, pin=pin)
        except BaseException:
            self.file.close()
            raise
        self._res: dict[int, _Residency] = {}
        self._cond = threading.Condition()
        self._clock = 0
        self._failure: BaseException | None = None
        self.check = None           # callable that raises when a wait is pointless (the engine's worker failed)
        self.event = None           # callable(label, t0, t1): the engine's trace
        self.read_bytes = self.write_bytes = 0
        self.wait_s = 0.0

    # ------------------------------------------------------------------ queries
    def holds(self, unit: Unit) -> bool:
        """Is some of `unit`'s state on disk?"""
        return id(unit) in self._index

    def record(self, unit: Unit) -> StateRecord:
        """What `unit`'s record on disk holds."""
        return self.records[self._index[id(unit)]]

    def is_resident(self, unit: Unit) -> bool:
        with self._cond:
            return id(unit) in self._res

    def ahead(self, unit: Unit, step: int, count: int, masters: bool = False) -> list[Unit]:
        """The next `count` disk units after `unit` in schedule order (`step` 1) or backwards (-1); with
        `masters`, only those of them whose record holds the master (the ones a slot copy reads)."""
        index = self._index[id(unit)]
        near = [j for j in range(index + step, index + step * (count + 1), step) if 0 <= j < len(self.units)]
        return [self.units[j] for j in near if not masters or self.records[j].master]

    @property
    def read_ahead_count(self) -> int:
        return max(1, self.pool.count - 2)

    def stats(self) -> dict:
        return {"disk_layers": len(self.units), "disk_moment_layers": sum(not r.master for r in self.records),
                "disk_buffers": self.pool.count, "disk_read_bytes": self.read_bytes,
                "disk_write_bytes": self.write_bytes, "wait_disk_s": self.wait_s}

    # ------------------------------------------------------------------ residency (caller holds the lock)
    def _touch(self, residency: _Residency) -> None:
        self._clock += 1
        residency.used = self._clock

    def _evictable(self, uid: int, residency: _Residency) -> bool:
        if residency.pins or residency.reading():
            return False
        if residency.write is not None and (not residency.write.done() or residency.write.exception() is not None):
            return False                        # a failed write: the buffer is newer than the file
        index = self._index[uid]                # device copies read the buffer only where it holds the master
        return not self.records[index].master or all(ev.query() for ev in self.units[index].readers)

    def _take(self, keep=()):
        """A free buffer, evicting the least recently used unit nobody needs (not one in `keep`);
        None when there is none now."""
        if self.pool.free_count() == 0:
            idle = [(r.used, uid) for uid, r in self._res.items() if uid not in keep and self._evictable(uid, r)]
            if not idle:
                return None
            uid = min(idle)[1]
            index, residency = self._index[uid], self._res.pop(uid)
            self.records[index].detach(self.units[index])
            residency.buf.release()
        return self.pool.acquire_one()          # one is free: does not block

    def _load(self, unit: Unit, buf, whole: bool = True) -> _Residency:
        """Make `unit` resident in `buf`: its views set, its read issued (zeros if never written);
        without `whole`, the read of a record that holds the master covers the master alone."""
        index = self._index[id(unit)]
        self.records[index].attach(unit, buf)
        if self.file.generation(index) == 0:     # never written: the state of a fresh unit is zeros
            buf.tensor[:self.file.payload_bytes(index)].zero_()
            read, whole = None, True
        else:
            whole = whole or not self.records[index].master
            span = None if whole else (0, self.file.array_bytes(index))
            read = self.file.read(index, buf, span)
            self.read_bytes += self.file.payload_bytes(index) if whole else span[1]
        residency = _Residency(buf, read, whole)
        self._res[id(unit)] = residency
        return residency

    def _complete(self, unit: Unit, residency: _Residency) -> None:
        """A unit resident with its master alone: read the rest of its record into its buffer."""
        index = self._index[id(unit)]
        lo, hi = self.file.array_bytes(index), self.file.payload_bytes(index)
        residency.reads.append(self.file.read(index, residency.buf, (lo, hi)))
        residency.whole, residency.checked = True, False
        self.read_bytes += hi - lo

    def _raise_failure(self) -> None:
        if self._failure is not None:
            raise self._failure

    # ------------------------------------------------------------------ pins
    def pin(self, unit: Unit, whole: bool = True) -> None:
        """Hold `unit` resident (reading it in if it is not): blocks only for a buffer. Its views
        are valid once `ready(unit)` returns, until the matching `unpin`; without `whole`, only its
        master's (a slot copy: [Why a copy reads the master alone])."""
        t0 = None
        with self._cond:
            while True:
                self._raise_failure()
                residency = self._res.get(id(unit))
                if residency is not None:
                    if whole and not residency.whole:
                        self._complete(unit, residency)
                    break
                buf = self._take()
                if buf is not None:
                    residency = self._load(unit, buf, whole)
                    break
                if t0 is None:
                    t0 = time.perf_counter()
                if self.check is not None:
                    self.check()
                self._cond.wait(_POLL_S)         # an unpin or a finished write wakes it; device copies are polled
            residency.pins += 1
            self._touch(residency)
        if t0 is not None:
            self._waited(t0, f"wait_disk_buffer:{unit.name}")

    def unpin(self, unit: Unit) -> None:
        with self._cond:
            residency = self._res[id(unit)]
            residency.pins -= 1
            self._touch(residency)
            self._cond.notify_all()

    def ready(self, unit: Unit) -> None:
        """Wait until a pinned unit's state has been read in (raises the read's failure, and
        `CorruptOptimizerStateError` for values its format cannot hold: [Why a record read is checked])."""
        with self._cond:
            residency = self._res[id(unit)]
            reads = list(residency.reads)
        for fut in reads:
            if not fut.done():
                t0 = time.perf_counter()
                fut.exception()                 # waits
                self._waited(t0, f"wait_disk_read:{unit.name}")
            fut.result()
        if not residency.checked and residency.whole:
            self.record(unit).check(unit, f"{unit.name}'s record in {self.file.path}")
            residency.checked = True

    def before_update(self, unit: Unit) -> None:
        """Wait until the previous write of a pinned unit no longer reads its buffer."""
        with self._cond:
            fut = self._res[id(unit)].write
        if fut is not None and not fut.done():
            t0 = time.perf_counter()
            fut.exception()
            self._waited(t0, f"wait_disk_write:{unit.name}")
        if fut is not None:
            fut.result()

    def write_behind(self, unit: Unit):
        """Queue the write of a pinned unit's buffer as its next generation; returns its future."""
        with self._cond:
            residency = self._res[id(unit)]
            if not residency.whole:                     # its moments were never read: writing them would lose them
                raise RuntimeError(f"internal: a write of {unit.name}, resident with its master alone")
            index = self._index[id(unit)]
            residency.write = fut = self.file.write(index, residency.buf)
            self.write_bytes += self.file.payload_bytes(index)
        fut.add_done_callback(self._written)
        return fut

    def _written(self, fut) -> None:
        with self._cond:
            if fut.exception() is not None and self._failure is None:
                self._failure = fut.exception()
            self._cond.notify_all()

    def read_ahead(self, units: Sequence[Unit], whole: bool = True) -> None:
        """Start reading in those of `units` that are not resident, in order, as far as buffers
        are free or idle now (never waits; a unit read ahead stays evictable until pinned);
        without `whole`, the master alone of a record that holds it (for a slot copy)."""
        with self._cond:
            keep = {id(u) for u in units}
            started = []
            for unit in units:
                residency = self._res.get(id(unit))
                if residency is not None:
                    if whole and not residency.whole:
                        self._complete(unit, residency)
                    continue
                buf = self._take(keep)
                if buf is None:
                    break
                started.append(self._load(unit, buf, whole))
            for residency in reversed(started):          # the nearest is the most recently used
                self._touch(residency)

    @contextlib.contextmanager
    def access(self, unit: Unit, write: bool = False):
        """`unit` resident for a synchronous reader (state_dict, checkpoints): with `write`, its
        buffer is written back when the block ends and the write waited for (raising its
        failure). The engine must be idle (`SlideEngine.synchronize`)."""
        self.pin(unit)
        try:
            self.ready(unit)
            if write:
                self.before_update(unit)
        except BaseException:
            self.unpin(unit)
            raise
        fut = None
        try:
            yield unit
        finally:
            try:
                if write:                        # even after an error: the buffer is the state ([Why ...])
                    fut = self.write_behind(unit)
            finally:
                self.unpin(unit)
        if fut is not None:
            fut.result()

    # ------------------------------------------------------------------ the whole
    def flush(self) -> None:
        """Wait for every read and write asked for; raise the first failure."""
        self.file.flush()
        self._raise_failure()

    def close(self) -> None:
        """Wait for the I/O in flight, close the file (its space comes back) and unpin the pool."""
        with self._cond:
            for uid in self._res:
                index = self._index[uid]
                self.records[index].detach(self.units[index])
            self._res.clear()
        self.file.close()
        self.pool.close()

    def _waited(self, t0: float, label: str) -> None:
        t1 = time.perf_counter()
        self.wait_s += t1 - t0
        if self.event is not None:
            self.event(label, t0, t1)
