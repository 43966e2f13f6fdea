"""Crash-consistent sharded checkpoints: one shard per rank, committed by a manifest written last.

A checkpoint is a directory::

    last.ckpt/
      manifest.json                      # written last, atomically, by rank 0: the commit record
      rank_00000-<save_id>.ckpt          # torch.save({"memkit_shard": record, "checkpoint": state})
      rank_00001-<save_id>.ckpt

Every file is written to a temporary name in the same directory, flushed, fsynced and renamed with
``os.replace``. Shard names carry the save id, so a new save never touches a shard the committed manifest
lists; the manifest (format, version, save id, global step, epoch, world size and, per shard, its rank,
file name, size in bytes and sha256, hashed while writing) replaces the previous one only after every
rank's shard is on disk, and stale files of earlier saves are removed only after that. A crash at any
point of a save therefore leaves the previous checkpoint loadable. Loading checks the manifest, every
listed shard's presence, size and checksum, and the save id, step, epoch and rank recorded inside the
shard; anything else raises :class:`CheckpointError` naming the file.

Pure torch and stdlib; collectives are passed in (``barrier``, ``all_gather``) or taken from
``torch.distributed`` when it is initialized.

Example::

    >>> import tempfile, torch
    >>> from lightning_memkit.pipeline.checkpoint import load_shard, save_sharded
    >>> d = tempfile.mkdtemp()
    >>> manifest = save_sharded(d, {"state_dict": {"w": torch.ones(2)}}, global_step=3, epoch=0)
    >>> manifest["global_step"], load_shard(d, 0)["state_dict"]["w"]
    (3, tensor([1., 1.]))
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import secrets
import shutil
import warnings
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import IO, Any

import torch

from lightning_memkit.common.validation import check_int
from lightning_memkit.measure.storage import unique_storage_bytes
from lightning_memkit.pipeline import writer_lock

__all__ = [
    "CheckpointError",
    "FORMAT",
    "MANIFEST",
    "VERSION",
    "load_committed_shard",
    "load_shard",
    "merge_state_dicts",
    "new_save_id",
    "read_manifest",
    "remove_stale",
    "save_sharded",
    "shard_name",
    "verify_checkpoint",
    "write_manifest",
    "write_shard",
]

FORMAT = "memkit_pipeline"
VERSION = 2  # 1: per-rank rank_NNNNN.ckpt + meta.json, no save id or checksums (refused)
MANIFEST = "manifest.json"
_LEGACY_META = "meta.json"
_RECORD = "memkit_shard"
_SHARD_RE = re.compile(r"rank_\d{5}-[0-9a-f]{1,64}\.ckpt")
_TEMP_RE = re.compile(r"\.(manifest\.json|rank_\d{5}-[0-9a-f]{1,64}\.ckpt)\.\d+\.tmp")
_LEGACY_RE = re.compile(r"rank_\d{5}\.ckpt|meta\.json")
_CHUNK = 1 << 20
_MANIFEST_FIELDS = {
    "format": str, "version": int, "save_id": str, "global_step": int, "epoch": int, "world_size": int,
    "shards": list, "meta": dict,
}
_SHARD_FIELDS = {"rank": int, "file": str, "bytes": int, "sha256": str}


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete, corrupt or inconsistent; ``path`` is the offending file."""

    def __init__(self, path: str | os.PathLike, message: str) -> None:
        self.path = str(path)
        super().__init__(f"{self.path}: {message}")


# -- writing ---------------------------------------------------------------------------------------------------
class _HashingWriter:
    """A write-only file wrapper that counts the bytes and hashes them on the way to disk."""

    def __init__(self, file: IO[bytes]) -> None:
        self.file = file
        self.size = 0
        self.error: OSError | None = None  # the first OSError, kept: torch's writer reports it as "unexpected pos"
        self._sha = hashlib.sha256()

    def write(self, data: Any) -> int:
        try:
            n = self.file.write(data)
        except OSError as err:
            self.error = self.error or err
            raise
        self._sha.update(data)
        self.size += len(data)
        return n

    def flush(self) -> None:
        try:
            self.file.flush()
        except OSError as err:
            self.error = self.error or err
            raise

    def hexdigest(self) -> str:
        return self._sha.hexdigest()


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # platforms that cannot open a directory (Windows): the rename is all we get
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _errno_name(err: OSError, default: str) -> str:
    """``'ENOSPC'`` for an ``OSError`` with that errno; ``default`` when it has none."""
    return errno.errorcode.get(err.errno or 0, default)


def _named_write_error(target: Path, err: OSError, needed: int | None, written: int) -> CheckpointError:
    """The cause of a failed write in words: out of space (with the bytes), file size limit, permission, I/O."""
    need = "" if needed is None else f"; its tensors alone take {needed:,} bytes"
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        free = shutil.disk_usage(target.parent).free
        cause = "ENOSPC, no space left" if err.errno == errno.ENOSPC else "EDQUOT, disk quota exceeded"
        return CheckpointError(target, f"out of space on the file system of {target.parent} ({cause}) after "
                                       f"{written:,} bytes{need}; {free:,} bytes free with the partial file removed")
    if err.errno == errno.EFBIG:
        return CheckpointError(target, f"the file size limit (EFBIG: RLIMIT_FSIZE, ulimit -f) stopped the write "
                                       f"at {written:,} bytes{need}")
    if isinstance(err, PermissionError) or err.errno == errno.EROFS:
        return CheckpointError(target, f"cannot write in {target.parent}: {err.strerror or err} "
                                       f"({_errno_name(err, 'EACCES')})")
    return CheckpointError(target, f"write failed after {written:,} bytes: {err.strerror or err} "
                                   f"({_errno_name(err, type(err).__name__)})")


def _check_free_space(target: Path, needed: int) -> None:
    """Refuse before writing when the file system of ``target`` cannot hold ``needed`` bytes (a lower bound)."""
    try:
        st = os.statvfs(target.parent)
    except (OSError, AttributeError):  # no statvfs (Windows): the write itself will tell
        return
    free = (st.f_bfree if os.geteuid() == 0 else st.f_bavail) * st.f_frsize
    if needed > free:
        raise CheckpointError(target, f"out of space on the file system of {target.parent} (ENOSPC): its tensors "
                                      f"alone take {needed:,} bytes, {free:,} bytes free; nothing was written")


def _atomic_write(target: Path, write: Callable[[_HashingWriter], Any], needed: int | None = None) -> tuple[int, str]:
    """Write ``target`` through a same-directory temporary file, fsync it and rename it into place.

    ``needed`` (a lower bound of the size, when known) is checked against the free space first. An ``OSError``
    on the way (also one that torch's writer reports as its own ``RuntimeError``) becomes a
    :class:`CheckpointError` naming its cause; the temporary file is removed either way.
    """
    if needed is not None:
        _check_free_space(target, needed)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    writer: _HashingWriter | None = None
    try:
        with open(tmp, "wb") as f:
            writer = _HashingWriter(f)
            write(writer)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException as err:
        with contextlib.suppress(OSError):  # on a read-only file system even a missing file raises EROFS
            tmp.unlink(missing_ok=True)
        cause = err if isinstance(err, OSError) else writer.error if writer is not None else None
        if isinstance(cause, OSError) and not isinstance(err, (KeyboardInterrupt, SystemExit)):
            written = writer.size if writer is not None else 0
            raise _named_write_error(target, cause, needed, written) from err
        raise
    _fsync_dir(target.parent)
    return writer.size, writer.hexdigest()


def new_save_id() -> str:
    """A fresh random save id (16 hex digits); every rank of one save must use the same one.

    >>> len(new_save_id()), new_save_id() != new_save_id()
    (16, True)
    """
    return secrets.token_hex(8)


def shard_name(rank: int, save_id: str) -> str:
    """The file name of ``rank``'s shard in save ``save_id``.

    >>> shard_name(1, "00ff")
    'rank_00001-00ff.ckpt'
    """
    name = f"rank_{rank:05d}-{save_id}.ckpt"
    if not _SHARD_RE.fullmatch(name):
        raise ValueError(f"save_id={save_id!r} must be 1 to 64 lowercase hex digits")
    return name


def _record(save_id: str, rank: int, global_step: int, epoch: int) -> dict[str, Any]:
    return {"format": FORMAT, "version": VERSION, "save_id": save_id, "rank": rank, "global_step": global_step,
            "epoch": epoch}


def write_shard(
    directory: str | os.PathLike, state: Any, *, rank: int, save_id: str, global_step: int, epoch: int
) -> dict[str, Any]:
    """Write ``rank``'s shard of save ``save_id`` atomically; return its manifest entry (hashed while writing).

    >>> import tempfile
    >>> entry = write_shard(tempfile.mkdtemp(), {"x": 1}, rank=0, save_id="ab", global_step=5, epoch=1)
    >>> entry["file"], entry["bytes"] > 0, len(entry["sha256"])
    ('rank_00000-ab.ckpt', True, 64)
    """
    name = shard_name(rank, save_id)
    payload = {_RECORD: _record(save_id, rank, global_step, epoch), "checkpoint": state}
    size, sha = _atomic_write(Path(directory) / name, lambda f: torch.save(payload, f),
                              needed=unique_storage_bytes(state))
    return {"rank": rank, "file": name, "bytes": size, "sha256": sha}


def write_manifest(directory: str | os.PathLike, manifest: Mapping[str, Any]) -> None:
    """Commit a save: write ``manifest.json`` atomically (after every shard it lists is on disk).

    >>> import tempfile
    >>> d = tempfile.mkdtemp()
    >>> write_manifest(d, {"format": "memkit_pipeline"})
    >>> (Path(d) / MANIFEST).is_file()
    True
    """
    data = (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode()
    _atomic_write(Path(directory) / MANIFEST, lambda f: f.write(data))


def remove_stale(directory: str | os.PathLike, manifest: Mapping[str, Any]) -> list[str]:
    """Delete this format's files that ``manifest`` does not list (earlier saves, temporaries, the old format).

    Other files in the directory are left alone. Returns the names removed.

    >>> import tempfile
    >>> d = Path(tempfile.mkdtemp())
    >>> _ = (d / "rank_00000-01.ckpt").write_bytes(b""), (d / "notes.txt").write_text("mine")
    >>> remove_stale(d, {"shards": []}), sorted(p.name for p in d.iterdir())
    (['rank_00000-01.ckpt'], ['notes.txt'])
    """
    directory = Path(directory)
    keep = {MANIFEST, *(entry["file"] for entry in manifest["shards"])}
    removed = []
    for path in sorted(directory.iterdir()):
        if path.name not in keep and _is_ours(path.name) and path.is_file():
            path.unlink(missing_ok=True)
            removed.append(path.name)
    if removed:
        _fsync_dir(directory)
    return removed


def _is_ours(name: str) -> bool:
    return any(p.fullmatch(name) for p in (_SHARD_RE, _TEMP_RE, _LEGACY_RE))


# -- collectives -----------------------------------------------------------------------------------------------
def _dist_ready() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _default_barrier(name: str) -> None:
    if _dist_ready():
        torch.distributed.barrier()


def _default_all_gather(obj: Any) -> list[Any]:
    if not _dist_ready():
        return [obj]
    out: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, obj)
    return out


# -- saving ----------------------------------------------------------------------------------------------------
def _error_text(err: Exception) -> str:
    return str(err) if isinstance(err, CheckpointError) else f"{type(err).__name__}: {err}"


def _try_write_shard(directory: Path, state: Any, **kwargs: Any) -> tuple[dict[str, Any] | None, str | None]:
    try:
        if not directory.is_dir():
            directory.mkdir(parents=True, exist_ok=True)
        return write_shard(directory, state, **kwargs), None
    except OSError as err:  # the directory itself
        return None, _error_text(_named_write_error(directory, err, None, 0))
    except Exception as err:  # noqa: BLE001 - reported to every rank, re-raised below
        return None, _error_text(err)


def _commit_or_raise(directory: Path, manifest: dict[str, Any], rank: int,
                     all_gather: Callable[[Any], list[Any]]) -> None:
    """Rank 0 writes the manifest; every rank learns the outcome (a failed commit raises the same on all)."""
    error = None
    if rank == 0:
        try:
            write_manifest(directory, manifest)
        except Exception as err:  # noqa: BLE001 - reported to every rank, re-raised below
            error = _error_text(err)
    failures = [e for e in all_gather(error) if e is not None]
    if failures:
        raise CheckpointError(directory, f"the commit failed ({failures[0]}); the previous checkpoint (if any) is "
                                         "intact")


def _entries_or_raise(directory: Path, results: list[Any], rank: int, world_size: int) -> list[dict[str, Any]]:
    if len(results) != world_size:
        raise CheckpointError(directory, f"gathered {len(results)} shard results for world_size={world_size}")
    for r, (_, error) in enumerate(results):
        if error is not None:
            who = "this rank" if r == rank else f"rank {r}"
            raise CheckpointError(
                directory, f"{who} failed to write its shard ({error}); nothing was committed, the previous "
                "checkpoint (if any) is intact"
            )
    return [entry for entry, _ in results]


_PROCESS_RUN_ID = new_save_id()  # the run id of saves that pass none: one per process (a forked child shares it)


def _lock_or_raise(directory: Path, lock_dir: Path, run_id: str, rank: int,
                   all_gather: Callable[[Any], list[Any]]) -> None:
    """Rank 0 takes (or confirms) the writer lock of ``lock_dir``; every rank raises the same error if it failed."""
    error = None
    if rank == 0:
        try:
            lock_dir.mkdir(parents=True, exist_ok=True)
            writer_lock.acquire(lock_dir, run_id)
        except writer_lock.LockHeld as err:
            error = f"{err}; nothing was written"
        except OSError as err:
            error = (f"cannot take the writer lock {lock_dir / writer_lock.LOCK_FILE}: {err.strerror or err} "
                     f"({_errno_name(err, type(err).__name__)}); nothing was written")
    failures = [e for e in all_gather(error) if e is not None]
    if failures:
        raise CheckpointError(directory, failures[0])


def save_sharded(
    directory: str | os.PathLike,
    state: Any,
    *,
    rank: int = 0,
    world_size: int = 1,
    global_step: int = 0,
    epoch: int = 0,
    save_id: str | None = None,
    meta: Mapping[str, Any] | None = None,
    barrier: Callable[[str], Any] | None = None,
    all_gather: Callable[[Any], list[Any]] | None = None,
    run_id: str | None = None,
    lock_dir: str | os.PathLike | None = None,
) -> dict[str, Any]:
    """Save this rank's ``state`` as one shard of a crash-consistent checkpoint; call it on every rank.

    Order: rank 0 takes the writer lock of ``lock_dir`` (default ``directory``) for ``run_id`` (default: one id
    per process), every rank writes its shard, barrier, gather every rank's entry, rank 0 writes the manifest
    (the commit) and every rank learns the outcome, rank 0 removes stale files. A directory locked by another
    live writer raises :class:`CheckpointError` on every rank, naming the owner, before anything is written
    (:mod:`~lightning_memkit.pipeline.writer_lock`). ``barrier(name)`` and ``all_gather(obj) -> list`` default
    to ``torch.distributed`` (no-ops without a process group); ``save_id`` (same on every rank, see
    :func:`new_save_id`) may be omitted only with ``world_size=1``. Returns the committed manifest.

    >>> import tempfile, torch
    >>> d = tempfile.mkdtemp()
    >>> m = save_sharded(d, {"w": torch.zeros(1)}, global_step=7, epoch=2, meta={"note": "ok"})
    >>> m["global_step"], m["epoch"], m["world_size"], [s["rank"] for s in m["shards"]], m["meta"]
    (7, 2, 1, [0], {'note': 'ok'})
    """
    world_size = check_int(world_size, "world_size", minimum=1)
    rank = check_int(rank, "rank", minimum=0, maximum=world_size - 1)
    global_step = check_int(global_step, "global_step", minimum=0)
    epoch = check_int(epoch, "epoch", minimum=0)
    if save_id is None and world_size > 1:
        raise ValueError("save_id=None: with world_size > 1 every rank must pass the same save id (new_save_id())")
    save_id = save_id or new_save_id()
    barrier = barrier or _default_barrier
    all_gather = all_gather or _default_all_gather
    directory = Path(directory)
    _lock_or_raise(directory, Path(lock_dir) if lock_dir is not None else directory, run_id or _PROCESS_RUN_ID,
                   rank, all_gather)
    result = _try_write_shard(directory, state, rank=rank, save_id=save_id, global_step=global_step, epoch=epoch)
    barrier("memkit_checkpoint.shards_written")
    entries = _entries_or_raise(directory, all_gather(result), rank, world_size)
    manifest = {
        "format": FORMAT, "version": VERSION, "save_id": save_id, "global_step": global_step, "epoch": epoch,
        "world_size": world_size, "shards": entries, "meta": dict(meta or {}),
    }
    _commit_or_raise(directory, manifest, rank, all_gather)
    if rank == 0:
        try:
            remove_stale(directory, manifest)
        except OSError as err:  # committed already: the old files are only garbage, for the next save to sweep
            warnings.warn(f"{directory}: saved, but files of earlier saves could not be removed ({err})", stacklevel=2)
    return manifest


# -- loading ---------------------------------------------------------------------------------------------------
def _missing_manifest(directory: Path) -> CheckpointError:
    if (directory / _LEGACY_META).is_file():
        return CheckpointError(
            directory / _LEGACY_META,
            f"a memkit_pipeline checkpoint of format version 1 (meta.json, no {MANIFEST}); its shards record no "
            "save id, step or checksum, so a mix of two saves cannot be ruled out and it is refused. To take the "
            "weights anyway, merge torch.load(rank_NNNNN.ckpt)['state_dict'] of every rank yourself",
        )
    if not directory.is_dir():
        return CheckpointError(directory, "no such checkpoint directory (a memkit_pipeline checkpoint is a directory)")
    return CheckpointError(directory / MANIFEST, "missing: not a memkit_pipeline checkpoint, or its first save "
                                                 "never committed")


def _check_fields(file: Path, obj: Any, fields: Mapping[str, type], what: str) -> None:
    if not isinstance(obj, dict):
        raise CheckpointError(file, f"corrupt manifest: {what} is a {type(obj).__name__}, not an object")
    for key, kind in fields.items():
        value = obj.get(key)
        if not isinstance(value, kind) or isinstance(value, bool):
            got = f"{key!r} is {value!r}, expected {kind.__name__}"
            raise CheckpointError(file, f"corrupt manifest: {what} field {got}")


def _check_manifest(file: Path, manifest: Any) -> None:
    _check_fields(file, manifest, _MANIFEST_FIELDS, "the manifest")
    if manifest["format"] != FORMAT:
        raise CheckpointError(file, f"format {manifest['format']!r} is not {FORMAT!r}")
    if manifest["version"] != VERSION:
        raise CheckpointError(file, f"format version {manifest['version']} is not supported (this reads {VERSION})")
    shards = manifest["shards"]
    for i, entry in enumerate(shards):
        _check_fields(file, entry, _SHARD_FIELDS, f"shards[{i}]")
        if not _SHARD_RE.fullmatch(entry["file"]):
            raise CheckpointError(file, f"corrupt manifest: shards[{i}] names {entry['file']!r}, not a shard file")
    if [entry["rank"] for entry in shards] != list(range(manifest["world_size"])):
        raise CheckpointError(file, f"corrupt manifest: lists ranks {[e['rank'] for e in shards]} for "
                                    f"world_size={manifest['world_size']}")


def read_manifest(directory: str | os.PathLike) -> dict[str, Any]:
    """The committed manifest of the checkpoint ``directory`` (checked; shards not opened).

    >>> import tempfile
    >>> d = tempfile.mkdtemp()
    >>> _ = save_sharded(d, {}, global_step=1)
    >>> read_manifest(d)["global_step"]
    1
    >>> read_manifest(tempfile.mkdtemp())  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    lightning_memkit.pipeline.checkpoint.CheckpointError: .../manifest.json: missing: not a memkit_pipeline ...
    """
    directory = Path(directory)
    file = directory / MANIFEST
    if not file.is_file():
        raise _missing_manifest(directory)
    try:
        manifest = json.loads(file.read_bytes())
    except (OSError, ValueError) as err:
        raise CheckpointError(file, f"unreadable manifest ({type(err).__name__}: {err})") from err
    _check_manifest(file, manifest)
    return manifest


_READ_ATTEMPTS = 5  # manifests a reader follows when saves keep replacing the checkpoint under it


def _sha256(file: Path | IO[bytes]) -> str:
    """The sha256 of a file, by path or of an open file from its start (left at its start again)."""
    if not hasattr(file, "read"):
        with open(file, "rb") as f:
            return _sha256(f)
    sha = hashlib.sha256()
    file.seek(0)
    while chunk := file.read(_CHUNK):
        sha.update(chunk)
    file.seek(0)
    return sha.hexdigest()


class _Shards:
    """The shards of one committed manifest, opened together: a later save may delete the files, not these reads.

    A shard the manifest lists but that is gone when opened means either damage, or a newer save committed
    and swept it meanwhile; in the second case the reader follows the newer manifest (up to a few times).
    """

    def __init__(self, directory: Path, ranks: Iterable[int] | None = None,
                 manifest: Mapping[str, Any] | None = None) -> None:
        self.directory = directory
        attempts = 1 if manifest is not None else _READ_ATTEMPTS  # a given manifest is not followed to a newer one
        for _ in range(attempts):
            self.manifest = manifest if manifest is not None else read_manifest(directory)
            wanted = range(self.manifest["world_size"]) if ranks is None else ranks
            if self._open([self.manifest["shards"][r] for r in wanted]):
                return
        if manifest is not None:
            raise CheckpointError(directory, "the manifest passed is no longer the committed one (a newer save "
                                             "replaced it and removed its shards); verify the checkpoint again")
        raise CheckpointError(directory, f"replaced {attempts} times while being opened: another process keeps "
                                         "saving into it; load it again once that run has stopped")

    def _open(self, entries: list[Mapping[str, Any]]) -> bool:
        self.files: dict[int, IO[bytes]] = {}
        for entry in entries:
            file = self.directory / entry["file"]
            try:
                self.files[entry["rank"]] = open(file, "rb")  # noqa: SIM115 - closed by close()
            except FileNotFoundError:
                self.close()
                if self._replaced():
                    return False
                raise CheckpointError(file, f"missing shard of rank {entry['rank']} listed by {MANIFEST}") from None
            except OSError as err:
                self.close()
                raise CheckpointError(file, f"cannot open the shard: {err.strerror or err}") from err
        return True

    def _replaced(self) -> bool:
        try:
            return read_manifest(self.directory)["save_id"] != self.manifest["save_id"]
        except CheckpointError:
            return False

    def check(self, rank: int, hash_it: bool) -> None:
        """The listed size (and sha256) of ``rank``'s shard, read from the open file."""
        entry, f = self.manifest["shards"][rank], self.files[rank]
        file = self.directory / entry["file"]
        size = os.fstat(f.fileno()).st_size
        if size != entry["bytes"]:
            raise CheckpointError(file, f"{size} bytes where {MANIFEST} lists {entry['bytes']} (truncated or replaced)")
        try:
            digest = _sha256(f) if hash_it else entry["sha256"]
        except OSError as err:
            raise CheckpointError(file, f"cannot read the shard: {err.strerror or err}") from err
        if digest != entry["sha256"]:
            raise CheckpointError(file, f"sha256 differs from the one {MANIFEST} lists (corrupt or replaced)")

    def load(self, rank: int, weights_only: bool | None) -> Any:
        """``rank``'s state, after checking the record the shard carries against the manifest."""
        file = self.directory / self.manifest["shards"][rank]["file"]
        try:
            payload = torch.load(self.files[rank], map_location="cpu", weights_only=weights_only)
        except Exception as err:  # noqa: BLE001 - any unpickling failure means an unusable shard
            raise CheckpointError(file, f"unreadable shard ({type(err).__name__}: {err})") from err
        _check_record(file, payload, self.manifest, rank)
        return payload["checkpoint"]

    def close(self) -> None:
        for f in self.files.values():
            f.close()
        self.files = {}

    def __enter__(self) -> _Shards:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def verify_checkpoint(directory: str | os.PathLike, *, hash_ranks: Iterable[int] | None = None) -> dict[str, Any]:
    """Check the manifest and that every listed shard exists with its size; hash ``hash_ranks`` (default all).

    Returns the manifest. Raises :class:`CheckpointError` naming the first bad file.

    >>> import tempfile
    >>> d = tempfile.mkdtemp()
    >>> _ = save_sharded(d, {}, global_step=2)
    >>> verify_checkpoint(d)["world_size"]
    1
    """
    hashed = None if hash_ranks is None else set(hash_ranks)
    with _Shards(Path(directory)) as shards:
        for rank in shards.files:
            shards.check(rank, hashed is None or rank in hashed)
        return shards.manifest


def _check_record(file: Path, payload: Any, manifest: Mapping[str, Any], rank: int) -> None:
    record = payload.get(_RECORD) if isinstance(payload, dict) else None
    expected = _record(manifest["save_id"], rank, manifest["global_step"], manifest["epoch"])
    if record != expected or "checkpoint" not in payload:
        raise CheckpointError(file, f"the shard records {record!r}, but {MANIFEST} expects {expected!r} "
                                    "(a shard of another save)")


def _check_rank(directory: Path, manifest: Mapping[str, Any], rank: int) -> None:
    if not 0 <= rank < manifest["world_size"]:
        raise CheckpointError(directory / MANIFEST, f"has no shard for rank {rank} (world_size="
                                                    f"{manifest['world_size']})")


def load_committed_shard(
    directory: str | os.PathLike, rank: int, *, weights_only: bool | None = None,
) -> tuple[dict[str, Any], Any]:
    """``(manifest, state)`` of ``rank``: the committed manifest, this rank's shard checked (size, sha256, record)
    and loaded from the same open file, so that a save committing meanwhile cannot mix two checkpoints.

    Every shard the manifest lists must exist. Raises :class:`CheckpointError` (naming the file) and nothing else.

    >>> import tempfile
    >>> d = tempfile.mkdtemp()
    >>> _ = save_sharded(d, {"lr": 0.1}, global_step=4)
    >>> manifest, state = load_committed_shard(d, 0)
    >>> manifest["global_step"], state
    (4, {'lr': 0.1})
    """
    directory = Path(directory)
    with _Shards(directory) as shards:
        _check_rank(directory, shards.manifest, rank)
        for r in shards.files:
            shards.check(r, r == rank)
        return shards.manifest, shards.load(rank, weights_only)


def load_shard(
    directory: str | os.PathLike,
    rank: int,
    *,
    manifest: Mapping[str, Any] | None = None,
    weights_only: bool | None = None,
) -> Any:
    """Load ``rank``'s state (on CPU) after checking the checkpoint; pass ``manifest`` from
    :func:`verify_checkpoint` when the files were checked already.

    >>> import tempfile
    >>> d = tempfile.mkdtemp()
    >>> _ = save_sharded(d, {"lr": 0.1})
    >>> load_shard(d, 0)
    {'lr': 0.1}
    """
    directory = Path(directory)
    if manifest is None:
        return load_committed_shard(directory, rank, weights_only=weights_only)[1]
    _check_rank(directory, manifest, rank)
    with _Shards(directory, (rank,), manifest) as shards:
        shards.check(rank, False)
        return shards.load(rank, weights_only)


def merge_state_dicts(
    directory: str | os.PathLike, key: str = "state_dict", *, weights_only: bool | None = None
) -> dict[str, Any]:
    """Every shard's ``state[key]`` merged into one dict (all shards opened together, checked and hashed first).

    >>> import tempfile, torch
    >>> d = tempfile.mkdtemp()
    >>> _ = save_sharded(d, {"state_dict": {"w": torch.ones(1)}})
    >>> merge_state_dicts(d)
    {'w': tensor([1.])}
    """
    merged: dict[str, Any] = {}
    with _Shards(Path(directory)) as shards:
        for rank in shards.files:
            shards.check(rank, True)
        for entry in shards.manifest["shards"]:
            state = shards.load(entry["rank"], weights_only)
            if not isinstance(state, dict) or not isinstance(state.get(key), dict):
                raise CheckpointError(Path(directory) / entry["file"], f"the shard holds no {key!r} dict")
            merged.update(state[key])
    return merged
