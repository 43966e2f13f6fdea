"""Your text as training batches: a JSONL, Parquet or plain-text file (or a dataset saved with ``save_to_disk``),
read by the ``datasets`` library (memory-mapped, cached), tokenized with your model's tokenizer.

``packing=True`` (default) concatenates the documents (each ended by the EOS token) and cuts fixed blocks of
``max_length`` tokens: every batch is ``batch_size x max_length``. ``packing=False`` keeps one document per row,
truncated to ``max_length`` and padded per batch (padding masked out of the loss). Either way ``max_length`` is
the declared longest row, so :meth:`TextDataModule.longest_batch` gives ``MemoryBudget`` the batch to plan on.
``max_length="auto"`` leaves the length to ``MemoryBudget``: the longest its budget fits, at most what the data allows
(packing: one batch of blocks from the training share; else the longest document), said in one line.
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

import math
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Sampler

from lightning_memkit.common.validation import check_bool, check_int, check_number

__all__ = ["TextDataModule", "train_tokenizer"]

_KINDS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text"}
_OWNER = "TextDataModule"
_PACKED = 1000  # documents concatenated at a time when packing (the tail of each group is dropped)


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
        max_length: tokens per row: the block length when packing, the truncation length otherwise; ``"auto"``: the
            longest that fits the budget of the Trainer's ``MemoryBudget``, chosen before the first step.
        packing: fixed blocks of concatenated documents (``True``) or one padded document per row.
        batch_size: rows per batch.
        val_fraction: share of the rows held out for validation (0: none).
        seed: seed of the split and of each epoch's shuffle.
        num_workers: DataLoader workers.
    """

    def __init__(self, path: str, tokenizer: str, text_field: str = "text", max_length: int | str = 1024,
                 packing: bool = True, batch_size: int = 8, val_fraction: float = 0.05, seed: int = 0,
                 num_workers: int = 0) -> None:
        super().__init__()
        check_int(max_length, "max_length", minimum=1, also=("auto",), owner=_OWNER)
        check_int(batch_size, "batch_size", minimum=1, owner=_OWNER)
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
        self._documents: Any = None  # max_length="auto": the tokenized documents, cut once a length is chosen
        self.max_length: int | None = None if max_length == "auto" else max_length

    # -- data ------------------------------------------------------------------------------------------
    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None or self._documents is not None:
            return
        from transformers import AutoTokenizer

        hp = self.hparams
        self._tokenizer = AutoTokenizer.from_pretrained(hp.tokenizer)
        self._documents = _encoded(_load(hp.path), self._tokenizer, hp.text_field, self.max_length, hp.packing)
        if self.max_length is not None:
            self._cut(self.max_length)

    def auto_length_limit(self) -> int | None:
        """``max_length="auto"`` before a length is chosen: the most tokens per row the data allows (packing: the
        training share's tokens over one batch; else the longest document), else ``None``."""
        if self.max_length is not None or self._documents is None:
            return None
        import pyarrow.compute as pc

        # each document's length from its Arrow list offsets: no token id read into Python
        lengths = pc.list_value_length(self._documents.with_format("arrow")["input_ids"]).to_pylist()
        if not self.hparams.packing:
            return max(lengths)
        chunks = [sum(lengths[i:i + _PACKED]) for i in range(0, len(lengths), _PACKED)]

        def batches(tokens: int) -> bool:  # a training batch of blocks of ``tokens``, after the validation share
            rows = sum(c // tokens for c in chunks)
            return rows - math.ceil(rows * self.hparams.val_fraction) >= self.batch_size

        low, high = 2, max(chunks)  # the longest block that still makes one batch (fewer rows the longer)
        if not batches(low):
            raise ValueError(f"{_OWNER}(path={self.hparams.path!r}): {sum(lengths)} tokens, fewer than one batch of "
                             f"{self.batch_size} rows of 2 tokens")
        while low < high:
            middle = (low + high + 1) // 2
            low, high = (middle, high) if batches(middle) else (low, middle - 1)
        return low

    def batch_at(self, tokens: int) -> dict[str, torch.Tensor]:
        """A batch of ``batch_size`` rows of ``tokens`` tokens, as the loader collates them (to plan on)."""
        check_int(tokens, "tokens", minimum=1, owner=f"{_OWNER}.batch_at")
        return self._collate([{"input_ids": torch.zeros(tokens, dtype=torch.long)}] * self.batch_size)

    def set_max_length(self, tokens: int) -> None:
        """Cut the documents into rows of ``tokens`` (``max_length="auto"``: called by ``MemoryBudget`` with the
        longest length that fits its budget, before the first step)."""
        check_int(tokens, "max_length", minimum=1, owner=_OWNER)
        if self._documents is None:
            raise ValueError(f"{_OWNER}.set_max_length: call setup() first")
        self.max_length = tokens
        self._cut(tokens)

    def _cut(self, max_length: int) -> None:
        hp = self.hparams
        rows = _rows(self._documents, max_length, hp.packing)
        train, val = rows, None
        if hp.val_fraction > 0 and len(rows) > 1:
            split = rows.train_test_split(test_size=hp.val_fraction, seed=hp.seed)
            train, val = split["train"], split["test"]
        if len(train) < hp.batch_size:
            share = " for training" if val is not None else ""
            raise ValueError(f"{_OWNER}(path={hp.path!r}): {len(train)} rows of {max_length} tokens{share}, fewer "
                             f"than one batch of {hp.batch_size}")
        self.train_set, self.val_set = train, val
        self.train_set.set_format("torch")
        if self.val_set is not None:
            self.val_set.set_format("torch")

    def _ready(self) -> None:
        if self.train_set is None and self.max_length is None and self._documents is not None:
            raise ValueError(f"{_OWNER}(max_length='auto'): no length chosen yet: put MemoryBudget on the Trainer (it "
                             "trains at the longest length its budget fits) or give max_length a number")

    def train_dataloader(self) -> DataLoader:
        """An :class:`~lightning_memkit.common.stateful_loader.EpochStatefulLoader` (torchdata's
        ``StatefulDataLoader``): Lightning saves its position with every checkpoint and restores it, so a run resumed
        mid-epoch sees the rest of that epoch's batches, in order, and one resumed at an epoch's end the next epoch."""
        from lightning_memkit.common.stateful_loader import EpochStatefulLoader

        self._ready()
        return EpochStatefulLoader(self.train_set, batch_size=self.batch_size, drop_last=True,
                                   sampler=_EpochShuffle(len(self.train_set), self.hparams.seed),
                                   collate_fn=self._collate, num_workers=self.hparams.num_workers)

    def val_dataloader(self) -> DataLoader | list:
        self._ready()
        if self.val_set is None:
            return []
        return DataLoader(self.val_set, batch_size=self.batch_size, collate_fn=self._collate,
                          num_workers=self.hparams.num_workers)

    def longest_batch(self) -> dict[str, torch.Tensor]:
        """The largest batch the run will see: ``batch_size`` rows of ``max_length`` tokens (``MemoryBudget``
        plans on it)."""
        self._ready()
        rows = [self.train_set[i] for i in range(self.batch_size)]
        return self._collate(rows, pad_to=self.max_length)

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


def _encoded(rows: Any, tokenizer: Any, field: str, max_length: int | None, packing: bool) -> Any:
    """The documents' token ids: each ended by the EOS token when packing, else truncated to ``max_length`` (whole
    where it is not known yet)."""
    if field not in rows.column_names:
        raise ValueError(f"{_OWNER}(text_field={field!r}): the data has the columns {rows.column_names}")
    eos = tokenizer.eos_token_id
    if packing and eos is None:
        raise ValueError(f"{_OWNER}(packing=True): the tokenizer has no EOS token to end each document with")

    def encode(batch: dict[str, list]) -> dict[str, list]:
        if packing:
            return {"input_ids": [ids + [eos] for ids in tokenizer(batch[field])["input_ids"]]}
        cut = {"truncation": True, "max_length": max_length} if max_length else {}
        return {"input_ids": tokenizer(batch[field], **cut)["input_ids"]}

    return rows.map(encode, batched=True, remove_columns=rows.column_names, desc="tokenizing")


def _rows(documents: Any, max_length: int, packing: bool) -> Any:
    """The training rows: blocks of ``max_length`` tokens of the concatenated documents when packing, else each
    document truncated to ``max_length``; rows of one token dropped."""

    def blocks(batch: dict[str, list]) -> dict[str, list]:
        flat = [t for ids in batch["input_ids"] for t in ids]
        whole = len(flat) // max_length * max_length
        return {"input_ids": [flat[i:i + max_length] for i in range(0, whole, max_length)]}

    if packing:
        rows = documents.map(blocks, batched=True, batch_size=_PACKED, desc=f"packing into blocks of {max_length}")
    else:
        rows = documents.map(lambda r: {"input_ids": r["input_ids"][:max_length]}, desc="truncating")
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
