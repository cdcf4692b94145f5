"""A fixed pool of page-aligned host buffers for disk reads and writes, pinned where CUDA is.

State that lives on disk passes through a few of these buffers on its way to and from the CPU
update or the GPU. They are allocated once, at the size of the largest unit's record, aligned to
4096 bytes (what O_DIRECT and GPUDirect Storage need) and page-locked when CUDA is available so
that the copies to the device are DMA.
"""
from __future__ import annotations

import mmap
import threading
import weakref

import torch

from ..host.memory import PinnedBuffers

__all__ = ["ALIGN", "round_up", "aligned_host_buffer", "HostBuffer", "HostBufferPool", "BufferPoolError"]

ALIGN = 4096


def round_up(n: int, to: int = ALIGN) -> int:
    """`n` rounded up to a multiple of `to` (default: the I/O alignment)."""
    return (n + to - 1) // to * to


def aligned_host_buffer(nbytes: int) -> torch.Tensor:
    """A CPU uint8 tensor of `nbytes` bytes (rounded up to `ALIGN`) whose data starts on an `ALIGN`
    boundary: a private anonymous mapping, which the kernel aligns to a page."""
    size = round_up(max(nbytes, 1))
    if hasattr(mmap, "MAP_ANONYMOUS"):
        buffer = torch.frombuffer(mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS), dtype=torch.uint8)
    else:                                           # no anonymous mappings: over-allocate and slice
        raw = torch.empty(size + ALIGN, dtype=torch.uint8)
        skip = -raw.data_ptr() % ALIGN
        buffer = raw[skip:skip + size]
    assert buffer.data_ptr() % ALIGN == 0
    return buffer


class BufferPoolError(RuntimeError):
    """An acquire that could never be served: the pool is too small or closed, or its buffers
    were dropped without release()."""


class HostBuffer:
    """One buffer lent by a `HostBufferPool`: `.tensor` (uint8, aligned) until `release()`."""

    __slots__ = ("tensor", "index", "_pool", "__weakref__")

    def __init__(self, pool: HostBufferPool, index: int, tensor: torch.Tensor):
        self._pool, self.index, self.tensor = pool, index, tensor

    def release(self) -> None:
        """Give the buffer back (from any thread); the caller no longer uses `.tensor`."""
        self._pool.give_back(self)

    def __enter__(self) -> HostBuffer:
        return self

    def __exit__(self, *exc) -> None:
        if self.tensor is not None:
            self.release()


class HostBufferPool:
    """`count` aligned host buffers of `nbytes` bytes each, lent by `acquire` and given back by
    `HostBuffer.release`.

    `acquire(n)` blocks until n buffers are free and takes them all at once (two callers each
    holding half of what they need cannot happen). It never waits for what cannot come:

    Note: [Why an acquire raises instead of waiting forever] the pool raises `BufferPoolError`
    at once when the request is larger than the buffers that can still come back: `n` above
    `count` (the caller's declared need exceeds the pool), or buffers lost because the
    `HostBuffer` that held them was garbage-collected without `release()` (its holder dropped
    it, or the thread that held it ended). A lost buffer is never lent again: a view of its
    tensor may still be in use somewhere. A waiter wakes when a buffer is lost, not only when
    one is released, so the check needs no timeout.

    Args:
        count: how many buffers.
        nbytes: bytes per buffer (rounded up to 4096).
        pin: page-lock them (cudaHostRegister); None: when CUDA is available.
    """

    def __init__(self, count: int, nbytes: int, pin: bool | None = None):
        if count < 1:
            raise ValueError("a buffer pool needs at least one buffer")
        self.nbytes = round_up(max(nbytes, 1))
        self.pinned = PinnedBuffers(torch.cuda.is_available() if pin is None else pin)
        self._buffers = [self.pinned.adopt(aligned_host_buffer(self.nbytes)) for _ in range(count)]
        self._free = list(range(count))
        self._lent: dict[int, weakref.ref] = {}
        self._lost: set[int] = set()
        self._cond = threading.Condition(threading.RLock())     # a loss is noted from inside a GC
        self._closed = False

    @property
    def count(self) -> int:
        return len(self._buffers)

    def free_count(self) -> int:
        with self._cond:
            return len(self._free)

    def acquire(self, wanted: int = 1) -> list[HostBuffer]:
        """Take `wanted` buffers, waiting until they are free. Raises `BufferPoolError` when they never
        can be (see the Note) or the pool is closed."""
        if wanted < 1:
            raise ValueError("acquire at least one buffer")
        with self._cond:
            while True:
                if self._closed:
                    raise BufferPoolError("the host buffer pool is closed")
                usable = self.count - len(self._lost)
                if wanted > usable:
                    lost = (f"; {len(self._lost)} were dropped without release() and are lost (release each "
                            "HostBuffer, or use it as a context manager)" if self._lost else "")
                    raise BufferPoolError(
                        f"{wanted} host buffers asked for at once, but the pool has {usable} that can be lent{lost}. "
                        "Make the pool at least as large as the largest number any caller holds at once.")
                if len(self._free) >= wanted:
                    taken, self._free = self._free[:wanted], self._free[wanted:]
                    out = []
                    for index in taken:
                        buf = HostBuffer(self, index, self._buffers[index])
                        self._lent[index] = weakref.ref(buf, lambda _, index=index: self._lose(index))
                        out.append(buf)
                    return out
                self._cond.wait()

    def acquire_one(self) -> HostBuffer:
        """`acquire(1)[0]`."""
        return self.acquire(1)[0]

    def give_back(self, buf: HostBuffer) -> None:
        """`HostBuffer.release`: take `buf` back into the free list."""
        with self._cond:
            if buf.tensor is None or self._lent.get(buf.index, lambda: None)() is not buf:
                raise BufferPoolError(f"host buffer {buf.index} released twice, or not lent by this pool")
            del self._lent[buf.index]
            buf.tensor = None                       # a use after release fails at once
            self._free.append(buf.index)
            self._cond.notify_all()

    def _lose(self, index: int) -> None:
        with self._cond:
            if index in self._lent:                 # collected while lent: never released
                del self._lent[index]
                self._lost.add(index)
                self._cond.notify_all()

    def close(self) -> None:
        """Unpin the buffers and wake any waiter with an error; lent buffers must not be in use."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self.pinned.close()
