"""File backends: positional reads and writes of tensors that run on I/O threads and return futures.

Two implementations behind one interface (`FileBackend`, whose `open` gives a `BackendFile`),
chosen once by `make_backend`:

- `PlainFileBackend`: `os.preadv` / `os.pwritev` on a thread pool of its own, each request split
  into tasks of `task_bytes`. Works on every POSIX system; the CPU tests cover the layers above
  with it. A CUDA tensor goes through a host copy.
- `KvikioBackend`: `kvikio.CuFile.pread` / `pwrite`, which split a request into tasks on kvikio's
  own thread pool. GPUDirect Storage moves CUDA tensors between the file and the device where the
  driver allows it; elsewhere kvikio's compatibility mode does POSIX I/O (through its own bounce
  buffers for CUDA tensors), with nothing to change here.
"""
from __future__ import annotations

import errno
import functools
import importlib
import logging
import os
from concurrent.futures import ThreadPoolExecutor

import torch

logger = logging.getLogger(__name__)

__all__ = ["DiskIOError", "IOFuture", "BackendFile", "FileBackend", "PlainFileBackend", "KvikioBackend",
           "make_backend", "is_kvikio_available", "KVIKIO_INSTALL_HINT"]

TASK_BYTES = 8 << 20          # one positional call of the plain backend (Linux moves at most ~2 GiB per call)
DEFAULT_THREADS = 8
KVIKIO_INSTALL_HINT = ("pip install 'hf-slideformer[nvme]' (kvikio for CUDA 13) or 'hf-slideformer[nvme-cu12]' "
                       "(CUDA 12), or use the 'plain' backend")
WHAT_TO_DO = "Check the disk (free space: df; errors: dmesg) or point nvme_path to another disk."


class DiskIOError(OSError):
    """A read or write of a file failed; the message names the file, the bytes and what to do."""


def _error(op: str, path: str, nbytes: int, offset: int, cause: BaseException | str) -> DiskIOError:
    code = getattr(cause, "errno", None) or errno.EIO
    err = DiskIOError(code, f"{op} of {nbytes} bytes at offset {offset} of {path} failed: {cause}. {WHAT_TO_DO}")
    err.filename = path
    return err


class IOFuture:
    """One read or write in flight. `result()` waits for it and returns the bytes moved.

    Note: [Why a failed request still waits for all its tasks] a request is split into tasks
    that run at once; when one fails, the others may still be writing into (or reading from)
    the caller's buffer. `result()` waits for every task before it raises, so a caller that
    reuses the buffer after the error never races a task still running.
    """

    def __init__(self, parts: list, nbytes: int, op: str, path: str, offset: int, keep=(), finish=None):
        self._parts = parts            # concurrent futures (.result()) or kvikio futures (.get())
        self._nbytes, self._op, self._path, self._offset = nbytes, op, path, offset
        self._keep = keep              # the buffers the tasks use stay alive until the result is taken
        self._finish = finish          # run once the tasks are done (a staged copy into a CUDA tensor)
        self._outcome: tuple[int | None, BaseException | None] | None = None

    def done(self) -> bool:
        if self._outcome is not None:
            return True
        return all(p.done() for p in self._parts)

    def result(self) -> int:
        if self._outcome is None:
            moved, first = 0, None
            for part in self._parts:
                try:
                    moved += part.result() if hasattr(part, "result") else part.get()
                except BaseException as e:          # noqa: BLE001 - every part is waited for first
                    first = first or e
            if first is None and moved != self._nbytes:
                first = f"{moved} bytes moved (end of file?)"
            if first is None and self._finish is not None:
                try:
                    self._finish()
                except BaseException as e:          # noqa: BLE001
                    first = e
            err = None if first is None else _error(self._op, self._path, self._nbytes, self._offset, first)
            if err is not None and isinstance(first, BaseException):
                err.__cause__ = first
            self._outcome = (moved, err)
            self._keep = self._finish = None
        moved, err = self._outcome
        if err is not None:
            raise err
        return moved


def _bytes(tensor: torch.Tensor, nbytes: int) -> torch.Tensor:
    """The first `nbytes` bytes of a contiguous tensor, as a flat uint8 view of its memory."""
    if not tensor.is_contiguous():
        raise ValueError("disk I/O needs a contiguous tensor")
    flat = tensor.detach().reshape(-1).view(torch.uint8)
    if flat.numel() < nbytes:
        raise ValueError(f"a buffer of {flat.numel()} bytes cannot hold {nbytes}")
    return flat[:nbytes]


class BackendFile:
    """An open file: positional reads into and writes from contiguous tensors (CPU or CUDA)."""

    path: str

    def pread(self, buf: torch.Tensor, nbytes: int, offset: int) -> IOFuture:
        """Read `nbytes` at `offset` into the first `nbytes` bytes of `buf`."""
        raise NotImplementedError

    def pwrite(self, buf: torch.Tensor, nbytes: int, offset: int) -> IOFuture:
        """Write the first `nbytes` bytes of `buf` at `offset`."""
        raise NotImplementedError

    def fileno(self) -> int:
        raise NotImplementedError

    def sync(self) -> None:
        """Make every completed write durable (fdatasync)."""
        os.fdatasync(self.fileno())

    def close(self) -> None:
        raise NotImplementedError


class FileBackend:
    """Opens files for positional I/O; one per process part that does disk work."""

    name = "?"

    def open(self, path: str) -> BackendFile:
        """Open an existing file for reading and writing."""
        raise NotImplementedError

    def close(self) -> None:
        """Stop the backend's own threads (files opened from it must be closed first)."""

    def write_file(self, path: str, buf: torch.Tensor, nbytes: int) -> None:
        """Create (or truncate) `path` and write the first `nbytes` bytes of `buf` to it."""
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600))
        handle = self.open(path)
        try:
            handle.pwrite(buf, nbytes, 0).result()
        finally:
            handle.close()

    def read_file(self, path: str, buf: torch.Tensor, nbytes: int) -> None:
        """Read the whole of `path`, which must hold exactly `nbytes` bytes, into `buf`."""
        size = os.path.getsize(path)
        if size != nbytes:
            raise _error("read", path, nbytes, 0, f"the file holds {size} bytes")
        handle = self.open(path)
        try:
            handle.pread(buf, nbytes, 0).result()
        finally:
            handle.close()


# ---------------------------------------------------------------------------------------- plain
def _pread_all(fd: int, mv: memoryview, offset: int) -> int:
    done = 0
    while done < len(mv):
        if hasattr(os, "preadv"):
            moved = os.preadv(fd, [mv[done:]], offset + done)
        else:                                       # no preadv (macOS < 11): one copy more
            data = os.pread(fd, len(mv) - done, offset + done)
            moved = len(data)
            mv[done:done + moved] = data
        if moved == 0:
            raise OSError(errno.EIO, f"end of file after {done} of {len(mv)} bytes")
        done += moved
    return done


def _pwrite_all(fd: int, mv: memoryview, offset: int) -> int:
    done = 0
    while done < len(mv):
        moved = os.pwritev(fd, [mv[done:]], offset + done) if hasattr(os, "pwritev") else \
            os.pwrite(fd, mv[done:], offset + done)
        done += moved
    return done


class _PlainFile(BackendFile):
    def __init__(self, backend: PlainFileBackend, path: str):
        self.backend, self.path = backend, path
        self.fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)

    def fileno(self) -> int:
        return self.fd

    def _submit(self, fn, host: torch.Tensor, nbytes: int, offset: int) -> list:
        mv = memoryview(host.numpy())
        step = self.backend.task_bytes
        return [self.backend.pool.submit(fn, self.fd, mv[a:min(a + step, nbytes)], offset + a)
                for a in range(0, nbytes, step)]

    def pread(self, buf, nbytes, offset):
        dst = _bytes(buf, nbytes)
        host = dst if dst.device.type == "cpu" else torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        finish = None if host is dst else (lambda: dst.copy_(host))
        try:
            parts = self._submit(_pread_all, host, nbytes, offset)
        except Exception as e:                      # noqa: BLE001 - the pool was shut down, say
            raise _error("read", self.path, nbytes, offset, e) from e
        return IOFuture(parts, nbytes, "read", self.path, offset, keep=(host, buf), finish=finish)

    def pwrite(self, buf, nbytes, offset):
        src = _bytes(buf, nbytes)
        host = src if src.device.type == "cpu" else src.cpu()
        try:
            parts = self._submit(_pwrite_all, host, nbytes, offset)
        except Exception as e:                      # noqa: BLE001
            raise _error("write", self.path, nbytes, offset, e) from e
        return IOFuture(parts, nbytes, "write", self.path, offset, keep=(host, buf))

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class PlainFileBackend(FileBackend):
    """POSIX positional I/O on a thread pool of `threads` threads, in tasks of `task_bytes`."""

    name = "plain"

    def __init__(self, threads: int | None = None, task_bytes: int = TASK_BYTES):
        if task_bytes <= 0:
            raise ValueError("task_bytes must be positive")
        self.task_bytes = task_bytes
        self.threads = threads or min(DEFAULT_THREADS, os.cpu_count() or 1)
        self.pool = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="slide-disk")

    def open(self, path: str) -> BackendFile:
        return _PlainFile(self, path)

    def close(self) -> None:
        self.pool.shutdown(wait=True)


# ---------------------------------------------------------------------------------------- kvikio
@functools.lru_cache(maxsize=None)
def is_kvikio_available() -> bool:
    """True when kvikio imports (its libraries load) here."""
    try:
        importlib.import_module("kvikio")
    except Exception:                               # noqa: BLE001 - not installed, or a library missing
        return False
    return True


def _kvikio():
    try:
        return importlib.import_module("kvikio")
    except Exception as e:                          # noqa: BLE001
        raise ImportError(f"the 'kvikio' disk backend needs kvikio, which does not import here ({e}): "
                          f"{KVIKIO_INSTALL_HINT}") from e


def _kvikio_buffer(tensor: torch.Tensor):
    """What kvikio reads into / writes from: a CUDA tensor as it is (its __cuda_array_interface__,
    uint8 so that bf16 passes), a CPU tensor as a NumPy view (the buffer protocol)."""
    return tensor if tensor.device.type == "cuda" else tensor.numpy()


class _KvikioFile(BackendFile):
    def __init__(self, kvikio, path: str):
        self.path = path
        try:
            self.f = kvikio.CuFile(path, "r+")
        except Exception as e:                      # noqa: BLE001
            raise _error("open", path, 0, 0, e) from e

    def fileno(self) -> int:
        return self.f.fileno()

    def _io(self, op: str, buf, nbytes: int, offset: int) -> IOFuture:
        view = _bytes(buf, nbytes)
        arg = _kvikio_buffer(view)
        try:
            fut = (self.f.pread if op == "read" else self.f.pwrite)(arg, nbytes, offset)
        except Exception as e:                      # noqa: BLE001 - raised before any task started
            raise _error(op, self.path, nbytes, offset, e) from e
        return IOFuture([fut], nbytes, op, self.path, offset, keep=(arg, view, buf))

    def pread(self, buf, nbytes, offset):
        return self._io("read", buf, nbytes, offset)

    def pwrite(self, buf, nbytes, offset):
        return self._io("write", buf, nbytes, offset)

    def close(self) -> None:
        if not self.f.closed:
            self.f.close()


class KvikioBackend(FileBackend):
    """kvikio's CuFile: GPUDirect Storage where the driver allows it, its POSIX compatibility mode
    elsewhere. CUDA tensors are read into and written from directly.

    Args:
        threads: size of kvikio's thread pool (a process-wide kvikio setting). None keeps what
            `KVIKIO_NTHREADS` says where it is set, else sets `DEFAULT_THREADS` (kvikio's own
            default is one thread, which serialises every request).
        compat: None keeps kvikio's compatibility-mode setting (AUTO: GDS where available);
            True forces POSIX I/O, False requires GDS.
    """

    name = "kvikio"

    def __init__(self, threads: int | None = None, compat: bool | None = None):
        self.kvikio = kv = _kvikio()
        self.defaults = importlib.import_module("kvikio.defaults")    # a submodule `import kvikio` leaves out
        if threads is None and "KVIKIO_NTHREADS" not in os.environ:    # kvikio's own variable
            threads = DEFAULT_THREADS
        if threads is not None:
            self._set("num_threads", threads)
        if compat is not None:
            self._set("compat_mode", kv.CompatMode.ON if compat else kv.CompatMode.OFF)
        self.gds = self._gds_available()
        logger.info("kvikio %s disk backend: %s, %s threads", getattr(kv, "__version__", "?"),
                    "GPUDirect Storage available" if self.gds else "POSIX compatibility mode",
                    self._get("num_threads"))

    def _set(self, key: str, value) -> None:
        defaults = self.defaults
        if hasattr(defaults, "set"):
            defaults.set(key, value)
        else:                                       # kvikio before 25.04: one reset function per setting
            getattr(defaults, f"{key}_reset")(value)

    def _get(self, key: str):
        try:
            return self.defaults.get(key)
        except Exception:                           # noqa: BLE001 - an older kvikio
            return None

    def _gds_available(self) -> bool | None:
        try:
            driver = importlib.import_module("kvikio.cufile_driver")
            return bool(driver.get("is_gds_available"))
        except Exception:                           # noqa: BLE001 - an older kvikio, or no driver
            return None

    def open(self, path: str) -> BackendFile:
        return _KvikioFile(self.kvikio, path)


def make_backend(kind: str = "auto", threads: int | None = None) -> FileBackend:
    """The backend named by `kind`: 'plain', 'kvikio', or 'auto' (kvikio where it imports and CUDA
    is available, else plain, silently). kvikio does every request through the CUDA driver, so
    without a GPU it could not move even host memory."""
    if kind == "plain":
        return PlainFileBackend(threads)
    if kind == "kvikio":
        return KvikioBackend(threads)
    if kind == "auto":
        if is_kvikio_available() and torch.cuda.is_available():
            return KvikioBackend(threads)
        return PlainFileBackend(threads)
    raise ValueError(f"unknown disk backend {kind!r}: one of 'auto', 'kvikio', 'plain'")
