"""Units' fp32 master weights and AdamW moments in one preallocated file, read and written on I/O
threads while the caller computes.

Layout (every offset a multiple of 4096 bytes; little-endian):

    file header   magic, version, file id, unit count, each unit's numel, CRC-32    (rounded up to 4096)
    unit 0        slot 0: record header (4096) | master | exp_avg | exp_avg_sq
                  slot 1: record header (4096) | master | exp_avg | exp_avg_sq     (a kept file only)
    unit 1        ...

A file kept for a resume (`keep=True`) has two slots per unit; a file that lives only as long as
its process (the default: its name is removed at once) has one, half the space (see the Notes).

Each of a record's three arrays holds numel fp32 values and starts on a 4096-byte boundary, so a
record's payload is `3 * round_up(4 * numel, 4096)` bytes: the buffer a read fills and a write
sends (`UnitStateFile.payload_bytes`). A record header holds (file id, unit, slot, generation,
numel) and a CRC-32 of them.

Note: [Why an interrupted write never reads as valid] a unit's generation g lives in one of its
two slots. A write of generation g + 1 goes to the other slot, in this order: the payload; then,
once every payload byte is written (and, with `durable`, flushed by fdatasync), the slot's
record header naming g + 1; with `durable`, that header is flushed too before the write counts
as done. A record is valid when its header's CRC matches and it names this file, this unit, this
slot and the unit's numel; the newest valid record wins. So a write cut short in its payload
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
import struct
import threading
import uuid
import weakref
import zlib
from typing import NamedTuple, Sequence

import torch

from .backends import DiskIOError, FileBackend, make_backend
from .buffers import ALIGN, HostBuffer, round_up
from .names import create_unlinked
from .space import allocate, check_room, preallocate

__all__ = ["UnitState", "UnitStateFile", "UnitStateError", "record_layout"]

_FILE_MAGIC, _RECORD_MAGIC, _VERSION = b"SLIDEUS1", b"SLIDREC1", 1
_FILE_HEAD = struct.Struct("<8sIIQ")             # magic, version, unit count, file id
_RECORD = struct.Struct("<8sQIIQQ")              # magic, file id, unit, slot, generation, numel
_CRC = struct.Struct("<I")
HEADER_BYTES = ALIGN                             # one record header


class UnitStateError(RuntimeError):
    """A unit's state cannot be read (never written) or the file is not a state file."""


class UnitState(NamedTuple):
    """A unit's state as read: three fp32 tensors of numel values and the generation they are."""
    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    generation: int


def record_layout(numels: Sequence[int], slots: int = 2) -> tuple[int, list[int], list[int]]:
    """(file header bytes, each unit's offset, each unit's slot bytes) for units of these sizes,
    with `slots` slots per unit (2 in a kept file, 1 otherwise)."""
    if slots not in (1, 2):
        raise ValueError(f"a unit has one or two slots, not {slots}")
    head = round_up(_FILE_HEAD.size + 8 * len(numels) + _CRC.size)
    offsets, sizes, pos = [], [], head
    for n in numels:
        size = HEADER_BYTES + 3 * round_up(4 * n)
        offsets.append(pos)
        sizes.append(size)
        pos += slots * size
    return head, offsets, sizes


def _pack_record(file_id: int, unit: int, slot: int, generation: int, numel: int) -> bytes:
    body = _RECORD.pack(_RECORD_MAGIC, file_id, unit, slot, generation, numel)
    return body + _CRC.pack(zlib.crc32(body))


def _parse_record(raw: bytes, file_id: int, unit: int, slot: int, numel: int) -> int:
    """The generation a record header names, or 0 when it is not a valid header of this slot."""
    body, (crc,) = raw[:_RECORD.size], _CRC.unpack_from(raw, _RECORD.size)
    if zlib.crc32(body) != crc:
        return 0
    magic, fid, u, s, gen, n = _RECORD.unpack(body)
    if (magic, fid, u, s, n) != (_RECORD_MAGIC, file_id, unit, slot, numel):
        return 0
    return gen


def _host_bytes(data: bytes) -> torch.Tensor:
    t = torch.zeros(HEADER_BYTES, dtype=torch.uint8)
    t[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return t


def _close(handle, backend: FileBackend | None) -> None:
    """Close the file (and the backend it owns): the close, the finalizer and the exit path."""
    try:
        handle.close()
    finally:
        if backend is not None:
            backend.close()


class UnitStateFile:
    """N units' fp32 master, exp_avg and exp_avg_sq on disk (layout and invariants in the module).

    The file is created at its full size up front (`preallocate`) and reused across steps. Unless
    `keep`, its name is removed as soon as it is open: the space comes back when the file is
    closed, when the object is collected or the interpreter exits (a finalizer), and also when
    the process is killed, since no name is left behind (df counts it while open, ls does not
    show it).

    Args:
        path: the file to create (its directory must exist); an existing file is overwritten.
        numels: each unit's parameter count.
        backend: the I/O backend (default `make_backend("auto")`, closed with this file).
        keep: leave the file in place at close, for `UnitStateFile.open` (a resume): two slots per
            unit; otherwise one (see the Notes).
        durable: flush each record to the disk before it counts (see the Note); default `keep`.
        workers: operations (of different units) that run at once.
    """

    def __init__(self, path: str, numels: Sequence[int], backend: FileBackend | None = None, *,
                 keep: bool = False, durable: bool | None = None, workers: int = 4,
                 _file_id: int | None = None):
        self.path = os.path.abspath(path)
        self.numels = [int(n) for n in numels]
        if any(n < 0 for n in self.numels):
            raise ValueError("a unit's numel cannot be negative")
        self.keep = keep
        self.durable = keep if durable is None else durable
        self.slots = 2 if keep else 1
        self.header_bytes, self._offsets, self._slot_bytes = record_layout(self.numels, self.slots)
        self.nbytes = self.header_bytes + self.slots * sum(self._slot_bytes)
        self._owns_backend = backend is None
        self.backend = backend or make_backend("auto")
        self._slot: list[int | None] = [None] * len(self.numels)       # the slot holding the current generation
        self._gen = [0] * len(self.numels)
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
        return 3 * round_up(4 * self.numels[unit])

    @property
    def max_payload_bytes(self) -> int:
        """The host buffer size that holds any unit's payload."""
        return max((self.payload_bytes(u) for u in range(len(self.numels))), default=0)

    def slot_offset(self, unit: int, slot: int) -> int:
        """Where slot `slot` (0, or 1 in a kept file) of `unit` starts: its record header, then the payload."""
        return self._offsets[unit] + slot * self._slot_bytes[unit]

    def views(self, unit: int, buf) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The master, exp_avg and exp_avg_sq (fp32, numel each) inside a flat payload buffer (a
        tensor or a `HostBuffer`)."""
        if isinstance(buf, HostBuffer):
            buf = buf.tensor
        n, stride = self.numels[unit], round_up(4 * self.numels[unit])
        flat = buf.detach().reshape(-1).view(torch.uint8)
        if flat.numel() < self.payload_bytes(unit):
            raise ValueError(f"unit {unit} needs a buffer of {self.payload_bytes(unit)} bytes, got {flat.numel()}")
        return tuple(flat[k * stride:k * stride + 4 * n].view(torch.float32) for k in range(3))

    def generation(self, unit: int) -> int:
        """The generation of the unit's last completed write (0: none)."""
        with self._lock:
            return self._gen[unit]

    # ------------------------------------------------------------------ the file header
    def _write_file_header(self) -> None:
        body = _FILE_HEAD.pack(_FILE_MAGIC, _VERSION, len(self.numels), self.file_id)
        body += struct.pack(f"<{len(self.numels)}Q", *self.numels)
        data = body + _CRC.pack(zlib.crc32(body))
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
        with open(path, "rb") as f:
            head = f.read(_FILE_HEAD.size)
            if len(head) < _FILE_HEAD.size:
                raise UnitStateError(f"{path} is not a unit state file (too short)")
            magic, version, count, file_id = _FILE_HEAD.unpack(head)
            if magic != _FILE_MAGIC or version != _VERSION:
                raise UnitStateError(f"{path} is not a unit state file of version {_VERSION}")
            numels_raw = f.read(8 * count)
            (crc,) = _CRC.unpack(f.read(_CRC.size))
        if zlib.crc32(head + numels_raw) != crc:
            raise UnitStateError(f"{path}: its file header is damaged (CRC mismatch)")
        numels = struct.unpack(f"<{count}Q", numels_raw)
        self = cls(path, numels, backend, keep=True, durable=durable, workers=workers, _file_id=file_id)
        raw = torch.zeros(HEADER_BYTES, dtype=torch.uint8)
        for u, n in enumerate(numels):
            for s in (0, 1):
                self.handle.pread(raw, HEADER_BYTES, self.slot_offset(u, s)).result()
                gen = _parse_record(raw.numpy().tobytes(), file_id, u, s, n)
                if gen > self._gen[u]:
                    self._gen[u], self._slot[u] = gen, s
        return self

    # ------------------------------------------------------------------ operations
    def _submit(self, unit: int, fn, *args) -> cf.Future:
        if not 0 <= unit < len(self.numels):
            raise IndexError(f"unit {unit} out of range (the file holds {len(self.numels)})")
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
        nbytes = 4 * self.numels[unit]
        if isinstance(data, HostBuffer):
            data = data.tensor
        if isinstance(data, torch.Tensor):
            have = data.numel() * data.element_size()
            if not data.is_contiguous() or have < self.payload_bytes(unit):
                raise ValueError(f"unit {unit} needs a contiguous buffer of {self.payload_bytes(unit)} bytes, "
                                 f"got {have}{'' if data.is_contiguous() else ' (not contiguous)'}")
            return [data], [0]
        arrays = list(data)[:3]
        if len(arrays) != 3 or any(a.dtype != torch.float32 or a.numel() != self.numels[unit] for a in arrays):
            raise ValueError(f"unit {unit} takes a flat buffer or three fp32 tensors of {self.numels[unit]} values")
        return arrays, [k * round_up(nbytes) for k in range(3)]

    def read(self, unit: int, into, span: tuple[int, int] | None = None) -> cf.Future:
        """Read the unit's current generation into `into`: a flat buffer of at least
        `payload_bytes(unit)` bytes (a `HostBuffer` of a `HostBufferPool`, say) or three fp32 tensors (CPU or
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
        """Bytes of one of the unit's arrays in a payload (its numel's fp32, rounded up to 4096)."""
        return round_up(4 * self.numels[unit])

    def write(self, unit: int, source) -> cf.Future:
        """Write `source` (as for `read`) as the unit's next generation. The future's result is
        that generation; on failure a kept file's unit stays at the one before, and another file's
        unit reads as lost (see the Notes)."""
        arrays, offs = self._arrays(unit, source)
        return self._submit(unit, self._write, arrays, offs)

    def _payload_sizes(self, unit: int, arrays) -> list[int]:
        if len(arrays) == 1:                        # a flat buffer (maybe larger), or one span of its payload
            return [min(arrays[0].numel() * arrays[0].element_size(), self.payload_bytes(unit))]
        return [4 * self.numels[unit]] * 3

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
        for f in futures:
            try:
                f.result()
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
        return UnitState(*views, gen)

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
        header = _host_bytes(_pack_record(self.file_id, unit, target, gen, self.numels[unit]))
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
            e = failures[0]
            if isinstance(e, DiskIOError):
                raise e
            raise DiskIOError(getattr(e, "errno", None) or errno.EIO,
                              f"an operation on {self.path} failed: {e}") from e

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
