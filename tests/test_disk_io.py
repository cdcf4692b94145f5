"""Unit state on disk (hf_slideformer.disk): bit-exact round trips at odd sizes and offsets, space
taken up front with a clear error when the disk is too small, the aligned buffer pool, the
crash-safety invariant (unit_state.py: [Why an interrupted write never reads as valid]), the order
of operations on one unit ([Why a unit's operations run in the order they were asked for]),
errors from I/O threads, and the file's space given back."""
import errno
import gc
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from hf_slideformer.disk import (HostBufferPool, BufferPoolError, DiskIOError, DiskSpaceError, FileBackend,
                                 PlainFileBackend, UnitStateError, UnitStateFile, aligned_host_buffer, make_backend,
                                 preallocate, record_layout)
from hf_slideformer.disk import backends, space
from hf_slideformer.disk.backends import BackendFile
from helpers import open_fds

ROOT = Path(__file__).resolve().parents[1]
NUMELS = [1, 1000, 12345]


def _random_bytes(n, seed):
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def _state(numel, seed):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(numel, generator=g) for _ in range(3))


def _same(a, b):
    return all(torch.equal(x.view(torch.int32), y.view(torch.int32)) for x, y in zip(a, b))


def _open_fds_to(path):
    """This process's open files that are `path` (deleted or not)."""
    return open_fds(lambda target: target.removesuffix(" (deleted)") == str(path))


def _finishes(fn, timeout=10.0):
    """Run fn on a thread; return (finished in time, its exception or None)."""
    box = {}

    def run():
        try:
            fn()
        except BaseException as e:          # noqa: BLE001
            box["error"] = e
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    return not t.is_alive(), box.get("error")


class Faulty(FileBackend):
    """The plain backend with hooks: `tear(nbytes, offset)` picks one write that stores only its first
    `keep` bytes and then fails (a crash in the middle of it); `gate` (an Event) holds back
    requests that `gated(op, offset)` picks until it is set."""

    name = "faulty"

    def __init__(self):
        self.inner = PlainFileBackend(threads=2, task_bytes=4096)
        self.tear, self.keep = None, 0
        self.gate, self.gated = threading.Event(), lambda op, offset: False
        self.gate.set()

    def open(self, path):
        return _FaultyFile(self, self.inner.open(path))

    def close(self):
        self.inner.close()


class _FaultyFile(BackendFile):
    def __init__(self, owner, inner):
        self.owner, self.inner, self.path = owner, inner, inner.path

    def fileno(self):
        return self.inner.fileno()

    def pread(self, buf, nbytes, offset):
        if self.owner.gated("read", offset):
            assert self.owner.gate.wait(10)
        return self.inner.pread(buf, nbytes, offset)

    def pwrite(self, buf, nbytes, offset):
        if self.owner.gated("write", offset):
            assert self.owner.gate.wait(10)
        tear = self.owner.tear
        if tear is not None and tear(nbytes, offset):
            self.owner.tear = None
            if self.owner.keep:
                self.inner.pwrite(buf, self.owner.keep, offset).result()
            raise DiskIOError(errno.EIO, f"simulated crash after {self.owner.keep} of {nbytes} bytes")
        return self.inner.pwrite(buf, nbytes, offset)

    def close(self):
        self.inner.close()


# ---------------------------------------------------------------------------------------- backends
@pytest.mark.parametrize("nbytes", [1, 4095, 4097, 3 * 1000 + 17])
@pytest.mark.parametrize("offset", [0, 1, 4093, 12289])
def test_plain_round_trip_is_bit_exact_at_odd_sizes_and_offsets(tmp_path, nbytes, offset):
    path = str(tmp_path / "f.bin")
    size = offset + nbytes + 5
    preallocate(path, size)
    be = PlainFileBackend(threads=3, task_bytes=1000)          # a request of several tasks
    f = be.open(path)
    try:
        data = _random_bytes(nbytes, nbytes + offset)
        assert f.pwrite(data, nbytes, offset).result() == nbytes
        back = torch.zeros(nbytes + 7, dtype=torch.uint8)      # a larger buffer: only its head is filled
        assert f.pread(back, nbytes, offset).result() == nbytes
        assert torch.equal(back[:nbytes], data) and not back[nbytes:].any()
    finally:
        f.close()
        be.close()
    raw = Path(path).read_bytes()
    assert len(raw) == size and raw[offset:offset + nbytes] == data.numpy().tobytes()
    assert not any(raw[:offset]) and not any(raw[offset + nbytes:])    # nothing written outside


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_tensor_bits_survive_a_file_of_their_own(tmp_path, dtype):
    x = torch.randn(3, 7, 11).to(dtype)
    x.view(-1)[:3] = torch.tensor([float("nan"), float("inf"), -0.0], dtype=dtype)
    be = make_backend("plain")
    try:
        path = str(tmp_path / "x.bin")
        be.write_file(path, x, x.numel() * x.element_size())
        y = torch.empty_like(x)
        be.read_file(path, y, y.numel() * y.element_size())
        assert torch.equal(x.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                           y.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))
        with pytest.raises(DiskIOError, match=f"{path}.*holds {x.numel() * x.element_size()} bytes"):
            be.read_file(path, y, 4)
    finally:
        be.close()


def test_a_read_past_the_end_is_an_error_naming_the_file(tmp_path):
    path = str(tmp_path / "short.bin")
    preallocate(path, 100)
    be = PlainFileBackend(threads=2, task_bytes=64)
    f = be.open(path)
    try:
        with pytest.raises(DiskIOError, match=f"read of 200 bytes at offset 0 of {path}.*end of file.*nvme_path"):
            f.pread(torch.empty(200, dtype=torch.uint8), 200, 0).result()
    finally:
        f.close()
        be.close()


def test_io_thread_errors_reach_the_caller_with_the_path(tmp_path, monkeypatch):
    path = str(tmp_path / "f.bin")
    preallocate(path, 1 << 16)
    be = PlainFileBackend(threads=2, task_bytes=4096)
    f = be.open(path)
    real = os.pwritev

    def failing_pwritev(fd, bufs, offset):
        if offset >= 8192:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, bufs, offset)
    monkeypatch.setattr(os, "pwritev", failing_pwritev)
    monkeypatch.setattr(os, "preadv", lambda *a: (_ for _ in ()).throw(OSError(errno.EIO, "Input/output error")))
    try:
        fut = f.pwrite(torch.ones(1 << 15, dtype=torch.uint8), 1 << 15, 0)
        with pytest.raises(DiskIOError, match=f"write of 32768 bytes at offset 0 of {path} failed.*No space") as e:
            fut.result()
        assert e.value.errno == errno.ENOSPC and e.value.filename == path
        with pytest.raises(DiskIOError, match="Input/output error.*point nvme_path to another disk"):
            f.pread(torch.empty(10, dtype=torch.uint8), 10, 0).result()
    finally:
        f.close()
        be.close()


def test_a_failed_request_waits_for_all_its_tasks(tmp_path, monkeypatch):
    """backends.py: [Why a failed request still waits for all its tasks]."""
    path = str(tmp_path / "f.bin")
    preallocate(path, 3 * 4096)
    be = PlainFileBackend(threads=3, task_bytes=4096)
    f = be.open(path)
    real, finished = os.pwritev, []

    def pwritev(fd, bufs, offset):
        if offset == 0:
            raise OSError(errno.EIO, "Input/output error")
        time.sleep(0.2)
        n = real(fd, bufs, offset)
        finished.append(offset)
        return n
    monkeypatch.setattr(os, "pwritev", pwritev)
    try:
        with pytest.raises(DiskIOError, match="Input/output error"):
            f.pwrite(torch.ones(3 * 4096, dtype=torch.uint8), 3 * 4096, 0).result()
        assert sorted(finished) == [4096, 8192]     # nothing still writes from the buffer
    finally:
        f.close()
        be.close()


def test_make_backend_chooses_and_explains(monkeypatch, caplog, recwarn):
    assert isinstance(make_backend("plain"), PlainFileBackend)
    monkeypatch.setattr(backends, "is_kvikio_available", lambda: False)
    with caplog.at_level("DEBUG"):
        auto = make_backend("auto")
    assert isinstance(auto, PlainFileBackend) and not caplog.records and not recwarn.list   # no noise
    monkeypatch.setitem(sys.modules, "kvikio", None)                                        # not installed
    with pytest.raises(ImportError, match=r"pip install 'hf-slideformer\[nvme\]'.*nvme-cu12"):
        make_backend("kvikio")
    with pytest.raises(ValueError, match="unknown disk backend 'gds'"):
        make_backend("gds")


# ---------------------------------------------------------------------------------------- space
def test_preallocate_takes_the_full_size_and_resizes(tmp_path):
    path = str(tmp_path / "p.bin")
    preallocate(path, 3 * 4096 + 5)
    st = os.stat(path)
    assert st.st_size == 3 * 4096 + 5 and st.st_blocks * 512 >= st.st_size     # blocks allocated, not sparse
    preallocate(path, 100)
    assert os.path.getsize(path) == 100                                         # reused, cut to the new size
    preallocate(path, 10000)
    assert os.path.getsize(path) == 10000


def test_preallocate_writes_zeros_where_fallocate_is_not_supported(tmp_path, monkeypatch):
    path = str(tmp_path / "z.bin")
    Path(path).write_bytes(b"\x07" * 100)                                       # what is there stays
    monkeypatch.setattr(os, "posix_fallocate", lambda *a: (_ for _ in ()).throw(OSError(errno.EOPNOTSUPP, "no")))
    monkeypatch.setattr(space, "ZERO_BLOCK", 4096)
    writes = []
    real = os.pwrite
    monkeypatch.setattr(os, "pwrite", lambda fd, b, off: writes.append(off) or real(fd, b, off))
    preallocate(path, 100 + 3 * 4096)
    raw = Path(path).read_bytes()
    assert raw == b"\x07" * 100 + bytes(3 * 4096) and writes == [100, 4196, 8292]


def test_a_full_disk_is_reported_before_anything_is_written(tmp_path, monkeypatch):
    path = str(tmp_path / "state.bin")
    monkeypatch.setattr(space.shutil, "disk_usage", lambda d: _Usage(free=1000))
    with pytest.raises(DiskSpaceError) as e:
        UnitStateFile(path, NUMELS, make_backend("plain"))
    msg = str(e.value)
    head, _, sizes = record_layout(NUMELS, slots=1)                    # not kept: one slot per unit
    need = head + sum(sizes)
    assert path in msg and f"needs {need} bytes" in msg and "has 1000 bytes" in msg and "nvme_path" in msg
    assert e.value.errno == errno.ENOSPC and not os.path.exists(path)


def test_an_allocation_that_runs_out_of_space_removes_its_file(tmp_path, monkeypatch):
    path = str(tmp_path / "state.bin")
    monkeypatch.setattr(os, "posix_fallocate", lambda *a: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space")))
    with pytest.raises(DiskSpaceError, match=f"{path} needs 123456 bytes.*allocation failed: No space.*nvme_path"):
        preallocate(path, 123456)
    assert not os.path.exists(path)


class _Usage:
    def __init__(self, free):
        self.free, self.total, self.used = free, free, 0


# ---------------------------------------------------------------------------------------- buffer pool
def test_pool_buffers_are_aligned_distinct_and_rounded_up():
    pool = HostBufferPool(3, 5000, pin=False)
    bufs = pool.acquire(3)
    ptrs = sorted(b.tensor.data_ptr() for b in bufs)
    assert pool.nbytes == 8192 and all(b.tensor.numel() == 8192 for b in bufs)
    assert all(p % 4096 == 0 for p in ptrs) and all(b - a >= 8192 for a, b in zip(ptrs, ptrs[1:]))
    assert aligned_host_buffer(1).data_ptr() % 4096 == 0
    for b in bufs:
        b.release()
    pool.close()


def test_pool_acquire_blocks_until_a_release():
    pool = HostBufferPool(2, 4096, pin=False)
    held = pool.acquire(2)
    got = threading.Event()
    t = threading.Thread(target=lambda: (pool.acquire_one(), got.set()), daemon=True)
    t.start()
    assert not got.wait(0.2)                        # every buffer is lent: it waits
    held[1].release()
    assert got.wait(5)
    t.join(5)
    assert held[1].tensor is None                   # a released buffer is not used again by its old holder
    with pytest.raises(BufferPoolError, match="released twice"):
        held[1].release()


def test_pool_refuses_a_need_larger_than_itself():
    pool = HostBufferPool(2, 4096, pin=False)
    done, err = _finishes(lambda: pool.acquire(3))
    assert done and isinstance(err, BufferPoolError)
    assert "3 host buffers asked for at once, but the pool has 2" in str(err)
    assert pool.free_count() == 2


def test_pool_raises_instead_of_waiting_for_buffers_dropped_without_release():
    """buffers.py: [Why an acquire raises instead of waiting forever]."""
    pool = HostBufferPool(2, 4096, pin=False)
    t = threading.Thread(target=lambda: pool.acquire(2))    # takes both and ends without releasing them
    t.start()
    t.join()
    gc.collect()
    done, err = _finishes(pool.acquire_one)
    assert done and isinstance(err, BufferPoolError) and "dropped without release()" in str(err)

    pool = HostBufferPool(2, 4096, pin=False)
    held = pool.acquire(2)
    errors = []
    waiter = threading.Thread(target=lambda: errors.append(_finishes(pool.acquire_one)[1]), daemon=True)
    waiter.start()
    time.sleep(0.1)                                 # waiting for a buffer
    del held
    gc.collect()                                    # the holder drops them: the waiter wakes with an error
    waiter.join(10)
    assert not waiter.is_alive() and isinstance(errors[0], BufferPoolError)


# ---------------------------------------------------------------------------------------- unit state file
def _file(tmp_path, backend=None, **kw):
    return UnitStateFile(str(tmp_path / "state.bin"), NUMELS, backend or PlainFileBackend(threads=2, task_bytes=4096),
                         **kw)


def test_layout_is_aligned_and_the_file_is_preallocated(tmp_path):
    numels = [1, 1000, 3, 0, 1025]
    head, offsets, slots = record_layout(numels)
    assert all(x % 4096 == 0 for x in [head, *offsets, *slots])
    f = UnitStateFile(str(tmp_path / "s.bin"), numels, make_backend("plain"), keep=True)
    try:
        assert os.path.getsize(f.path) == f.nbytes == head + 2 * sum(slots)
        buf = torch.empty(f.max_payload_bytes, dtype=torch.uint8)
        for u, n in enumerate(numels):
            views = f.views(u, buf)
            assert all(v.numel() == n and (n == 0 or (v.data_ptr() - buf.data_ptr()) % 4096 == 0) for v in views)
            assert f.slot_offset(u, 1) - f.slot_offset(u, 0) == slots[u]
    finally:
        f.close()


def test_a_typed_layout_round_trips_and_reopens_with_its_dtypes(tmp_path):
    """A unit's record of (dtype, count) arrays (a compact state format's: bf16 master, 8-bit
    moments, fp32 block scales): each array on a 4096-byte boundary, the same bits back through a
    flat buffer and through tensors, and a kept file reopens with the layout from its header."""
    lay = ((torch.bfloat16, 1000), (torch.uint8, 1000), (torch.uint8, 1000), (torch.float32, 4), (torch.float32, 4))
    f = UnitStateFile(str(tmp_path / "s.bin"), [lay, 5], make_backend("plain"), keep=True)
    try:
        assert f.payload_bytes(0) == 5 * 4096 and f.array_bytes(0) == 4096 and f.payload_bytes(1) == 3 * 4096
        pool = HostBufferPool(1, f.max_payload_bytes, pin=False)
        arrays = (torch.randn(1000).bfloat16(), _random_bytes(1000, 1), _random_bytes(1000, 2), torch.rand(4),
                  torch.rand(4))
        with pool.acquire_one() as buf:
            views = f.views(0, buf)
            assert [(v.dtype, v.numel()) for v in views] == list(lay)
            assert all((v.data_ptr() - buf.tensor.data_ptr()) % 4096 == 0 for v in views)
            for v, a in zip(views, arrays):
                v.copy_(a)
            assert f.write(0, buf).result() == 1
        f.write(0, arrays).result()
        got = f.read(0, tuple(torch.empty(n, dtype=d) for d, n in lay)).result()
        assert got.generation == 2 and all(torch.equal(a, b) for a, b in zip(got, arrays))
        with pytest.raises(ValueError, match=r"takes a flat buffer or 5 tensors \(1000 bfloat16"):
            f.read(0, tuple(torch.empty(1000) for _ in range(5)))
    finally:
        f.close()
        pool.close()
    g = UnitStateFile.open(f.path, PlainFileBackend(threads=2))
    try:
        assert g.layouts == [lay, ((torch.float32, 5),) * 3] and g.generation(0) == 2 and g.generation(1) == 0
        got = g.read(0, tuple(torch.empty(n, dtype=d) for d, n in lay)).result()
        assert all(torch.equal(a, b) for a, b in zip(got, arrays))
    finally:
        g.close()


def test_unit_state_round_trip_is_bit_exact_through_pool_buffers_and_tensors(tmp_path):
    f = _file(tmp_path)
    pool = HostBufferPool(2, f.max_payload_bytes, pin=False)
    try:
        for gen in (1, 2, 3):                       # both slots, then the first again
            for u, n in enumerate(NUMELS):
                with pool.acquire_one() as buf:
                    for dst, src in zip(f.views(u, buf.tensor), _state(n, 10 * gen + u)):
                        dst.copy_(src)
                    assert f.write(u, buf).result() == gen
        for u, n in enumerate(NUMELS):
            with pool.acquire_one() as buf:
                got = f.read(u, buf).result()
                assert got.generation == 3 and _same(got[:3], _state(n, 30 + u))
            three = tuple(torch.empty(n) for _ in range(3))
            got = f.read(u, three).result()
            assert all(a is b for a, b in zip(got[:3], three)) and _same(three, _state(n, 30 + u))
        f.write(1, _state(1000, 99)).result()       # three tensors in
        assert _same(f.read(1, tuple(torch.empty(1000) for _ in range(3))).result()[:3], _state(1000, 99))
        with pytest.raises(ValueError, match="needs a contiguous buffer of"):
            f.read(2, torch.empty(10, dtype=torch.uint8))
    finally:
        f.close()


def test_a_unit_never_written_is_a_clear_error(tmp_path):
    f = _file(tmp_path)
    try:
        with pytest.raises(UnitStateError, match="unit 0 of .* has no state on disk yet"):
            f.read(0, tuple(torch.empty(1) for _ in range(3))).result()
    finally:
        f.close()


def _tear(be, f, where):
    """The next write of unit 1 stops part-way: in its second array, or in its record header."""
    if where == "payload":
        be.tear, be.keep = (lambda n, off: n == 4000), 2000           # the second array, half written
    else:
        target = f.slot_offset(1, 0)                                  # the slot the third write goes to
        be.tear, be.keep = (lambda n, off: off == target), 28


@pytest.mark.parametrize("where", ["payload", "header"])
def test_a_torn_write_leaves_the_previous_generation(tmp_path, where):
    """unit_state.py: [Why an interrupted write never reads as valid], in the process (a kept
    file, two slots per unit)."""
    be = Faulty()
    f = _file(tmp_path, be, keep=True)
    try:
        assert f.slots == 2
        f.write(1, _state(1000, 1)).result()
        f.write(1, _state(1000, 2)).result()
        _tear(be, f, where)
        with pytest.raises(DiskIOError, match="simulated crash"):
            f.write(1, _state(1000, 3)).result()
        got = f.read(1, tuple(torch.empty(1000) for _ in range(3))).result()
        assert got.generation == 2 == f.generation(1) and _same(got[:3], _state(1000, 2))
        with pytest.raises(DiskIOError, match="simulated crash"):
            f.flush()                                             # also when nobody looked at the future
        f.flush()                                                 # reported once
        assert f.write(1, _state(1000, 4)).result() == 3
        assert _same(f.read(1, tuple(torch.empty(1000) for _ in range(3))).result()[:3], _state(1000, 4))
    finally:
        f.close()


@pytest.mark.parametrize("where", ["payload", "header"])
def test_a_torn_write_in_a_file_not_kept_reads_as_lost(tmp_path, where):
    """unit_state.py: [Why a file not kept has one slot per unit]: half the space; a unit whose
    write failed part-way raises on read (never a record mixing two generations), the other
    units read as before, and the next complete write of it is read back."""
    be = Faulty()
    f = _file(tmp_path, be)
    try:
        head, _, sizes = record_layout(NUMELS, slots=1)
        assert f.slots == 1 and f.nbytes == head + sum(sizes) and f.slot_offset(1, 0) + sizes[1] == f.slot_offset(2, 0)
        f.write(1, _state(1000, 1)).result()
        f.write(2, _state(12345, 5)).result()
        f.write(1, _state(1000, 2)).result()
        _tear(be, f, where)
        with pytest.raises(DiskIOError, match="simulated crash"):
            f.write(1, _state(1000, 3)).result()
        with pytest.raises(UnitStateError, match="unit 1 .*state is lost"):
            f.read(1, tuple(torch.empty(1000) for _ in range(3))).result()
        assert _same(f.read(2, tuple(torch.empty(12345) for _ in range(3))).result()[:3], _state(12345, 5))
        with pytest.raises(DiskIOError, match="simulated crash"):
            f.flush()
        assert f.write(1, _state(1000, 4)).result() == 3
        assert _same(f.read(1, tuple(torch.empty(1000) for _ in range(3))).result()[:3], _state(1000, 4))
    finally:
        f.close()


@pytest.mark.parametrize("where", ["payload", "header"])
def test_a_crash_mid_write_resumes_at_the_previous_generation(tmp_path, where):
    """unit_state.py: [Why an interrupted write never reads as valid], across a restart: the
    third write goes to the slot whose header still names generation 1, and is cut short."""
    be = Faulty()
    f = _file(tmp_path, be, keep=True)
    f.write(2, _state(12345, 1)).result()
    f.write(2, _state(12345, 2)).result()
    f.write(0, _state(1, 7)).result()
    slot0 = f.slot_offset(2, 0)
    if where == "payload":
        be.tear, be.keep = (lambda n, off: off > slot0 and off < f.slot_offset(2, 1)), 5000
    else:
        be.tear, be.keep = (lambda n, off: off == slot0), 28     # the generation half new
    with pytest.raises(DiskIOError):
        f.write(2, _state(12345, 3)).result()
    f.close()                                       # the process ends here; the file stays
    g = UnitStateFile.open(f.path, PlainFileBackend(threads=2))
    try:
        got = g.read(2, tuple(torch.empty(12345) for _ in range(3))).result()
        assert got.generation == 2 and _same(got[:3], _state(12345, 2))
        assert g.generation(0) == 1 and g.generation(1) == 0
        assert _same(g.read(0, tuple(torch.empty(1) for _ in range(3))).result()[:3], _state(1, 7))
        assert g.write(2, _state(12345, 5)).result() == 3          # the next write goes on from there
    finally:
        g.close()
    assert os.path.exists(f.path)


def test_a_damaged_header_is_not_taken_as_valid(tmp_path):
    f = _file(tmp_path, keep=True)
    for gen in (1, 2):
        f.write(1, _state(1000, gen)).result()
    f.close()
    with open(f.path, "r+b") as raw:                # generation 2 (slot 1) reads as 3, its CRC fails
        raw.seek(f.slot_offset(1, 1) + 24)
        b = raw.read(1)
        raw.seek(-1, 1)
        raw.write(bytes([b[0] ^ 1]))
    g = UnitStateFile.open(f.path, PlainFileBackend(threads=2))
    try:
        got = g.read(1, tuple(torch.empty(1000) for _ in range(3))).result()
        assert got.generation == 1 and _same(got[:3], _state(1000, 1))
    finally:
        g.close()
    Path(f.path).write_bytes(b"not a state file")
    with pytest.raises(UnitStateError, match="is not a unit state file"):
        UnitStateFile.open(f.path)


def test_a_new_file_at_the_same_path_does_not_take_old_records(tmp_path):
    f = _file(tmp_path, keep=True)
    f.write(0, _state(1, 1)).result()
    f.close()
    g = _file(tmp_path, keep=True)                  # overwrites the old file: another file id
    g.close()
    h = UnitStateFile.open(g.path, PlainFileBackend(threads=2))
    try:
        assert h.generation(0) == 0
    finally:
        h.close()


def test_a_read_waits_for_the_write_before_it_and_other_units_do_not(tmp_path):
    """unit_state.py: [Why a unit's operations run in the order they were asked for]."""
    be = Faulty()
    f = _file(tmp_path, be, workers=4)
    try:
        f.write(2, _state(12345, 1)).result()
        lo, hi = f.slot_offset(1, 0), f.slot_offset(2, 0)
        be.gate.clear()
        be.gated = lambda op, off: op == "write" and lo <= off < hi          # unit 1's writes wait
        w = f.write(1, _state(1000, 2))
        r = f.read(1, tuple(torch.empty(1000) for _ in range(3)))
        other = f.read(2, tuple(torch.empty(12345) for _ in range(3)))
        assert _same(other.result(timeout=10)[:3], _state(12345, 1))         # not held back by unit 1
        time.sleep(0.1)
        assert not w.done() and not r.done()
        be.gate.set()
        got = r.result(timeout=10)
        assert w.result() == 1 and got.generation == 1 and _same(got[:3], _state(1000, 2))
    finally:
        be.gate.set()
        f.close()


def test_a_write_waits_for_the_read_before_it(tmp_path):
    be = Faulty()
    f = _file(tmp_path, be, workers=4)
    try:
        f.write(1, _state(1000, 1)).result()
        lo, hi = f.slot_offset(1, 0), f.slot_offset(2, 0)
        be.gate.clear()
        be.gated = lambda op, off: op == "read" and lo <= off < hi
        r = f.read(1, tuple(torch.empty(1000) for _ in range(3)))
        w2 = f.write(1, _state(1000, 2))
        w3 = f.write(1, _state(1000, 3))            # would overwrite the slot the read reads
        time.sleep(0.1)
        assert not w2.done()
        be.gated = lambda op, off: False
        be.gate.set()
        got = r.result(timeout=10)
        assert got.generation == 1 and _same(got[:3], _state(1000, 1))
        assert (w2.result(), w3.result()) == (2, 3)
    finally:
        be.gate.set()
        f.close()


def test_the_file_has_no_name_while_open_and_its_space_returns_at_close(tmp_path):
    f = _file(tmp_path)
    path = f.path
    assert not os.path.exists(path) and len(_open_fds_to(path)) == 1        # open, nameless
    f.write(0, _state(1, 1)).result()
    f.close()
    assert _open_fds_to(path) == []
    g = _file(tmp_path)                             # dropped without close(): the finalizer closes it
    assert len(_open_fds_to(path)) == 1
    del g
    gc.collect()
    assert _open_fds_to(path) == []


def test_a_killed_process_leaves_no_file_behind(tmp_path):
    code = ("import os, signal, sys\n"
            "from hf_slideformer.disk import UnitStateFile, PlainFileBackend\n"
            "f = UnitStateFile(sys.argv[1], [1 << 20], PlainFileBackend())\n"
            "print(os.path.exists(sys.argv[1]), flush=True)\n"
            "os.kill(os.getpid(), signal.SIGKILL)\n")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "state.bin")], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9 and proc.stdout.split() == ["False"], proc.stderr
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------------------- kvikio and CUDA
def _kvikio_or_skip():
    pytest.importorskip("kvikio", reason="kvikio is not installed (pip install 'hf-slideformer[nvme]')")
    if not torch.cuda.is_available():
        pytest.skip("kvikio moves data through the CUDA driver")


def test_kvikio_backend_round_trip(tmp_path):
    _kvikio_or_skip()
    be = make_backend("kvikio")
    assert be.name == "kvikio" and make_backend("auto").name == "kvikio"
    f = UnitStateFile(str(tmp_path / "s.bin"), NUMELS, be)
    pool = HostBufferPool(1, f.max_payload_bytes)
    try:
        for u, n in enumerate(NUMELS):
            f.write(u, _state(n, u)).result()
        with pool.acquire_one() as buf:
            got = f.read(2, buf).result()
            assert got.generation == 1 and _same(got[:3], _state(12345, 2))
    finally:
        f.close()
        pool.close()


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["kvikio", "plain"])
def test_device_tensors_go_to_disk_and_back(tmp_path, kind):
    if kind == "kvikio":
        _kvikio_or_skip()
    f = UnitStateFile(str(tmp_path / "s.bin"), NUMELS, make_backend(kind))
    try:
        for u, n in enumerate(NUMELS):
            f.write(u, tuple(t.cuda() for t in _state(n, u))).result()
        for u, n in enumerate(NUMELS):
            into = tuple(torch.full((n,), float("nan"), device="cuda") for _ in range(3))
            got = f.read(u, into).result()
            assert got.generation == 1 and _same([t.cpu() for t in got[:3]], _state(n, u))
        flat = torch.zeros(f.payload_bytes(1), dtype=torch.uint8, device="cuda")
        got = f.read(1, flat).result()
        assert got[0].is_cuda and _same([t.cpu() for t in got[:3]], _state(1000, 1))
    finally:
        f.close()
