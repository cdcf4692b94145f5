"""Disk space taken up front: a state file is created at its full size before training starts, so a
disk that is too small is reported then, not in the middle of a step."""
from __future__ import annotations

import errno
import os
import shutil

__all__ = ["DiskSpaceError", "preallocate", "allocate", "check_room", "ZERO_BLOCK"]

GiB = 1024 ** 3
ZERO_BLOCK = 64 << 20          # bytes per write where the file system cannot allocate without writing
_NOT_SUPPORTED = {errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL, errno.ENOSYS}
_FULL = {errno.ENOSPC, errno.EDQUOT}


class DiskSpaceError(OSError):
    """The file system cannot hold a state file: the message names the path, the bytes needed and
    the bytes free, and what to do."""


def _no_space(path: str, nbytes: int, free: int | None, cause: str = "") -> DiskSpaceError:
    have = "an unknown number of" if free is None else f"{free} bytes ({free / GiB:.2f} GiB)"
    err = DiskSpaceError(
        errno.ENOSPC,
        f"{path} needs {nbytes} bytes ({nbytes / GiB:.2f} GiB) for unit state on disk, but its file system has "
        f"{have} free{cause}. Free space there, or point nvme_path to a directory on a larger disk.")
    err.filename = path
    return err


def _free_bytes(directory: str) -> int | None:
    try:
        return shutil.disk_usage(directory).free
    except OSError:
        return None


def _fill_zeros(fd: int, start: int, end: int) -> None:
    """Write zeros over [start, end): the allocation of a file system without fallocate."""
    block = bytes(min(ZERO_BLOCK, max(end - start, 0)))
    pos = start
    while pos < end:
        chunk = min(len(block), end - pos)
        pos += os.pwrite(fd, memoryview(block)[:chunk], pos)


def check_room(path: str, nbytes: int, have: int = 0) -> None:
    """Raise `DiskSpaceError` when the file system of `path` has less free space than the
    `nbytes - have` bytes a file there still needs (nothing is created)."""
    free = _free_bytes(os.path.dirname(os.path.abspath(path)))
    if free is not None and nbytes - have > free:
        raise _no_space(path, nbytes, free)


def allocate(fd: int, path: str, nbytes: int, have: int = 0) -> None:
    """Give the open file `fd` (of `path`, for messages; `have` bytes long now) exactly `nbytes`
    bytes with their blocks allocated: `os.posix_fallocate`, else zeros in blocks of `ZERO_BLOCK`.

    Raises:
        DiskSpaceError: the file system ran out of space.
        OSError: another failure, naming the path.
    """
    try:
        if have > nbytes:
            os.ftruncate(fd, nbytes)
        if nbytes > 0:
            try:
                os.posix_fallocate(fd, 0, nbytes)
            except AttributeError:                  # no posix_fallocate on this platform
                _fill_zeros(fd, have, nbytes)
            except OSError as e:
                if e.errno not in _NOT_SUPPORTED:
                    raise
                _fill_zeros(fd, have, nbytes)
    except OSError as e:
        if isinstance(e, DiskSpaceError):
            raise
        if e.errno in _FULL:
            free = _free_bytes(os.path.dirname(os.path.abspath(path)))
            raise _no_space(path, nbytes, free, f" (the allocation failed: {e.strerror})") from e
        raise OSError(e.errno, f"could not allocate {nbytes} bytes for {path}: {e.strerror}", path) from e


def preallocate(path: str, nbytes: int) -> None:
    """Create `path` (or resize an existing file) at exactly `nbytes` bytes with its blocks allocated
    (`allocate`). A file this call created is removed again when the space is not there.

    Raises:
        DiskSpaceError: the file system has less free space than the file still needs.
        OSError: another failure (a missing directory, no permission), naming the path.
    """
    if nbytes < 0:
        raise ValueError(f"cannot preallocate {nbytes} bytes")
    have = os.path.getsize(path) if os.path.exists(path) else 0
    check_room(path, nbytes, have)
    created = not os.path.exists(path)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        allocate(fd, path, nbytes, have)
    except OSError:
        if created:
            os.unlink(path)
        raise
    finally:
        os.close(fd)
