"""Training batches as nested tensors: their rows, their tensors, their split into micro-batches, and the longest
batch a data set can give.

A batch is a tensor or nested dicts, lists and tuples of them (what a ``DataLoader`` collates); its rows are the
common leading size of its tensors. :func:`split_batch` cuts it into micro-batches of at most ``max_rows`` rows
(views, no copy), each with the weight that makes the weighted sum of their mean losses the loss of the whole
batch; :func:`longest_batch` collates the longest samples of a sized data set, the largest batch its loader can
give.

Example::

    >>> import torch
    >>> from lightning_memkit.common.batches import batch_rows, split_batch
    >>> batch = {"input_ids": torch.zeros(5, 8, dtype=torch.long), "labels": torch.zeros(5, 8, dtype=torch.long)}
    >>> batch_rows(batch)
    5
    >>> [(batch_rows(chunk), round(weight, 2)) for chunk, weight in split_batch(batch, 2)]
    [(2, 0.4), (2, 0.4), (1, 0.2)]
"""

from __future__ import annotations

import contextlib
import math
import random
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

__all__ = ["WEIGHTS", "batch_rows", "batch_tensors", "batch_elements", "batch_shape", "micro_batch", "row_slice",
           "split_batch", "chunk_rows", "longest_batch", "sample_length", "rng_untouched"]

WEIGHTS = ("auto", "rows", "tokens", "sum")
IGNORE_INDEX = -100  # transformers' label for "no loss here"


def batch_tensors(batch: Any) -> Iterator[torch.Tensor]:
    """Every tensor in ``batch`` (nested dicts, lists, tuples)."""
    if isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, Mapping):
        for v in batch.values():
            yield from batch_tensors(v)
    elif isinstance(batch, (list, tuple)):
        for v in batch:
            yield from batch_tensors(v)


def batch_rows(batch: Any) -> int | None:
    """The common leading size of every tensor in ``batch`` with a dimension, or None if they differ or there is
    none."""
    sizes = {t.shape[0] for t in batch_tensors(batch) if t.dim() > 0}
    return sizes.pop() if len(sizes) == 1 else None


def batch_elements(batch: Any) -> int:
    """The elements of every tensor in ``batch``: how large a batch is, to compare it with another."""
    return sum(t.numel() for t in batch_tensors(batch))


def batch_shape(batch: Any) -> str:
    """The shapes of the batch's tensors in words, e.g. ``"input_ids 8x256, labels 8x256"``."""
    if isinstance(batch, Mapping):
        parts = [f"{k} {'x'.join(map(str, v.shape))}" for k, v in batch.items() if isinstance(v, torch.Tensor)]
    else:
        parts = ["x".join(map(str, t.shape)) for t in batch_tensors(batch)]
    return ", ".join(parts) or "no tensors"


def row_slice(batch: Any, start: int, stop: int) -> Any:
    """``batch`` with rows ``start:stop`` of every tensor that has a dimension (views); other leaves as they are."""
    if isinstance(batch, torch.Tensor):
        return batch[start:stop] if batch.dim() > 0 else batch
    if isinstance(batch, Mapping):
        return type(batch)({k: row_slice(v, start, stop) for k, v in batch.items()})
    if isinstance(batch, (list, tuple)):
        items = [row_slice(v, start, stop) for v in batch]
        return type(batch)(*items) if hasattr(batch, "_fields") else type(batch)(items)
    return batch


def micro_batch(batch: Any, rows: int) -> Any:
    """``batch`` with the first ``rows`` rows of every tensor (the first micro-batch of a split)."""
    return row_slice(batch, 0, rows)


def chunk_rows(rows: int, max_rows: int) -> list[tuple[int, int]]:
    """``(start, stop)`` of the fewest micro-batches of at most ``max_rows`` rows, as equal as can be, larger first.

    Example::

        >>> chunk_rows(29, 8)
        [(0, 8), (8, 15), (15, 22), (22, 29)]
    """
    count = max(math.ceil(rows / max_rows), 1)
    base, extra = divmod(rows, count)
    bounds, start = [], 0
    for i in range(count):
        stop = start + base + (i < extra)
        bounds.append((start, stop))
        start = stop
    return bounds


def _label_tokens(batch: Any) -> torch.Tensor | None:
    """The tokens each row of an HF causal-LM batch has a loss on (labels shifted by one, ``-100`` ignored), or
    None when ``batch`` has no two-dimensional ``labels`` tensor."""
    labels = batch.get("labels") if isinstance(batch, Mapping) else None
    if not isinstance(labels, torch.Tensor) or labels.dim() < 2:
        return None
    return (labels[..., 1:] != IGNORE_INDEX).flatten(1).sum(1)


def _weights(batch: Any, bounds: list[tuple[int, int]], weight: str) -> list[float]:
    rows = bounds[-1][1]
    if weight == "sum":
        return [1.0] * len(bounds)
    tokens = _label_tokens(batch) if weight in ("auto", "tokens") else None
    if weight == "tokens" and tokens is None:
        raise ValueError("split_batch(weight='tokens') needs a batch with a two-dimensional 'labels' tensor")
    if tokens is not None and int(tokens.sum()) > 0:
        total = int(tokens.sum())
        return [int(tokens[a:b].sum()) / total for a, b in bounds]
    return [(b - a) / rows for a, b in bounds]


def split_batch(batch: Any, max_rows: int | None, weight: str = "auto") -> list[tuple[Any, float]]:
    """``batch`` cut into micro-batches of at most ``max_rows`` rows, each with its loss weight.

    A loss that is a mean over the batch is the weighted sum of the micro-batches' mean losses: ``"rows"`` weighs a
    micro-batch by its rows (a mean over samples), ``"tokens"`` by the label tokens it has a loss on (a
    transformers causal LM's mean over the labels that are not ``-100``, after its shift by one), ``"auto"`` by
    tokens when the batch is a dict with a two-dimensional ``labels`` tensor and by rows otherwise, ``"sum"`` by 1
    (a loss summed over the batch). ``max_rows=None`` or at least the batch's rows: the batch itself, weight 1.

    Raises:
        ValueError: the batch's tensors have no common leading size (there are no rows to split).
    """
    if weight not in WEIGHTS:
        raise ValueError(f"split_batch(weight={weight!r}): allowed: {', '.join(WEIGHTS)}")
    rows = batch_rows(batch)
    if max_rows is None or (rows is not None and rows <= max_rows):
        return [(batch, 1.0)]
    if rows is None:
        raise ValueError(f"split_batch: the batch's tensors ({batch_shape(batch)}) have no common leading size, so "
                         "it has no rows to split into micro-batches")
    bounds = chunk_rows(rows, max_rows)
    weights = _weights(batch, bounds, weight)
    return [(row_slice(batch, a, b), w) for (a, b), w in zip(bounds, weights, strict=True)]


# -- the longest batch of a data set --------------------------------------------------------------------------
@contextlib.contextmanager
def rng_untouched(device: torch.device | str | None = None) -> Iterator[None]:
    """Run the block without changing the global random states of torch (CPU and one CUDA device), ``random`` and
    numpy: what it draws, the run after it does not see.

    ``device``: the CUDA device whose generator is kept (a CPU device: none); ``None``: the current CUDA device once
    CUDA is initialized. Only that one: reading another device's state would start a CUDA context on it.
    """
    state = random.getstate()
    numpy_state = None
    with contextlib.suppress(ImportError):
        import numpy

        numpy_state = numpy.random.get_state()
    devices = _cuda_devices(device)
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        random.setstate(state)
        if numpy_state is not None:
            numpy.random.set_state(numpy_state)


def _cuda_devices(device: torch.device | str | None) -> list[int]:
    if device is None:
        return [torch.cuda.current_device()] if torch.cuda.is_initialized() else []
    device = torch.device(device)
    return [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []


def sample_length(sample: Any) -> int:
    """How long one sample is: the most elements of any tensor in it, or the longest list of numbers (a tokenized
    text); 0 if it holds neither."""
    if isinstance(sample, torch.Tensor):
        return sample.numel()
    if isinstance(sample, Mapping):
        return max((sample_length(v) for v in sample.values()), default=0)
    if isinstance(sample, (list, tuple)):
        if sample and all(isinstance(v, (int, float)) for v in sample):
            return len(sample)
        return max((sample_length(v) for v in sample), default=0)
    return 0


def longest_batch(loader: Any, seconds: float = 30.0,
                  progress: Callable[[str], None] | None = None) -> tuple[Any, str] | None:
    """The batch of the ``batch_size`` longest samples of ``loader``'s data set, collated by its ``collate_fn`` (so
    padded to the longest, as a padding collator pads), and one line saying how it was found; None when the loader
    has no sized, indexable data set with automatic batching (an iterable data set, a batch sampler), or when no
    sample has a length. A sample is as long as its largest tensor or list of numbers; samples without either (text
    that the ``collate_fn`` tokenizes) are measured collated, one at a time, as the model will receive them.

    The scan reads the samples in order for at most ``seconds`` (a batch's worth at least); a scan cut short gives
    the longest samples read (the line says how many of how many). ``progress`` gets a line every 5 s. The global
    random states are untouched (:func:`rng_untouched`): a data set that draws while reading does not change the
    run's data.

    Example::

        >>> import torch
        >>> from torch.utils.data import DataLoader
        >>> from torch.nn.utils.rnn import pad_sequence
        >>> samples = [torch.ones(n, dtype=torch.long) for n in (3, 9, 4, 7)]
        >>> loader = DataLoader(samples, batch_size=2, collate_fn=lambda b: pad_sequence(b, batch_first=True))
        >>> batch, line = longest_batch(loader)
        >>> tuple(batch.shape), line
        ((2, 9), 'the 2 longest of all 4 samples (9 and 7 elements)')
    """
    dataset, size = getattr(loader, "dataset", None), getattr(loader, "batch_size", None)
    if size is None or isinstance(dataset, torch.utils.data.IterableDataset) or not _sized(dataset):
        return None
    total = len(dataset)
    if total == 0:
        return None
    lengths: list[tuple[int, int]] = []
    start = last = time.perf_counter()
    with rng_untouched():
        # samples of text (or anything without tensors or token lists) are measured as the model gets them:
        # each collated alone by the loader's collate_fn (a tokenizing collator tokenizes it)
        collated = sample_length(dataset[0]) == 0 and loader.collate_fn is not None
        measure = (lambda sample: sample_length(loader.collate_fn([sample]))) if collated else sample_length
        for i in range(total):
            lengths.append((measure(dataset[i]), i))
            now = time.perf_counter()
            if now - start > seconds and len(lengths) >= size:
                break
            if progress is not None and now - last > 5:
                last = now
                progress(f"scanning sample lengths: {i + 1}/{total} ({now - start:.0f} s)")
        top = sorted(lengths, key=lambda li: (-li[0], li[1]))[:min(size, total)]
        if top[0][0] == 0:  # nothing in them has a length, collated or not
            return None
        batch = loader.collate_fn([dataset[i] for _, i in top])
    scanned = "all" if len(lengths) == total else f"the first {len(lengths)} (the {seconds:g} s limit) of"
    unit = "elements, each sample collated alone" if collated else "elements"
    line = (f"the {len(top)} longest of {scanned} {total} samples ({top[0][0]} and {top[-1][0]} {unit})"
            if len(top) > 1 else f"the longest of {scanned} {total} samples ({top[0][0]} {unit})")
    return batch, line


def _sized(dataset: Any) -> bool:
    try:
        len(dataset)
    except TypeError:
        return False
    return callable(getattr(dataset, "__getitem__", None)) and not isinstance(dataset, (str, bytes))

