"""The nvme layer-input tier: each layer input in a nameless file, through a few pinned bounce
buffers and an I/O thread of its own (`FileTier`).
"""
from __future__ import annotations

import os
import queue
import threading
import uuid

import torch

from .activation_tiers import PinnedCpuTier
from ..disk.backends import FileBackend, make_backend
from ..disk.names import create_unlinked, engine_file, remove_leftovers

__all__ = ["FileTier"]


class FileTier(PinnedCpuTier):
    """Spill x_i to a file under `path` (NVMe tier) through a small pool of pinned bounce buffers.

    Host memory holds `buffers` activations' worth, not L. An I/O thread does the file work in
    the order it was asked for: in forward it waits for each d2h copy and writes the file; in
    backward it reads the files ahead of use (up to `buffers - 1` layers ahead of the one asked
    for). The main thread only issues the copies and waits when the disk is the bound: a save
    when every buffer is still being written, a load whose file is not read yet.

    The file reads and writes go through a disk backend (`disk.make_backend("auto")`: kvikio where
    it is installed and CUDA is there, else positional POSIX I/O on a small thread pool), so one
    layer input's file is written and read in several parts at once.

    Note: [Why the nvme tier's file work is on its own thread] with the writes and reads on the
    main thread, every layer of the forward would wait for its input to reach the disk before
    it could queue the next layer's kernels, and the GPU would idle through it. On a thread of its
    own the disk works while the GPU computes, and a step is bound by the larger of the two.
    """

    def __init__(self, streams, path: str, counter=None, pinned=None, buffers: int = 4,
                 backend: FileBackend | None = None):
        super().__init__(streams, counter, pinned)
        os.makedirs(path, exist_ok=True)
        remove_leftovers(path)                  # what killed runs left (disk/names.py)
        self.dir = path
        self.file_id = uuid.uuid4().hex[:12]
        self.files: dict[int, object] = {}      # layer_no -> the open, nameless file of its input
        self.sizes: dict[int, int] = {}         # layer_no -> bytes of its last write
        self.backend = backend or make_backend("auto")
        self._owns_backend = backend is None
        self.bounce: list[torch.Tensor | None] = [None] * buffers
        self.bounce_ev: list[object] = [None] * buffers   # the last h2d copy reading each buffer
        self.free: queue.Queue = queue.Queue()
        for buf_id in range(buffers):
            self.free.put(buf_id)
        self.jobs: queue.Queue = queue.Queue()
        self.reads: dict[int, tuple[threading.Event, int]] = {}    # layer_no -> (read done, its buffer)
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None

    def _file(self, layer_no):
        """Layer `layer_no`'s input file (I/O thread). Note: [Why the layer-input files have no name] each
        is unlinked right after it is created and opened (disk.names.create_unlinked), so no exit
        of the process, a kill included, leaves it behind; it is reused by every step."""
        file = self.files.get(layer_no)
        if file is None:
            fd, file = create_unlinked(engine_file(self.dir, "act", part=layer_no, file_id=self.file_id),
                                       self.backend.open)
            os.close(fd)
            self.files[layer_no] = file
        return file

    # ------------------------------------------------------------------ the I/O thread
    def _start(self) -> None:
        if self.thread is None:
            self.thread = threading.Thread(target=self._loop, name="slide-act-io", daemon=True)
            self.thread.start()

    def _loop(self) -> None:
        while True:
            job = self.jobs.get()
            try:
                if job is None:
                    return
                if self.error is None:
                    job[0](*job[1:])
            except BaseException as e:          # surfaced on the main thread at its next call
                self.error = e
            finally:
                if job is not None and job[-1] is not None:
                    job[-1].set()               # wake whoever waits for it, also after a failure
                self.jobs.task_done()

    def _write(self, layer_no, buf_id, ev, nbytes, done) -> None:
        try:
            ev.synchronize()                    # the d2h copy has landed in the bounce buffer
            self.sizes.pop(layer_no, None)
            self._file(layer_no).pwrite(self.bounce[buf_id], nbytes, 0).result()
            self.sizes[layer_no] = nbytes
        finally:
            self.free.put(buf_id)

    def _read(self, layer_no, buf_id, nbytes, done) -> None:
        ev = self.bounce_ev[buf_id]
        if ev is not None:
            ev.synchronize()                    # its previous h2d copy has read it
        if self.sizes.get(layer_no) != nbytes:
            raise OSError(f"layer input {layer_no} was not written in full "
                          f"({self.sizes.get(layer_no)} of {nbytes} bytes)")
        self._file(layer_no).pread(self.bounce[buf_id], nbytes, 0).result()

    def _check(self) -> None:
        if self.error is not None:
            err, self.error = self.error, None
            raise RuntimeError(
                f"the nvme activation tier failed on a file under {self.dir}: {err!r}. Free space there, point "
                "nvme_path to another disk, or use activation_tier='cpu'") from err

    def _wait(self, ev: threading.Event) -> None:
        while not ev.wait(0.05):
            if self.thread is None or not self.thread.is_alive():
                raise RuntimeError("the nvme activation tier's I/O thread has stopped")
        self._check()

    def _take(self, numel: int, dtype: torch.dtype, block: bool = True) -> int | None:
        """A free bounce buffer of at least `numel` elements (None when `block` is False and none is free)."""
        while True:
            self._check()
            try:
                buf_id = self.free.get(timeout=0.05) if block else self.free.get_nowait()
                break
            except queue.Empty:
                if not block:
                    return None
                if self.thread is None or not self.thread.is_alive():
                    raise RuntimeError("the nvme activation tier's I/O thread has stopped")
                if len(self.reads) >= len(self.bounce):      # would wait forever: a bug, not the disk
                    raise RuntimeError("internal: every nvme bounce buffer holds a layer input not yet loaded")
        old = self.bounce[buf_id]
        if old is None or old.numel() < numel or old.dtype != dtype:
            if self.bounce_ev[buf_id] is not None:
                self.bounce_ev[buf_id].synchronize()
                self.bounce_ev[buf_id] = None
            self.bounce[buf_id] = self._host_buffer(old, numel, dtype)
        return buf_id

    # ------------------------------------------------------------------ the tier
    def save(self, layer_no, hidden, remake=None):
        if self._keep(layer_no, hidden, remake):
            return
        self._start()
        buf_id = self._take(hidden.numel(), hidden.dtype)
        if self.bounce_ev[buf_id] is not None:
            self.bounce_ev[buf_id].synchronize()     # rare: a buffer read back in this step's backward
            self.bounce_ev[buf_id] = None
        ev = self._d2h(hidden, self.bounce[buf_id][:hidden.numel()])
        self.meta[layer_no] = (hidden.shape, hidden.dtype)
        self.saved_ev[layer_no] = None
        self.jobs.put((self._write, layer_no, buf_id, ev, hidden.numel() * hidden.element_size(), threading.Event()))

    def _request(self, layer_no: int, block: bool) -> bool:
        shape, dtype = self.meta[layer_no]
        buf_id = self._take(shape.numel(), dtype, block)
        if buf_id is None:
            return False
        done = threading.Event()
        self.reads[layer_no] = (done, buf_id)
        self.jobs.put((self._read, layer_no, buf_id, shape.numel() * torch.empty((), dtype=dtype).element_size(), done))
        return True

    def prefetch(self, layer_no):
        if not self._on_host(layer_no):
            return
        if layer_no not in self.reads:
            self._request(layer_no, block=True)
        # Read ahead while buffers are free, one always left for a blocking request.
        ahead = layer_no - 1
        while ahead >= 0 and len(self.reads) < len(self.bounce) - 1:
            if self._on_host(ahead) and ahead not in self.reads:
                if self.free.qsize() <= 1 or not self._request(ahead, block=False):
                    break
            ahead -= 1

    def _bring(self, layer_no) -> None:
        if layer_no in self.loaded:
            return
        self.prefetch(layer_no)
        done, buf_id = self.reads.pop(layer_no)
        try:
            self._wait(done)
        except BaseException:
            self.free.put(buf_id)
            raise
        hidden, ev = self._h2d(layer_no, self.bounce[buf_id])
        self.bounce_ev[buf_id] = ev
        self.free.put(buf_id)
        self.loaded[layer_no] = (hidden, ev)

    def clear(self):
        """A new forward: the file work of the last one is finished and its unread inputs let go."""
        if self.thread is not None:
            self.jobs.join()
        for done, buf_id in self.reads.values():
            self.free.put(buf_id)
        self.reads.clear()
        super().clear()
        self._check()

    def close(self):
        if self.thread is not None and self.thread.is_alive():
            self.jobs.put(None)
            self.thread.join(timeout=30)
        files, self.files = self.files, {}
        for file in files.values():
            file.close()
        if self._owns_backend:
            self.backend.close()
