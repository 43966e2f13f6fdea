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

import hashlib
import json
import os
import re
import secrets
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import IO, Any

import torch

from lightning_memkit.validation import check_int

__all__ = [
    "CheckpointError",
    "FORMAT",
    "MANIFEST",
    "VERSION",
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
        self._sha = hashlib.sha256()

    def write(self, data: Any) -> int:
        self._sha.update(data)
        self.size += len(data)
        return self.file.write(data)

    def flush(self) -> None:
        self.file.flush()

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


def _atomic_write(target: Path, write: Callable[[_HashingWriter], Any]) -> tuple[int, str]:
    """Write ``target`` through a same-directory temporary file, fsync it and rename it into place."""
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            writer = _HashingWriter(f)
            write(writer)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
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
    size, sha = _atomic_write(Path(directory) / name, lambda f: torch.save(payload, f))
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
def _try_write_shard(directory: Path, state: Any, **kwargs: Any) -> tuple[dict[str, Any] | None, str | None]:
    try:
        return write_shard(directory, state, **kwargs), None
    except Exception as err:  # noqa: BLE001 - reported to every rank, re-raised below
        return None, f"{type(err).__name__}: {err}"


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
) -> dict[str, Any]:
    """Save this rank's ``state`` as one shard of a crash-consistent checkpoint; call it on every rank.

    Order: write the shard, barrier, gather every rank's entry, rank 0 writes the manifest (the commit),
    barrier, rank 0 removes stale files. ``barrier(name)`` and ``all_gather(obj) -> list`` default to
    ``torch.distributed`` (no-ops without a process group); ``save_id`` (same on every rank, see
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
    directory.mkdir(parents=True, exist_ok=True)
    result = _try_write_shard(directory, state, rank=rank, save_id=save_id, global_step=global_step, epoch=epoch)
    barrier("memkit_checkpoint.shards_written")
    entries = _entries_or_raise(directory, all_gather(result), rank, world_size)
    manifest = {
        "format": FORMAT, "version": VERSION, "save_id": save_id, "global_step": global_step, "epoch": epoch,
        "world_size": world_size, "shards": entries, "meta": dict(meta or {}),
    }
    if rank == 0:
        write_manifest(directory, manifest)
    barrier("memkit_checkpoint.manifest_committed")
    if rank == 0:
        remove_stale(directory, manifest)
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


def _sha256(file: Path) -> str:
    sha = hashlib.sha256()
    with open(file, "rb") as f:
        while chunk := f.read(_CHUNK):
            sha.update(chunk)
    return sha.hexdigest()


def _check_shard_file(directory: Path, entry: Mapping[str, Any], hash_it: bool) -> None:
    file = directory / entry["file"]
    try:
        size = file.stat().st_size
    except FileNotFoundError:
        raise CheckpointError(file, f"missing shard of rank {entry['rank']} listed by {MANIFEST}") from None
    if size != entry["bytes"]:
        raise CheckpointError(file, f"{size} bytes where {MANIFEST} lists {entry['bytes']} (truncated or replaced)")
    if hash_it and _sha256(file) != entry["sha256"]:
        raise CheckpointError(file, f"sha256 differs from the one {MANIFEST} lists (corrupt or replaced)")


def verify_checkpoint(directory: str | os.PathLike, *, hash_ranks: Iterable[int] | None = None) -> dict[str, Any]:
    """Check the manifest and that every listed shard exists with its size; hash ``hash_ranks`` (default all).

    Returns the manifest. Raises :class:`CheckpointError` naming the first bad file.

    >>> import tempfile
    >>> d = tempfile.mkdtemp()
    >>> _ = save_sharded(d, {}, global_step=2)
    >>> verify_checkpoint(d)["world_size"]
    1
    """
    directory = Path(directory)
    manifest = read_manifest(directory)
    hashed = None if hash_ranks is None else set(hash_ranks)
    for entry in manifest["shards"]:
        _check_shard_file(directory, entry, hashed is None or entry["rank"] in hashed)
    return manifest


def _check_record(file: Path, payload: Any, manifest: Mapping[str, Any], rank: int) -> None:
    record = payload.get(_RECORD) if isinstance(payload, dict) else None
    expected = _record(manifest["save_id"], rank, manifest["global_step"], manifest["epoch"])
    if record != expected or "checkpoint" not in payload:
        raise CheckpointError(file, f"the shard records {record!r}, but {MANIFEST} expects {expected!r} "
                                    "(a shard of another save)")


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
        manifest = verify_checkpoint(directory, hash_ranks=(rank,))
    if not 0 <= rank < manifest["world_size"]:
        raise CheckpointError(directory / MANIFEST, f"has no shard for rank {rank} (world_size="
                                                    f"{manifest['world_size']})")
    file = directory / manifest["shards"][rank]["file"]
    try:
        payload = torch.load(file, map_location="cpu", weights_only=weights_only)
    except Exception as err:  # noqa: BLE001 - any unpickling failure means an unusable shard
        raise CheckpointError(file, f"unreadable shard ({type(err).__name__}: {err})") from err
    _check_record(file, payload, manifest, rank)
    return payload["checkpoint"]


def merge_state_dicts(
    directory: str | os.PathLike, key: str = "state_dict", *, weights_only: bool | None = None
) -> dict[str, Any]:
    """Every shard's ``state[key]`` merged into one dict (all shards checked and hashed first).

    >>> import tempfile, torch
    >>> d = tempfile.mkdtemp()
    >>> _ = save_sharded(d, {"state_dict": {"w": torch.ones(1)}})
    >>> merge_state_dicts(d)
    {'w': tensor([1.])}
    """
    manifest = verify_checkpoint(directory)
    merged: dict[str, Any] = {}
    for entry in manifest["shards"]:
        state = load_shard(directory, entry["rank"], manifest=manifest, weights_only=weights_only)
        if not isinstance(state, dict) or not isinstance(state.get(key), dict):
            raise CheckpointError(Path(directory) / entry["file"], f"the shard holds no {key!r} dict")
        merged.update(state[key])
    return merged
