"""The names of the files the engine creates under `nvme_path`, and the removal of those that a
killed process left behind.

Every such file is named `slide-<kind>-<host>-<pid>-<id>[-<part>].bin`: `kind` says what it holds
(`state`: a layer state file; `act`: a layer input of the nvme activation tier), `host` and `pid`
name the process that made it. Each file loses its name right after it is opened (`create_unlinked`):
its space comes back when it is closed or when the process ends, killed or not. A name remains only
when the process dies in the instant between the two calls; the next engine on that directory
removes such files, those of processes that no longer run on this host and nothing else: a live
process's files, files of other hosts and any file not named so are never touched.
"""
from __future__ import annotations

import contextlib
import logging
import os
import re
import uuid

from ..checkpoints.atomic_save import alive_elsewhere, host_name

__all__ = ["engine_file", "create_unlinked", "remove_leftovers", "ENGINE_FILE"]

logger = logging.getLogger(__name__)

KINDS = ("state", "act")
ENGINE_FILE = re.compile(r"^slide-(?P<kind>state|act)-(?P<host>[A-Za-z0-9_]+)-(?P<pid>\d+)-(?P<id>[0-9a-f]{12})"
                         r"(?:-(?P<part>\d+))?\.bin$")


def engine_file(directory: str, kind: str, part: int | None = None, file_id: str | None = None) -> str:
    """A fresh path `directory/slide-<kind>-<host>-<pid>-<id>[-<part>].bin` of this process."""
    if kind not in KINDS:
        raise ValueError(f"unknown engine file kind {kind!r}")
    file_id = file_id or uuid.uuid4().hex[:12]
    tail = "" if part is None else f"-{part}"
    return os.path.join(directory, f"slide-{kind}-{host_name()}-{os.getpid()}-{file_id}{tail}.bin")


def create_unlinked(path: str, opener):
    """Create `path` empty (it must not exist), open it with `opener(path)` and remove its name at
    once, opened or not. Returns (a plain read-write descriptor of the file, what `opener`
    returned): the caller sizes the file through the descriptor afterwards (and closes it), so a
    kill during a long preallocation leaves no name behind."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        return fd, opener(path)
    except BaseException:
        os.close(fd)
        raise
    finally:
        os.unlink(path)


def remove_leftovers(directory: str) -> list[str]:
    """Remove the engine files under `directory` that processes no longer running on this host left
    (a kill between a file's creation and its unlinking); returns the paths removed."""
    removed = []
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        for entry in os.listdir(directory):
            match = ENGINE_FILE.match(entry)
            if match is None or match["host"] != host_name() or int(match["pid"]) == os.getpid() \
                    or alive_elsewhere(match["host"], int(match["pid"])):
                continue
            path = os.path.join(directory, entry)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
                removed.append(path)
    if removed:
        logger.warning("removed %d file(s) that killed runs left under %s", len(removed), directory)
    return removed
