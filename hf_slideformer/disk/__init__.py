"""Unit state on disk: master weights and AdamW moments (in the dtypes their state format declares)
of models larger than host memory,
kept in preallocated files and moved through a few pinned, aligned host buffers by I/O threads.

- `backends`: positional file I/O on threads, plain POSIX or kvikio (GPUDirect Storage).
- `space`: files created at full size up front, with a clear error when the disk is too small.
- `buffers`: the pool of aligned (pinned) host buffers.
- `records`: the state file's layout (each unit's arrays, dtypes and counts) and its headers.
- `unit_state`: the on-disk records of N units, crash-safe, read and written in order per unit.

- `disk_store`, `disk_record`, `disk_placement`: the store's units whose state is on disk, their
  records, and the placement that reads and writes them around each update; `disk_plan`: the split
  between host memory and disk.

The I/O modules import nothing of the engine; `disk_placement` builds on `engine.placements`.
docs/disk.md describes the layer.
"""
from .backends import (KVIKIO_INSTALL_HINT, BackendFile, DiskIOError, FileBackend, IOFuture, KvikioBackend,
                       PlainFileBackend, is_kvikio_available, make_backend)
from .buffers import ALIGN, BufferPoolError, HostBuffer, HostBufferPool, aligned_host_buffer
from .space import DiskSpaceError, preallocate
from .unit_state import UnitState, UnitStateError, UnitStateFile, record_layout

__all__ = ["KVIKIO_INSTALL_HINT", "BackendFile", "DiskIOError", "FileBackend", "IOFuture", "KvikioBackend",
           "PlainFileBackend", "is_kvikio_available", "make_backend", "ALIGN", "BufferPoolError", "HostBuffer",
           "HostBufferPool", "aligned_host_buffer", "DiskSpaceError", "preallocate", "UnitState", "UnitStateError",
           "UnitStateFile", "record_layout"]
