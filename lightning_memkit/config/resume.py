"""``--ckpt_path last`` that finds the run's last checkpoint wherever its logger's version put it.

Lightning resolves ``ckpt_path="last"`` in the checkpoint folder of *this* run; with a logger, that folder is
``save_dir/name/version_N/checkpoints`` and a new run gets a new ``version_N``, so a resumed run finds nothing there
and trains from step 0 with one warning. :func:`last_checkpoint` looks where every ``ModelCheckpoint`` of the
Trainer writes: its ``dirpath`` when given, else the ``checkpoints`` folder of every version of the logger's run (or
of ``default_root_dir`` without a logger), and returns the newest ``last*.ckpt``. Nothing found is an error naming
where it looked. A sharded checkpoint (``memkit_fsdp2``: a ``last.ckpt`` folder of each rank's shards) counts as
one.

Example::

    >>> import tempfile
    >>> from pathlib import Path
    >>> from lightning.pytorch import Trainer
    >>> from lightning.pytorch.callbacks import ModelCheckpoint
    >>> from lightning.pytorch.loggers import CSVLogger
    >>> root = Path(tempfile.mkdtemp())
    >>> _ = (root / "lightning_logs" / "version_0" / "checkpoints").mkdir(parents=True)
    >>> _ = (root / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt").write_bytes(b"")
    >>> trainer = Trainer(logger=CSVLogger(root), callbacks=[ModelCheckpoint(save_last=True)])
    >>> last_checkpoint(trainer).relative_to(root).as_posix()
    'lightning_logs/version_0/checkpoints/last.ckpt'
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning_memkit.config.errors import ConfigError

__all__ = ["last_checkpoint", "checkpoint_folders"]


def checkpoint_folders(trainer: Any) -> list[Path]:
    """Where the Trainer's ``ModelCheckpoint`` callbacks write, this run's version and the earlier ones alike."""
    folders: list[Path] = []
    for callback in trainer.checkpoint_callbacks:
        if getattr(callback, "dirpath", None):
            folders.append(Path(callback.dirpath))
        elif trainer.loggers:
            logger = trainer.loggers[0]
            run = Path(logger.save_dir or trainer.default_root_dir) / str(logger.name or "")
            folders += sorted(p for p in run.glob("*/checkpoints") if p.is_dir()) or [run / "version_*/checkpoints"]
        else:
            folders.append(Path(trainer.default_root_dir) / "checkpoints")
    return list(dict.fromkeys(folders))


def last_checkpoint(trainer: Any) -> Path:
    """The newest ``last*.ckpt`` (a file, or a sharded checkpoint's folder) in :func:`checkpoint_folders`, by the time
    it was written; a :class:`ConfigError` naming the folders when there is none, or when the Trainer saves no
    checkpoint."""
    folders = checkpoint_folders(trainer)
    if not folders:
        raise ConfigError("--ckpt_path last: this run saves no checkpoint (no ModelCheckpoint callback, or "
                          "enable_checkpointing: false); give a checkpoint's path", hint=False)
    found = {p: t for folder in folders for p in folder.glob("last*.ckpt") if (t := _saved_at(p)) is not None}
    if not found:
        where = ", ".join(str(f) for f in folders)
        raise ConfigError(f"--ckpt_path last: no last*.ckpt in {where}; nothing to resume (leave --ckpt_path out to "
                          "start from step 0, or give a checkpoint's path)", hint=False)
    return max(found, key=lambda p: (found[p], str(p)))


def _saved_at(path: Path) -> int | None:
    """When the checkpoint at ``path`` was written (ns): a file's time, or a sharded checkpoint's (a folder of
    ``torch.distributed.checkpoint``, as ``memkit_fsdp2`` saves one) metadata's; ``None``: not a checkpoint."""
    if path.is_file():
        return path.stat().st_mtime_ns
    metadata = path / ".metadata"
    return metadata.stat().st_mtime_ns if metadata.is_file() else None
