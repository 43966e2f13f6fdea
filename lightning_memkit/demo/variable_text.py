"""Batches whose lengths change during the run: byte windows of the stdlib sources, padded per batch as a
transformers collator pads them (``labels`` ``-100`` and ``attention_mask`` 0 on the padding).

Batch ``b`` of an epoch holds ``batch_size`` windows of at most ``lengths[b % len(lengths)]`` bytes (its last row
exactly that long, the others up to a quarter shorter, seeded), so with ``lengths=(32, 256)`` the first batch is
8 x 32 and the second 8 x 256: the case a plan made on the first batch gets wrong. The training loader is
stateful: a run resumed from a mid-epoch checkpoint continues that epoch where it stopped.

Example::

    >>> from lightning_memkit.demo.variable_text import VariableLengthDataModule
    >>> dm = VariableLengthDataModule(batch_size=2, lengths=(8, 32), max_bytes=50_000)
    >>> dm.setup("fit")
    >>> [tuple(b["input_ids"].shape) for b in dm.train_dataloader()]
    [(2, 8), (2, 32)]
    >>> tuple(dm.longest_batch()["input_ids"].shape)
    (2, 32)
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset, RandomSampler

from lightning_memkit.common.stateful_loader import EpochStatefulLoader
from lightning_memkit.common.validation import check_bool, check_int
from lightning_memkit.demo.byte_text import load_corpus

__all__ = ["VariableLengthDataModule", "pad_hf"]


def pad_hf(samples: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """A transformers-style causal-LM batch of 1-D token tensors, right-padded to the longest: ``input_ids`` (0 on
    the padding), ``attention_mask`` and ``labels`` (``-100`` on the padding)."""
    width = max(s.numel() for s in samples)
    ids = torch.zeros(len(samples), width, dtype=torch.long)
    mask = torch.zeros(len(samples), width, dtype=torch.long)
    for row, s in enumerate(samples):
        ids[row, :s.numel()] = s
        mask[row, :s.numel()] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


class _Windows(Dataset):
    def __init__(self, data: torch.Tensor, lengths: list[int], seed: int):
        g = torch.Generator().manual_seed(seed)
        self.data, self.lengths = data, lengths
        self.starts = torch.randint(0, data.numel() - max(lengths), (len(lengths),), generator=g).tolist()

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.data[self.starts[i]:self.starts[i] + self.lengths[i]].long()


class _Shuffle(RandomSampler):
    """``RandomSampler`` without a generator (each epoch's order drawn from the global RNG as the epoch starts, the
    order of a shuffled ``DataLoader``) whose state, the epoch's seed and the samples given, ``StatefulDataLoader``
    saves and restores."""

    def __init__(self, data_source: Dataset):
        super().__init__(data_source)
        self.seed, self.yielded, self._restored = 0, 0, None

    def __iter__(self):
        if self._restored is None:
            seed, skip = int(torch.empty((), dtype=torch.int64).random_().item()), 0
        else:
            (seed, skip), self._restored = self._restored, None
        self.seed, self.yielded = seed, skip
        order = torch.randperm(len(self.data_source), generator=torch.Generator().manual_seed(seed)).tolist()
        for i in order[skip:]:
            self.yielded += 1
            yield i

    def state_dict(self) -> dict[str, int]:
        return {"seed": self.seed, "yielded": self.yielded}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._restored = (int(state["seed"]), int(state["yielded"]))


class VariableLengthDataModule(pl.LightningDataModule):
    """Padded causal-LM batches of the lengths ``lengths``, one per batch in turn (see the module doc).

    Args:
        batch_size: windows per batch.
        lengths: the longest window of each batch, cycled (``(32, 256)``: short, long, short, ...).
        batches: training batches per epoch (default: one per length).
        max_bytes: cap on the corpus read.
        seed: seed of the window starts and lengths.
        declare_longest: give the ``longest_batch()`` hook :class:`~lightning_memkit.callbacks.MemoryBudget` plans
            on (``False``: the budget finds the longest batch by scanning the samples).
        shuffle: shuffle the training samples (the padding then mixes lengths), each epoch in an order drawn from
            the global RNG (``seed_everything``) as it starts; a resumed run finishes the interrupted epoch in its
            order, and the global RNG (which Lightning does not checkpoint) orders the later epochs.
    """

    def __init__(self, batch_size: int = 8, lengths: tuple[int, ...] | list[int] = (32, 256),
                 batches: int | None = None, max_bytes: int = 200_000, seed: int = 0, declare_longest: bool = True,
                 shuffle: bool = False):
        super().__init__()
        owner = "VariableLengthDataModule"
        check_int(batch_size, "batch_size", minimum=1, owner=owner)
        if isinstance(lengths, (str, bytes)) or not lengths:
            raise ValueError(f"{owner}(lengths={lengths!r}): a non-empty list of window lengths")
        for n in lengths:
            check_int(n, "lengths", minimum=2, owner=owner)
        check_int(batches, "batches", minimum=1, allow_none=True, owner=owner)
        check_bool(declare_longest, "declare_longest", owner=owner)
        check_bool(shuffle, "shuffle", owner=owner)
        self.batch_size, self.lengths = batch_size, [int(n) for n in lengths]
        self.batches, self.max_bytes, self.seed, self.shuffle = batches or len(lengths), max_bytes, seed, shuffle
        self.train_set: _Windows | None = None
        if declare_longest:
            self.longest_batch = self._longest_batch

    def _row_lengths(self) -> list[int]:
        g = torch.Generator().manual_seed(self.seed + 1)
        out = []
        for b in range(self.batches):
            longest = self.lengths[b % len(self.lengths)]
            cut = torch.randint(0, max(longest // 4, 1), (self.batch_size - 1,), generator=g).tolist()
            out += [longest - c for c in cut] + [longest]
        return out

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is None:
            raw, _ = load_corpus(None, self.max_bytes)
            data = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
            self.train_set = _Windows(data, self._row_lengths(), self.seed)

    def train_dataloader(self) -> DataLoader:
        """An :class:`~lightning_memkit.common.stateful_loader.EpochStatefulLoader`: a run resumed mid-epoch continues
        that epoch where it stopped."""
        sampler = _Shuffle(self.train_set) if self.shuffle else None
        return EpochStatefulLoader(self.train_set, batch_size=self.batch_size, sampler=sampler, collate_fn=pad_hf)

    def _longest_batch(self) -> dict[str, Any]:
        """The largest batch the epoch can hold: its ``batch_size`` longest windows, padded as a batch of them is
        (a padded batch has a mask that a batch of equal rows lacks, and transformers then builds the attention
        mask as a tensor)."""
        self.setup("fit")
        lengths = self.train_set.lengths
        longest = sorted(range(len(lengths)), key=lambda i: -lengths[i])[:self.batch_size]
        return pad_hf([self.train_set[i] for i in longest])
