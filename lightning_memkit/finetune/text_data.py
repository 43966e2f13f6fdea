"""Your text as training batches: a JSONL, Parquet or plain-text file (or a dataset saved with ``save_to_disk``),
read by the ``datasets`` library (memory-mapped, cached), tokenized with your model's tokenizer.

``packing=True`` (default) concatenates the documents (each ended by the EOS token) and cuts fixed blocks of
``max_length`` tokens: every batch is ``batch_size x max_length``. ``packing=False`` keeps one document per row,
truncated to ``max_length`` and padded per batch (padding masked out of the loss). Either way ``max_length`` is
the declared longest row, so :meth:`TextDataModule.longest_batch` gives ``MemoryBudget`` the batch to plan on.
The training order is a seeded shuffle per epoch; the training loader is torchdata's ``StatefulDataLoader``, whose
position Lightning saves with every checkpoint, so a run resumed mid-epoch sees the batches it would have seen.

Example::

    >>> import json, tempfile
    >>> from pathlib import Path
    >>> from lightning_memkit.finetune.text_data import TextDataModule, train_tokenizer
    >>> folder = Path(tempfile.mkdtemp())
    >>> docs = [{"text": f"document {i} says hello to the model"} for i in range(40)]
    >>> _ = (folder / "docs.jsonl").write_text("".join(json.dumps(d) + "\\n" for d in docs))
    >>> train_tokenizer([d["text"] for d in docs], folder / "tokenizer")
    >>> data = TextDataModule(str(folder / "docs.jsonl"), tokenizer=str(folder / "tokenizer"), max_length=16,
    ...                       batch_size=2, val_fraction=0.1)
    >>> data.setup("fit")
    >>> batch = next(iter(data.train_dataloader()))
    >>> tuple(batch["input_ids"].shape), tuple(data.longest_batch()["input_ids"].shape)
    ((2, 16), (2, 16))
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Sampler

from lightning_memkit.common.validation import check_bool, check_int, check_number

__all__ = ["TextDataModule", "train_tokenizer"]

_KINDS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text"}
_OWNER = "TextDataModule"


class _EpochShuffle(Sampler[int]):
    """A seeded permutation per epoch (``set_epoch``, as Lightning calls it)."""

    def __init__(self, n: int, seed: int) -> None:
        self.n, self.seed, self.epoch = n, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        yield from torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + self.epoch)).tolist()


class TextDataModule(pl.LightningDataModule):
    """Batches of your text for a transformers causal LM (see the module).

    Args:
        path: a ``.jsonl``/``.json``, ``.parquet`` or ``.txt`` file, or a directory written by ``save_to_disk``.
        tokenizer: the tokenizer's directory or hub name (usually the model's).
        text_field: the column holding the text (``text``; plain-text files have only that).
        max_length: tokens per row: the block length when packing, the truncation length otherwise.
        packing: fixed blocks of concatenated documents (``True``) or one padded document per row.
        batch_size: rows per batch.
        val_fraction: share of the rows held out for validation (0: none).
        seed: seed of the split and of each epoch's shuffle.
        num_workers: DataLoader workers.
    """

    def __init__(self, path: str, tokenizer: str, text_field: str = "text", max_length: int = 1024,
                 packing: bool = True, batch_size: int = 8, val_fraction: float = 0.05, seed: int = 0,
                 num_workers: int = 0) -> None:
        super().__init__()
        for name, value in (("max_length", max_length), ("batch_size", batch_size)):
            check_int(value, name, minimum=1, owner=_OWNER)
        check_int(seed, "seed", minimum=0, owner=_OWNER)
        check_int(num_workers, "num_workers", minimum=0, owner=_OWNER)
        check_bool(packing, "packing", owner=_OWNER)
        check_number(val_fraction, "val_fraction", minimum=0, maximum=1, max_inclusive=False, owner=_OWNER)
        source = Path(path)
        if not source.is_dir() and source.suffix not in _KINDS:
            raise ValueError(f"{_OWNER}(path={path!r}): give a {', '.join(_KINDS)} file or a directory written by "
                             "datasets' save_to_disk")
        if not source.exists():
            raise ValueError(f"{_OWNER}(path={path!r}): no such file or directory")
        _check_text_file(source, text_field)
        _check_tokenizer(tokenizer)
        self.save_hyperparameters()
        self.batch_size = batch_size
        self.train_set: Any = None
        self.val_set: Any = None
        self._tokenizer: Any = None

    # -- data ------------------------------------------------------------------------------------------
    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        from transformers import AutoTokenizer

        hp = self.hparams
        self._tokenizer = AutoTokenizer.from_pretrained(hp.tokenizer)
        rows = _tokenized(_load(hp.path), self._tokenizer, hp.text_field, hp.max_length, hp.packing)
        if len(rows) < hp.batch_size:
            raise ValueError(f"{_OWNER}(path={hp.path!r}): {len(rows)} rows of {hp.max_length} tokens, fewer than "
                             f"one batch of {hp.batch_size}")
        if hp.val_fraction > 0:
            split = rows.train_test_split(test_size=hp.val_fraction, seed=hp.seed)
            self.train_set, self.val_set = split["train"], split["test"]
        else:
            self.train_set = rows
        self.train_set.set_format("torch")
        if self.val_set is not None:
            self.val_set.set_format("torch")

    def train_dataloader(self) -> DataLoader:
        """An :class:`~lightning_memkit.common.stateful_loader.EpochStatefulLoader` (torchdata's
        ``StatefulDataLoader``): Lightning saves its position with every checkpoint and restores it, so a run resumed
        mid-epoch sees the rest of that epoch's batches, in order, and one resumed at an epoch's end the next epoch."""
        from lightning_memkit.common.stateful_loader import EpochStatefulLoader

        return EpochStatefulLoader(self.train_set, batch_size=self.batch_size, drop_last=True,
                                   sampler=_EpochShuffle(len(self.train_set), self.hparams.seed),
                                   collate_fn=self._collate, num_workers=self.hparams.num_workers)

    def val_dataloader(self) -> DataLoader | list:
        if self.val_set is None:
            return []
        return DataLoader(self.val_set, batch_size=self.batch_size, collate_fn=self._collate,
                          num_workers=self.hparams.num_workers)

    def longest_batch(self) -> dict[str, torch.Tensor]:
        """The largest batch the run will see: ``batch_size`` rows of ``max_length`` tokens (``MemoryBudget``
        plans on it)."""
        rows = [self.train_set[i] for i in range(self.batch_size)]
        return self._collate(rows, pad_to=self.hparams.max_length)

    def _collate(self, rows: list[dict[str, torch.Tensor]], pad_to: int | None = None) -> dict[str, torch.Tensor]:
        length = max(pad_to or 0, *(len(r["input_ids"]) for r in rows))
        pad = self._tokenizer.pad_token_id if self._tokenizer.pad_token_id is not None else (
            self._tokenizer.eos_token_id or 0)
        ids = torch.full((len(rows), length), pad, dtype=torch.long)
        mask = torch.zeros((len(rows), length), dtype=torch.long)
        for i, r in enumerate(rows):
            n = len(r["input_ids"])
            ids[i, :n] = r["input_ids"]
            mask[i, :n] = 1
        labels = ids.masked_fill(mask == 0, -100)
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}

def _check_text_file(source: Path, field: str) -> None:
    """A ``.jsonl``/``.json``/``.txt`` file read once, line by line, before anything is built: a line that is not
    UTF-8 (its number), a file without text, a JSONL record without ``field`` (its number) are one line each."""
    if source.is_dir() or source.suffix not in (".jsonl", ".txt"):
        return
    import json

    records = 0
    with source.open("rb") as lines:
        for number, raw in enumerate(lines, 1):
            try:
                line = raw.decode("utf-8").strip()
            except UnicodeDecodeError as err:
                raise ValueError(f"{_OWNER}(path={str(source)!r}): line {number} is not UTF-8 text ({err.reason} at "
                                 f"byte {err.start})") from None
            if not line:
                continue
            records += 1
            if source.suffix == ".jsonl":
                try:
                    record = json.loads(line)
                except ValueError as err:
                    raise ValueError(f"{_OWNER}(path={str(source)!r}): line {number} is not JSON ({err})") from None
                if not isinstance(record, dict) or field not in record:
                    keys = sorted(record) if isinstance(record, dict) else type(record).__name__
                    raise ValueError(f"{_OWNER}(text_field={field!r}): line {number} of {str(source)!r} has no "
                                     f"{field!r} (it has {keys})")
    if records == 0:
        raise ValueError(f"{_OWNER}(path={str(source)!r}): the file holds no text")


def _check_tokenizer(tokenizer: str) -> None:
    """A local tokenizer folder that is not there (a path, not a hub name) is one line, not the hub's refusal."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if Path(tokenizer).is_dir():
        return
    try:
        validate_repo_id(tokenizer)
    except HFValidationError:
        raise ValueError(f"{_OWNER}(tokenizer={tokenizer!r}): no such folder (give the tokenizer's folder, usually "
                         "the model's, or a hub name such as 'org/model')") from None


def _load(path: str) -> Any:
    import datasets

    source = Path(path)
    if source.is_dir():
        loaded = datasets.load_from_disk(str(source))
        return loaded["train"] if isinstance(loaded, datasets.DatasetDict) else loaded
    return datasets.load_dataset(_KINDS[source.suffix], data_files=str(source), split="train")


def _tokenized(rows: Any, tokenizer: Any, field: str, max_length: int, packing: bool) -> Any:
    if field not in rows.column_names:
        raise ValueError(f"{_OWNER}(text_field={field!r}): the data has the columns {rows.column_names}")
    eos = tokenizer.eos_token_id
    if packing and eos is None:
        raise ValueError(f"{_OWNER}(packing=True): the tokenizer has no EOS token to end each document with")

    def encode(batch: dict[str, list]) -> dict[str, list]:
        if packing:
            return {"input_ids": [ids + [eos] for ids in tokenizer(batch[field])["input_ids"]]}
        return {"input_ids": tokenizer(batch[field], truncation=True, max_length=max_length)["input_ids"]}

    def blocks(batch: dict[str, list]) -> dict[str, list]:
        flat = [t for ids in batch["input_ids"] for t in ids]
        whole = len(flat) // max_length * max_length
        return {"input_ids": [flat[i:i + max_length] for i in range(0, whole, max_length)]}

    rows = rows.map(encode, batched=True, remove_columns=rows.column_names, desc="tokenizing")
    if packing:
        rows = rows.map(blocks, batched=True, batch_size=1000, desc=f"packing into blocks of {max_length}")
    return rows.filter(lambda r: len(r["input_ids"]) > 1, desc="dropping empty rows")


def train_tokenizer(texts: list[str], directory: str | Path, vocab_size: int = 256) -> None:
    """A small byte-level BPE tokenizer trained on ``texts`` and saved to ``directory`` (tests and examples: no
    download), with ``<eos>`` and ``<pad>`` tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>").save_pretrained(str(directory))
