"""Crash-consistent saves: directories swapped in by renames, and what a killed save leaves behind.

A save that replaces a directory (a Trainer checkpoint, an Accelerate state) is written into a
hidden sibling and committed by renames (`staged_directory`). Every step is one rename, and every
state between two steps is either recognisable as unfinished or already complete:

    .tmp-<name>.<host>.<pid>.<ns>     being written: never read, removed by recovery
    .new-<name>.<host>.<pid>.<ns>     complete: recovery finishes the swap (rolls forward)
    .merge-<name>.<host>.<pid>.<ns>   complete, and the entries of <name> it lacks move into it
    .old-<name>.<host>.<pid>.<ns>     the replaced directory: removed once <name> is the new one
    .slide-save-model.<host>.<pid>.<ns>   `save_pretrained`'s staging folder inside its directory
                                          (see `checkpoint.save_model`): removed by the next save

Note: [Why a complete save is renamed before the swap] the swap takes two renames (`<name>` to
`.old-...`, then the new directory to `<name>`); a kill between them leaves no `<name>`. The
`.new-` name marks the new directory complete, so `recover_directories` (run by every save and
before every load of such a directory) renames it into place: the directory loads as the new
save. A kill before the `.new-` rename leaves `<name>` untouched: it loads as the old save.

Leftovers of a process that is still alive on this host are never touched (two saves into one
parent at the same time). Directories are created with `os.mkdir`, so they follow the umask.
"""
from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import socket
import threading
import time

__all__ = ["host_name", "alive_elsewhere", "ConcurrentSaveError", "one_save_at_a_time", "staged_directory", "recover_directories", "leftover_path", "remove_leftovers", "fsync_file",
           "fsync_dir", "fsync_tree", "final_paths_in_logs"]

logger = logging.getLogger(__name__)

_KINDS = ("tmp", "new", "merge", "old")
_LEFTOVER = re.compile(r"^\.(?P<kind>tmp|new|merge|old|slide-save)-(?P<name>.+)\.(?P<host>[A-Za-z0-9_]+)\.(?P<pid>\d+)\.(?P<ns>\d+)$")


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9_]", "_", socket.gethostname()) or "host"


class ConcurrentSaveError(RuntimeError):
    """Another save into the same directory is running in this process."""


_SAVING: set[str] = set()
_SAVING_LOCK = threading.Lock()


@contextlib.contextmanager
def one_save_at_a_time(directory: str):
    """The body is the only save into `directory` in this process; a second one (another thread)
    raises `ConcurrentSaveError` at once and leaves the first to complete (its clean-up of killed
    saves' leftovers would otherwise remove the running save's staging folder)."""
    key = os.path.realpath(directory)
    with _SAVING_LOCK:
        if key in _SAVING:
            raise ConcurrentSaveError(
                f"another save into the same folder {directory} ran concurrently (another thread of this process); "
                "this one did nothing and the other completes. Save into separate folders, or one after the other.")
        _SAVING.add(key)
    try:
        yield
    finally:
        with _SAVING_LOCK:
            _SAVING.discard(key)


def host_name() -> str:
    """This host's name as leftover names carry it (letters, digits and _ only)."""
    return _host()


def alive_elsewhere(host: str, pid: int) -> bool:
    """True when `pid` is another process that still runs on this host, `host` (it may be writing)."""
    return _alive_elsewhere(host, pid)


def leftover_path(parent: str, kind: str, name: str) -> str:
    """A fresh hidden path `parent/.<kind>-<name>.<host>.<pid>.<ns>` that recovery can attribute."""
    return os.path.join(parent, f".{kind}-{name}.{_host()}.{os.getpid()}.{time.time_ns()}")


def _parse(entry: str):
    match = _LEFTOVER.match(entry)
    return None if match is None else (match["kind"], match["name"], match["host"], int(match["pid"]), int(match["ns"]))


def _alive_elsewhere(host: str, pid: int) -> bool:
    """True for a leftover of another process that still runs on this host (its save is in progress)."""
    if host != _host() or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def fsync_file(path: str) -> None:
    """Flush a written file (or a directory's entries) to stable storage."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str) -> None:
    """Flush a directory's entries (its renames) to stable storage, where the platform allows it."""
    with contextlib.suppress(OSError):
        fsync_file(path)


def fsync_tree(path: str) -> None:
    """Flush every file and directory under `path` (before it is renamed into place)."""
    for root, _, files in os.walk(path):
        for file_name in files:
            with contextlib.suppress(OSError):
                fsync_file(os.path.join(root, file_name))
        fsync_dir(root)


def remove_leftovers(parent: str, kind: str) -> None:
    """Remove `.<kind>-*` entries of dead processes under `parent` (a killed save's staging folders)."""
    with contextlib.suppress(FileNotFoundError):
        for entry in os.listdir(parent):
            parsed = _parse(entry)
            if parsed is not None and parsed[0] == kind and not _alive_elsewhere(parsed[2], parsed[3]):
                shutil.rmtree(os.path.join(parent, entry), ignore_errors=True)


def _swap_in(parent: str, complete: str, name: str, merge: bool, old: str | None) -> None:
    """Rename the complete directory `complete` to `parent/name`, replacing what is there."""
    final = os.path.join(parent, name)
    if os.path.isdir(final):
        if merge:
            for entry in os.listdir(final):
                if not os.path.lexists(os.path.join(complete, entry)):
                    os.rename(os.path.join(final, entry), os.path.join(complete, entry))
        old = old or leftover_path(parent, "old", name)
        if os.path.lexists(old):
            shutil.rmtree(old)
        os.rename(final, old)
    os.rename(complete, final)
    fsync_dir(parent)
    if old is not None and os.path.lexists(old):
        shutil.rmtree(old)


def recover_directories(parent: str, name: str | None = None) -> None:
    """Finish or undo the directory swaps that killed saves left in `parent` (only `name`'s, if given).

    A complete new directory (`.new-` / `.merge-`) is renamed into place; with none, a lone
    `.old-` directory goes back to its name; unfinished `.tmp-` directories and replaced
    `.old-` ones are removed. Idempotent: a kill during recovery is finished by the next one.
    """
    try:
        entries = os.listdir(parent)
    except FileNotFoundError:
        return
    groups: dict[str, list[tuple[str, str, int]]] = {}
    for entry in entries:
        parsed = _parse(entry)
        if (parsed is None or parsed[0] not in _KINDS or (name is not None and parsed[1] != name)
                or _alive_elsewhere(parsed[2], parsed[3])):
            continue
        groups.setdefault(parsed[1], []).append((parsed[0], entry, parsed[4]))
    for target, items in groups.items():
        final = os.path.join(parent, target)
        complete = sorted((ns, kind, e) for kind, e, ns in items if kind in ("new", "merge"))
        olds = [e for kind, e, _ in items if kind == "old"]
        for kind, leftover, _ in items:
            if kind == "tmp":
                shutil.rmtree(os.path.join(parent, leftover), ignore_errors=True)
        for _, _, leftover in complete[:-1]:
            shutil.rmtree(os.path.join(parent, leftover), ignore_errors=True)
        if complete:
            _, kind, leftover = complete[-1]
            logger.warning("finishing the interrupted save of %s", final)
            if os.path.isdir(final):
                for old in olds:
                    shutil.rmtree(os.path.join(parent, old), ignore_errors=True)
                _swap_in(parent, os.path.join(parent, leftover), target, kind == "merge", None)
            else:
                _swap_in(parent, os.path.join(parent, leftover), target, False, None)
                for old in olds:
                    shutil.rmtree(os.path.join(parent, old), ignore_errors=True)
        elif olds and not os.path.lexists(final):
            logger.warning("restoring %s: its replacement was not complete", final)
            os.rename(os.path.join(parent, olds[-1]), final)
            fsync_dir(parent)
            for old in olds[:-1]:
                shutil.rmtree(os.path.join(parent, old), ignore_errors=True)
        else:
            for old in olds:
                shutil.rmtree(os.path.join(parent, old), ignore_errors=True)


@contextlib.contextmanager
def staged_directory(final: str, merge: bool = False):
    """Yield an empty hidden sibling of `final`; on success it replaces `final` (crash-consistent).

    Args:
        final: the directory to write.
        merge: keep the entries of an existing `final` that the new save does not write (as a
            save in place would), instead of replacing the directory as a whole.

    An exception leaves `final` as it was and removes the sibling; a killed process leaves a
    state that `recover_directories` resolves to the old or the new directory (see the module
    docstring). Leftovers of earlier killed saves beside `final` are resolved first.
    """
    final = os.path.abspath(final)
    parent, name = os.path.dirname(final), os.path.basename(final)
    os.makedirs(parent, exist_ok=True)
    recover_directories(parent)
    tmp = leftover_path(parent, "tmp", name)
    os.mkdir(tmp)
    try:
        yield tmp
        fsync_tree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    complete = tmp.replace(os.sep + ".tmp-", os.sep + (".merge-" if merge else ".new-"), 1)
    os.rename(tmp, complete)
    fsync_dir(parent)
    _swap_in(parent, complete, name, merge, None)


class _PathFilter(logging.Filter):
    def __init__(self, tmp: str, final: str):
        super().__init__()
        self.tmp, self.final = tmp, final

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        if self.tmp in msg:
            record.msg, record.args = msg.replace(self.tmp, self.final), None
        return True


@contextlib.contextmanager
def final_paths_in_logs(tmp: str, final: str, loggers=("transformers", "")):
    """While saving into `tmp`, log messages that name it show `final` instead."""
    flt = _PathFilter(tmp, final)
    handlers = {h for n in loggers for h in logging.getLogger(n or None).handlers}
    for handler in handlers:
        handler.addFilter(flt)
    try:
        yield
    finally:
        for handler in handlers:
            handler.removeFilter(flt)
