"""Units' optimizer state records (master and moments, in the dtypes their state format declares) in
one preallocated file, read and written on I/O threads while the caller computes.

Layout (every offset a multiple of 4096 bytes; little-endian; packing and checks in records.py):

    file header   magic, version, file id, unit count, each unit's layout, CRC-32     (rounded up to 4096)
    unit 0        slot 0: record header (4096) | array 0 | array 1 | ...
                  slot 1: record header (4096) | array 0 | array 1 | ...            (a kept file only)
    unit 1        ...

A unit's layout is its record's arrays, (dtype, count) each: a unit given as a numel has three
fp32 arrays of it (fp32 master, exp_avg, exp_avg_sq); a compact state format's record declares
others (`disk_record.StateRecord`). Each array starts on a 4096-byte boundary, so a record's
payload is the sum of its arrays' bytes, each rounded up to 4096: the buffer a read fills and a
write sends (`UnitStateFile.payload_bytes`). A record header holds (file id, unit, slot,
generation, a key of the layout) and a CRC-32 of them.

A file kept for a resume (`keep=True`) has two slots per unit; a file that lives only as long as
its process (the default: its name is removed at once) has one, half the space (see the Notes).

Note: [Why an interrupted write never reads as valid] a unit's generation g lives in one of its
two slots. A write of generation g + 1 goes to the other slot, in this order: the payload; then,
once every payload byte is written (and, with `durable`, flushed by fdatasync), the slot's
record header naming g + 1; with `durable`, that header is flushed too before the write counts
as done. A record is valid when its header's CRC matches and it names this file, this unit, this
slot and the unit's layout; the newest valid record wins. So a write cut short in its payload
leaves the target slot's header as it was (invalid, or the older generation g - 1), and one cut
short in its header leaves a header whose CRC fails or the old one: either way the other slot's
g wins. The slot holding g is not touched until g + 1 is complete in the other slot. In the
process, a unit's current slot changes only after its header write has returned, so a write
that failed leaves reads at g, and the next write goes to the same spare slot. After a power
loss this holds only with `durable=True` (without it the page cache may reach the disk header
first): the default for a file kept for resume.

Note: [Why a file not kept has one slot per unit] the second slot serves a reader after a crash
(`UnitStateFile.open`). A file that is not kept has no name from the start, so after a crash
nobody can open it, and within the process a unit's operations run one at a time (below): no
read overlaps the write that replaces the record. One slot is then enough, with one rule: a
write that fails may have overwritten part of the record, so the unit is marked torn before the
payload is written and unmarked only once its header is; a read of a torn unit raises (its state
is lost: resume from a checkpoint) instead of returning a record that mixes two generations.

Note: [Why a unit's operations run in the order they were asked for] a read that follows a write
of the same unit must see that write, and a write must not start in a slot that a read still
reads. Each operation waits for the one asked for before it on the same unit (its "tail"), and
the operations of different units overlap. The workers take operations first in, first out, so
the operation waited for was taken earlier: it is running or done, and never waits for a later
one; no worker count can deadlock.
"""
from __future__ import annotations

import concurrent.futures as cf
import errno
import os
import threading
import uuid
import weakref
from typing import Sequence

import torch

from .backends import DiskIOError, FileBackend, make_backend
from .buffers import ALIGN, HostBuffer, round_up
from .names import create_unlinked
from .records import (HEADER_BYTES, array_offsets, pack_file_header, pack_record, parse_file_header, parse_record,
                      payload_bytes, record_layout, unit_layout)
from .space import allocate, check_room, preallocate

__all__ = ["UnitState", "UnitStateFile", "UnitStateError", "record_layout"]


class UnitStateError(RuntimeError):
    """A unit's state cannot be read (never written, or lost to a failed write), or the file is
    not a state file."""


class UnitState(tuple):
    """A unit's state as read: its record's arrays (in its layout's dtypes), and `generation`."""

    generation: int

    def __new__(cls, arrays, generation: int):
        self = super().__new__(cls, arrays)
        self.generation = generation
        return self


def _host_bytes(data: bytes) -> torch.Tensor:
    header = torch.zeros(HEADER_BYTES, dtype=torch.uint8)
    header[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return header


def _close(handle, backend: FileBackend | None) -> None:
    """Close the file (and the backend it owns): the close, the finalizer and the exit path."""
    try:
        handle.close()
    finally:
        if backend is not None:
            backend.close()


class UnitStateFile:
    """N units' state records on disk, each of the arrays its layout names (the module's layout
    and invariants).

    The file is created at its full size up front (`preallocate`) and reused across steps. Unless
    `keep`, its name is removed as soon as it is open: the space comes back when the file is
    closed, when the object is collected or the interpreter exits (a finalizer), and also when
    the process is killed, since no name is left behind (df counts it while open, ls does not
    show it).

    Args:
        path: the file to create (its directory must exist); an existing file is overwritten.
        units: each unit's layout: a numel (three fp32 arrays of it: master, exp_avg, exp_avg_sq)
            or its record's arrays as (dtype, count) pairs (`records.unit_layout`).
        backend: the I/O backend (default `make_backend("auto")`, closed with this file).
        keep: leave the file in place at close, for `UnitStateFile.open` (a resume): two slots per
            unit; otherwise one (see the Notes).
        durable: flush each record to the disk before it counts (see the Note); default `keep`.
        workers: operations (of different units) that run at once.
    """

    def __init__(self, path: str, units: Sequence, backend: FileBackend | None = None, *,
                 keep: bool = False, durable: bool | None = None, workers: int = 4,
                 _file_id: int | None = None):
        self.path = os.path.abspath(path)
        self.layouts = [unit_layout(u) for u in units]
        self.keep = keep
        self.durable = keep if durable is None else durable
        self.slots = 2 if keep else 1
        self.header_bytes, self._offsets, self._slot_bytes = record_layout(self.layouts, self.slots)
        self.nbytes = self.header_bytes + self.slots * sum(self._slot_bytes)
        self._owns_backend = backend is None
        self.backend = backend or make_backend("auto")
        self._slot: list[int | None] = [None] * len(self.layouts)       # the slot holding the current generation
        self._gen = [0] * len(self.layouts)
        self._torn: set[int] = set()            # one slot: units whose write failed part-way
        self._lock = threading.Lock()
        self._tail: dict[int, cf.Future] = {}
        self._failures: list[BaseException] = []
        self._closed = False
        creating = _file_id is None
        self.file_id = uuid.uuid4().int & (2 ** 64 - 1) if creating else _file_id
        if creating and not keep:
            # Note: [Why the state file is sized after its name is gone] preallocating takes
            # seconds per GiB where the file system writes zeros; a kill then would leave a
            # full-size file that nobody can attribute. Created empty, opened and unlinked at once,
            # it is sized through the open handle: a kill at any point leaves no name (or, in the
            # instant before the unlink, an empty one that disk.names removes on the next run).
            check_room(self.path, self.nbytes)
            fd, self.handle = create_unlinked(self.path, self.backend.open)
            try:
                allocate(fd, self.path, self.nbytes)
            except BaseException:
                _close(self.handle, self.backend if self._owns_backend else None)
                raise
            finally:
                os.close(fd)
        else:
            if creating:
                preallocate(self.path, self.nbytes)
            self.handle = self.backend.open(self.path)
        self._finalizer = weakref.finalize(self, _close, self.handle, self.backend if self._owns_backend else None)
        self._workers = cf.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="slide-unit-io")
        if creating:
            self._write_file_header()

    # ------------------------------------------------------------------ layout
    def payload_bytes(self, unit: int) -> int:
        """Bytes of unit `unit`'s record payload: the flat buffer a read fills or a write sends."""
        return payload_bytes(self.layouts[unit])

    @property
    def max_payload_bytes(self) -> int:
        """The host buffer size that holds any unit's payload."""
        return max((self.payload_bytes(u) for u in range(len(self.layouts))), default=0)

    def slot_offset(self, unit: int, slot: int) -> int:
        """Where slot `slot` (0, or 1 in a kept file) of `unit` starts: its record header, then the payload."""
        return self._offsets[unit] + slot * self._slot_bytes[unit]

    def views(self, unit: int, buf) -> tuple[torch.Tensor, ...]:
        """The unit's arrays (in its layout's dtypes and counts: for a numel, the fp32 master,
        exp_avg and exp_avg_sq) inside a flat payload buffer (a tensor or a `HostBuffer`)."""
        if isinstance(buf, HostBuffer):
            buf = buf.tensor
        flat = buf.detach().reshape(-1).view(torch.uint8)
        if flat.numel() < self.payload_bytes(unit):
            raise ValueError(f"unit {unit} needs a buffer of {self.payload_bytes(unit)} bytes, got {flat.numel()}")
        lay = self.layouts[unit]
        return tuple(flat[o:o + d.itemsize * n].view(d) for (d, n), o in zip(lay, array_offsets(lay)))

    def generation(self, unit: int) -> int:
        """The generation of the unit's last completed write (0: none)."""
        with self._lock:
            return self._gen[unit]

    # ------------------------------------------------------------------ the file header
    def _write_file_header(self) -> None:
        data = pack_file_header(self.file_id, self.layouts)
        buf = torch.zeros(self.header_bytes, dtype=torch.uint8)
        buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        self.handle.pwrite(buf, self.header_bytes, 0).result()
        if self.durable:
            self.handle.sync()

    @classmethod
    def open(cls, path: str, backend: FileBackend | None = None, *, durable: bool = True,
             workers: int = 4) -> UnitStateFile:
        """Open a file kept by an earlier run: each unit at its newest valid record (see the Note);
        a unit with none reads as never written. The file stays in place at close."""
        with open(path, "rb") as handle:
            file_id, layouts = parse_file_header(handle, path, UnitStateError)
        self = cls(path, layouts, backend, keep=True, durable=durable, workers=workers, _file_id=file_id)
        raw = torch.zeros(HEADER_BYTES, dtype=torch.uint8)
        for unit, lay in enumerate(layouts):
            for slot in (0, 1):
                self.handle.pread(raw, HEADER_BYTES, self.slot_offset(unit, slot)).result()
                gen = parse_record(raw.numpy().tobytes(), file_id, unit, slot, lay)
                if gen > self._gen[unit]:
                    self._gen[unit], self._slot[unit] = gen, slot
        return self

    # ------------------------------------------------------------------ operations
    def _submit(self, unit: int, fn, *args) -> cf.Future:
        if not 0 <= unit < len(self.layouts):
            raise IndexError(f"unit {unit} out of range (the file holds {len(self.layouts)})")
        with self._lock:
            if self._closed:
                raise UnitStateError(f"{self.path}: the unit state file is closed")
            prev = self._tail.get(unit)
            fut = self._workers.submit(self._run, prev, fn, unit, *args)
            self._tail[unit] = fut
        return fut

    def _run(self, prev: cf.Future | None, fn, unit: int, *args):
        if prev is not None:
            cf.wait([prev])                         # done or failed: the order is what matters
        try:
            return fn(unit, *args)
        except BaseException as e:
            with self._lock:
                self._failures.append(e)
            raise

    def _arrays(self, unit: int, data) -> tuple[list[torch.Tensor], list[int]]:
        """The tensors of one request and their offsets inside the payload."""
        if isinstance(data, HostBuffer):
            data = data.tensor
        if isinstance(data, torch.Tensor):
            have = data.numel() * data.element_size()
            if not data.is_contiguous() or have < self.payload_bytes(unit):
                raise ValueError(f"unit {unit} needs a contiguous buffer of {self.payload_bytes(unit)} bytes, "
                                 f"got {have}{'' if data.is_contiguous() else ' (not contiguous)'}")
            return [data], [0]
        lay = self.layouts[unit]
        arrays = list(data)[:len(lay)]
        if len(arrays) != len(lay) or any((a.dtype, a.numel()) != x for a, x in zip(arrays, lay)):
            what = ", ".join(f"{n} {str(d).replace('torch.', '')}" for d, n in lay)
            raise ValueError(f"unit {unit} takes a flat buffer or {len(lay)} tensors ({what} values)")
        return arrays, array_offsets(lay)

    def read(self, unit: int, into, span: tuple[int, int] | None = None) -> cf.Future:
        """Read the unit's current generation into `into`: a flat buffer of at least
        `payload_bytes(unit)` bytes (a `HostBuffer` of a `HostBufferPool`, say) or its arrays as tensors (CPU or
        CUDA). Runs after every operation asked for earlier on this unit.

        Args:
            span: with a flat buffer, only the payload's bytes [lo, hi), into the same bytes of
                `into` (both multiples of 4096, or hi the payload's end): the master alone is
                `(0, array_bytes(unit))`, the moments after it the rest.

        Returns:
            A future of a `UnitState` (views into `into` for a flat buffer).
        """
        arrays, offs = self._arrays(unit, into)
        if span is not None:
            lo, hi = span
            end = self.payload_bytes(unit)
            if len(arrays) != 1 or not (0 <= lo < hi <= end) or lo % ALIGN or (hi % ALIGN and hi != end):
                raise ValueError(f"unit {unit}: a span is an aligned byte range of a flat buffer's payload "
                                 f"(0..{end}), got {span}")
            flat = arrays[0].detach().reshape(-1).view(torch.uint8)
            return self._submit(unit, self._read, arrays[0], [flat[lo:hi]], [lo])
        return self._submit(unit, self._read, arrays[0] if len(arrays) == 1 else None, arrays, offs)

    def array_bytes(self, unit: int) -> int:
        """Bytes of the unit's first array in a payload (rounded up to 4096): the span of a
        record's master, where it holds one."""
        dtype, count = self.layouts[unit][0]
        return round_up(dtype.itemsize * count)

    def write(self, unit: int, source) -> cf.Future:
        """Write `source` (as for `read`) as the unit's next generation. The future's result is
        that generation; on failure a kept file's unit stays at the one before, and another file's
        unit reads as lost (see the Notes)."""
        arrays, offs = self._arrays(unit, source)
        return self._submit(unit, self._write, arrays, offs)

    def _payload_sizes(self, unit: int, arrays) -> list[int]:
        if len(arrays) == 1:                        # a flat buffer (maybe larger), or one span of its payload
            return [min(arrays[0].numel() * arrays[0].element_size(), self.payload_bytes(unit))]
        return [d.itemsize * n for d, n in self.layouts[unit]]

    @staticmethod
    def _all(start, requests) -> None:
        """Start every request, then wait for each that started before raising the first failure
        (none may still use a buffer or a slot once this returns or raises)."""
        futures, first = [], None
        for args in requests:
            try:
                futures.append(start(*args))
            except BaseException as e:              # noqa: BLE001
                first = e
                break
        for future in futures:
            try:
                future.result()
            except BaseException as e:              # noqa: BLE001
                first = first or e
        if first is not None:
            raise first

    def _read(self, unit: int, into, arrays, offs) -> UnitState:
        with self._lock:
            slot, gen, torn = self._slot[unit], self._gen[unit], unit in self._torn
        if torn:
            raise UnitStateError(f"unit {unit} of {self.path}: a write that failed overwrote part of its record, so its "
                                 "state is lost; resume from the last checkpoint")
        if slot is None:
            raise UnitStateError(f"unit {unit} of {self.path} has no state on disk yet: write it before reading it")
        base = self.slot_offset(unit, slot) + HEADER_BYTES
        sizes = self._payload_sizes(unit, arrays)
        self._all(self.handle.pread, [(a, n, base + o) for a, n, o in zip(arrays, sizes, offs)])
        views = self.views(unit, into) if into is not None else tuple(arrays)
        return UnitState(views, gen)

    def _write(self, unit: int, arrays, offs) -> int:
        with self._lock:
            slot, gen = self._slot[unit], self._gen[unit] + 1
            if self.slots == 1:                         # [Why a file not kept has one slot per unit]
                self._torn.add(unit)
        target = 0 if slot is None or self.slots == 1 else 1 - slot
        start = self.slot_offset(unit, target)
        sizes = self._payload_sizes(unit, arrays)
        self._all(self.handle.pwrite, [(a, n, start + HEADER_BYTES + o) for a, n, o in zip(arrays, sizes, offs)])
        if self.durable:
            self.handle.sync()
        header = _host_bytes(pack_record(self.file_id, unit, target, gen, self.layouts[unit]))
        self.handle.pwrite(header, HEADER_BYTES, start).result()
        if self.durable:
            self.handle.sync()
        with self._lock:
            self._slot[unit], self._gen[unit] = target, gen
            self._torn.discard(unit)
        return gen

    def flush(self) -> None:
        """Wait for every operation asked for so far; raise the first failure since the last flush
        (also one whose future nobody looked at)."""
        with self._lock:
            pending = list(self._tail.values())
        cf.wait(pending)
        with self._lock:
            failures, self._failures = self._failures, []
        if failures:
            failure = failures[0]
            if isinstance(failure, DiskIOError):
                raise failure
            raise DiskIOError(getattr(failure, "errno", None) or errno.EIO,
                              f"an operation on {self.path} failed: {failure}") from failure

    def close(self) -> None:
        """Wait for the operations in flight, close the file and, unless `keep`, free its space.
        Failures not yet seen are not raised here (call `flush()` first for them)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._workers.shutdown(wait=True)
        self._finalizer()                           # closes the handle and an owned backend (once)

    def __enter__(self) -> UnitStateFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
