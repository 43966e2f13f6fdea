"""Byte-level next-token data from a real text corpus that is on every machine: Python's own stdlib sources.

The corpus is the ``.py`` files under ``sysconfig.get_paths()["stdlib"]`` read in sorted path order and
cut at ``max_bytes``; where those sources are absent (some embedded or stripped Pythons), the small
text file shipped in ``lightning_memkit/demo/data/`` is used instead. ``path=`` points at your own
file or folder. Samples are windows of ``seq_len + 1`` bytes at starts drawn once from a seeded
generator, so the same arguments always give the same batches; a run resumed from a mid-epoch checkpoint
continues that epoch where it stopped (the training loader is stateful).

Example::

    >>> from lightning_memkit.demo import ByteTextDataModule
    >>> dm = ByteTextDataModule(batch_size=2, seq_len=8, max_bytes=50_000)
    >>> dm.setup("fit")
    >>> x, y = next(iter(dm.train_dataloader()))
    >>> x.shape, y.shape, bool((x[:, 1:] == y[:, :-1]).all())
    (torch.Size([2, 8]), torch.Size([2, 8]), True)
"""

from __future__ import annotations

import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_memkit.common.stateful_loader import EpochStatefulLoader
from lightning_memkit.common.validation import check_choice, check_int, check_number

__all__ = ["ByteTextDataModule", "ByteWindows", "load_corpus", "FALLBACK_TEXT"]

FALLBACK_TEXT = Path(__file__).resolve().parent / "data" / "fallback.txt"
BATCH_FORMATS = ("pairs", "hf")
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idlelib"}


def _sorted_files(root: Path, suffix: str) -> Iterator[Path]:
    """Files under ``root`` ending in ``suffix``, depth first in sorted name order, skipping vendored/test dirs."""
    try:
        entries = sorted(os.scandir(root), key=lambda e: e.name)
    except OSError:
        return
    for entry in entries:
        if entry.is_dir(follow_symlinks=False):
            if entry.name not in _SKIP_DIRS:
                yield from _sorted_files(Path(entry.path), suffix)
        elif entry.is_file() and entry.name.endswith(suffix):
            yield Path(entry.path)


def load_corpus(path: str | os.PathLike | None = None, max_bytes: int = 2_000_000) -> tuple[bytes, str]:
    """The corpus bytes (at most ``max_bytes``) and a one-line description of where they came from.

    ``path`` may be a file (read as bytes) or a folder (its ``.py`` and ``.txt`` files, sorted); ``None``
    reads the stdlib sources and falls back to the shipped text when there are none.
    """
    if path is not None:
        p = Path(path)
        if p.is_file():
            return p.read_bytes()[:max_bytes], str(p)
        if not p.is_dir():
            raise ValueError(f"ByteTextDataModule(path={str(path)!r}) is neither a file nor a folder")
        files = sorted([*_sorted_files(p, ".py"), *_sorted_files(p, ".txt")])
        source = str(p)
    else:
        root = Path(sysconfig.get_paths()["stdlib"])
        files = _sorted_files(root, ".py")
        source = f"Python stdlib sources under {root}"
    chunks, total = [], 0
    for f in files:
        try:
            data = f.read_bytes()
        except OSError:
            continue
        chunks.append(data[: max_bytes - total])
        total += len(chunks[-1])
        if total >= max_bytes:
            break
    if total == 0:
        if path is not None:
            raise ValueError(f"ByteTextDataModule(path={str(path)!r}) holds no .py or .txt bytes")
        return FALLBACK_TEXT.read_bytes()[:max_bytes], str(FALLBACK_TEXT)
    return b"".join(chunks), source


class ByteWindows(Dataset):
    """``num_samples`` windows of ``seq_len + 1`` bytes: item ``i`` is ``(x, y)`` with ``y`` = ``x`` shifted by one."""

    def __init__(self, data: torch.Tensor, seq_len: int, num_samples: int, seed: int, batch_format: str = "pairs"):
        if data.numel() < seq_len + 1:
            raise ValueError(f"corpus split of {data.numel()} bytes is shorter than seq_len + 1 = {seq_len + 1}")
        self.data = data
        self.seq_len = seq_len
        self.batch_format = batch_format
        g = torch.Generator().manual_seed(seed)
        self.starts = torch.randint(0, data.numel() - seq_len, (num_samples,), generator=g)

    def __len__(self) -> int:
        return self.starts.numel()

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor] | dict[str, torch.Tensor]:
        s = int(self.starts[i])
        w = self.data[s : s + self.seq_len + 1].long()
        if self.batch_format == "hf":  # the model shifts the labels itself
            return {"input_ids": w[:-1], "labels": w[:-1].clone()}
        return w[:-1], w[1:]


class ByteTextDataModule(pl.LightningDataModule):
    """Next-byte prediction batches of shape ``(batch_size, seq_len)`` from a text corpus.

    ``batch_format="pairs"`` gives ``(x, y)`` with ``y`` shifted by one; ``"hf"`` gives the dict a Hugging Face
    causal LM takes, ``{"input_ids": x, "labels": x}`` (the model shifts the labels).

    Args:
        batch_size: windows per batch.
        seq_len: tokens per window (the model's context).
        val_fraction: tail of the corpus kept for validation (also served as the test and predict sets).
        max_bytes: cap on the corpus size.
        samples_per_epoch: training windows per epoch (default: corpus bytes // seq_len); the validation
            set has ``max(batch_size, that * val_fraction)`` windows.
        seed: seed of the window starts.
        num_workers: DataLoader workers.
        path: a text file or folder to read instead of the stdlib sources.
        batch_format: ``"pairs"`` or ``"hf"`` (see above).

    Example (LightningCLI YAML)::

        data:
          class_path: lightning_memkit.demo.ByteTextDataModule
          init_args: {batch_size: 32, seq_len: 128}
    """

    def __init__(
        self,
        batch_size: int = 32,
        seq_len: int = 128,
        val_fraction: float = 0.05,
        max_bytes: int = 2_000_000,
        samples_per_epoch: int | None = None,
        seed: int = 0,
        num_workers: int = 0,
        path: str | None = None,
        batch_format: str = "pairs",
    ):
        super().__init__()
        owner = "ByteTextDataModule"
        for name, value in (("batch_size", batch_size), ("seq_len", seq_len), ("max_bytes", max_bytes)):
            check_int(value, name, minimum=1, owner=owner)
        check_int(samples_per_epoch, "samples_per_epoch", minimum=1, allow_none=True, owner=owner)
        check_number(val_fraction, "val_fraction", minimum=0, maximum=1, min_inclusive=False, max_inclusive=False,
                     owner=owner)
        check_int(num_workers, "num_workers", minimum=0, owner=owner)
        check_choice(batch_format, "batch_format", BATCH_FORMATS, owner=owner)
        self.save_hyperparameters()
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.source = ""
        self.train_set: ByteWindows | None = None
        self.val_set: ByteWindows | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        hp = self.hparams
        raw, self.source = load_corpus(hp.path, hp.max_bytes)
        data = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        n_val = max(int(data.numel() * hp.val_fraction), self.seq_len + 1)
        if data.numel() - n_val < self.seq_len + 1:
            raise ValueError(
                f"corpus from {self.source} has {data.numel()} bytes: too short for seq_len={self.seq_len} "
                f"with val_fraction={hp.val_fraction}"
            )
        train, val = data[:-n_val], data[-n_val:]
        n_train = hp.samples_per_epoch or max(train.numel() // self.seq_len, self.batch_size)
        n_val_samples = max(self.batch_size, int(n_train * hp.val_fraction))
        self.train_set = ByteWindows(train, self.seq_len, n_train, seed=hp.seed, batch_format=hp.batch_format)
        self.val_set = ByteWindows(val, self.seq_len, n_val_samples, seed=hp.seed + 1, batch_format=hp.batch_format)

    def train_dataloader(self) -> DataLoader:
        """The training windows in order, whole batches only, from an
        :class:`~lightning_memkit.common.stateful_loader.EpochStatefulLoader`: a run resumed mid-epoch continues that
        epoch where it stopped."""
        return EpochStatefulLoader(self.train_set, batch_size=self.batch_size, shuffle=False, drop_last=True,
                                   num_workers=self.hparams.num_workers)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size, shuffle=False, num_workers=self.hparams.num_workers)

    def test_dataloader(self) -> DataLoader:
        """The held-out tail again (the corpus has no separate test split)."""
        return self.val_dataloader()

    def predict_dataloader(self) -> DataLoader:
        """The held-out windows again, in the batch format of training (a model's ``predict_step`` picks the inputs)."""
        return self.val_dataloader()
