"""One writer per directory: a lock file naming its owner (host, pid, process start time, run id).

:func:`acquire` takes the lock of a directory for a run, or confirms that the run already holds it; it is
cheap enough to call before every save. The check-and-take is atomic: it runs under ``flock`` on the
directory itself, and the lock file is written to a temporary name and renamed into place, so no process
ever reads half a lock. A lock whose owner is gone (same host, and that process no longer runs: its pid is
free or belongs to a process started later) is taken over with a warning; a live owner, or one on another
host whose life cannot be checked from here, raises :class:`LockHeld` naming it. Locks a process holds are
released by :func:`release` or when the process exits normally; a killed process leaves its lock behind, for
the next writer to take over.

A forked child inherits its parent's run ids, so it counts as the same writer (as a forked training worker
is part of its parent's run).

Example::

    >>> import tempfile
    >>> from lightning_memkit.pipeline.writer_lock import acquire, owner, release
    >>> d = tempfile.mkdtemp()
    >>> acquire(d, "run-a")
    >>> owner(d)["run_id"]
    'run-a'
    >>> acquire(d, "run-a")                   # the same run again: nothing to do
    >>> release(d, "run-a"), owner(d)
    (True, None)
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import socket
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: the rename is all the atomicity there is
    fcntl = None  # type: ignore[assignment]

__all__ = ["LOCK_FILE", "LockHeld", "acquire", "owner", "release"]

LOCK_FILE = ".memkit-writer.lock"
_HELD: dict[str, str] = {}  # lock file path -> the run id this process holds it for


class LockHeld(RuntimeError):
    """The directory's lock belongs to another writer; ``owner`` is its record, ``path`` the lock file."""

    def __init__(self, path: Path, record: dict[str, Any], why: str) -> None:
        self.path, self.owner = str(path), record
        who = f"host {record.get('host')!r}, pid {record.get('pid')}, run id {record.get('run_id')!r}"
        super().__init__(f"another writer holds {path} ({who}, since {record.get('since', '?')}): {why}")


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (``/proc/<pid>/stat``), or ``None`` where unreadable."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rpartition(")")[2].split()[19]


def _alive(record: dict[str, Any]) -> bool:
    """Whether the owner process, on this host, still runs (a pid reused by a later process does not count)."""
    pid = record.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # somebody else's live process
        pass
    started = _start_time(pid)
    return started is None or record.get("start") in (None, started)


def _record(run_id: str) -> dict[str, Any]:
    pid = os.getpid()
    return {"host": socket.gethostname(), "pid": pid, "start": _start_time(pid), "run_id": run_id,
            "since": time.strftime("%Y-%m-%d %H:%M:%S")}


def _read(path: Path) -> dict[str, Any] | None:
    try:
        record = json.loads(path.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:  # not ours to guess at: a writer that cannot tell refuses
        return {"host": "?", "pid": None, "run_id": None, "unreadable": f"{type(err).__name__}: {err}"}
    return record if isinstance(record, dict) else {"host": "?", "pid": None, "run_id": None}


def _write(path: Path, record: dict[str, Any]) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(record, sort_keys=True) + "\n")
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(OSError):  # on a read-only file system even a missing file raises EROFS
            tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def _exclusive(directory: Path) -> Iterator[None]:
    """Hold ``flock`` on ``directory`` (blocking: another process's check-and-take lasts milliseconds)."""
    if fcntl is None:  # pragma: no cover
        yield
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing drops the flock


def _verdict(record: dict[str, Any], run_id: str, held: str | None) -> str:
    """``"ours"``, ``"stale"`` (take over) or why the lock must be left to its owner; ``held``: the run id this
    process holds the lock for (:data:`_HELD`), if any."""
    if record.get("run_id") == run_id and record.get("host") == socket.gethostname():
        return "ours"
    if "unreadable" in record:
        return f"the lock file is unreadable ({record['unreadable']}); delete it if no other run writes here"
    if record.get("host") != socket.gethostname():
        return "that host's processes cannot be checked from here; if that run is gone, delete the lock file"
    if record.get("pid") == os.getpid() and held != record.get("run_id"):
        return "stale"  # an earlier run of this process that ended without releasing it
    if _alive(record):
        same = " (another run in this process)" if record.get("pid") == os.getpid() else ""
        return f"that process is still running{same}; stop it, or give this run another directory"
    return "stale"


def acquire(directory: str | os.PathLike, run_id: str) -> None:
    """Take the writer lock of ``directory`` for ``run_id``, or confirm that ``run_id`` holds it.

    Raises :class:`LockHeld` when another live writer, or one that cannot be checked, holds it.
    """
    directory = Path(directory)
    path = directory / LOCK_FILE
    with _exclusive(directory):
        record = _read(path)
        if record is not None:
            verdict = _verdict(record, run_id, _HELD.get(str(path)))
            if verdict not in ("ours", "stale"):
                raise LockHeld(path, record, verdict)
            if verdict == "stale":
                warnings.warn(f"taking over {path}: its owner (host {record.get('host')!r}, pid {record.get('pid')}, "
                              f"run id {record.get('run_id')!r}) is no longer running", stacklevel=2)
        if record is None or record.get("run_id") != run_id or not _alive(record):
            _write(path, _record(run_id))  # new, taken over, or ours from a forked child that has exited
    _HELD[str(path)] = run_id


def release(directory: str | os.PathLike, run_id: str) -> bool:
    """Remove the lock of ``directory`` if ``run_id`` holds it; whether it did."""
    directory = Path(directory)
    path = directory / LOCK_FILE
    if not directory.is_dir():
        _HELD.pop(str(path), None)
        return False
    with _exclusive(directory):
        record = _read(path)
        mine = record is not None and _verdict(record, run_id, _HELD.get(str(path))) == "ours"
        if mine:
            path.unlink(missing_ok=True)
    if _HELD.get(str(path)) == run_id:
        del _HELD[str(path)]
    return mine


def owner(directory: str | os.PathLike) -> dict[str, Any] | None:
    """The record of the writer holding ``directory``'s lock, or ``None``."""
    return _read(Path(directory) / LOCK_FILE)


@atexit.register
def _release_all() -> None:
    """At a normal exit, give back the locks this process took (a forked child leaves its parent's alone)."""
    pid = os.getpid()
    for path, run_id in list(_HELD.items()):
        record = _read(Path(path))
        if record is not None and record.get("pid") == pid and record.get("run_id") == run_id:
            with contextlib.suppress(OSError):
                Path(path).unlink()
