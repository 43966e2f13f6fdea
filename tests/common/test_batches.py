"""Batches: rows, micro-batch splits whose weighted losses are the whole batch's, the longest batch of a data set,
and the global random states left as they were."""

from __future__ import annotations

import random

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from lightning_memkit.common.batches import (
    batch_rows,
    chunk_rows,
    longest_batch,
    rng_untouched,
    sample_length,
    split_batch,
)
from lightning_memkit.demo.variable_text import pad_hf


@pytest.mark.parametrize("rows, max_rows", [(8, 3), (29, 8), (5, 5), (1, 4), (7, 1)])
def test_chunks_cover_every_row_once_and_are_at_most_max_rows(rows, max_rows) -> None:
    bounds = chunk_rows(rows, max_rows)
    assert bounds[0][0] == 0 and bounds[-1][1] == rows
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:], strict=False))
    sizes = [b - a for a, b in bounds]
    assert max(sizes) <= max_rows and max(sizes) - min(sizes) <= 1 and len(bounds) == -(-rows // max_rows)


def _mean_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """A transformers causal LM's loss: shifted, mean over the labels that are not -100."""
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)


def test_token_weights_make_the_padded_batch_mean() -> None:
    torch.manual_seed(0)
    batch = pad_hf([torch.randint(0, 9, (n,)) for n in (3, 17, 9, 12, 2)])
    logits = torch.randn(5, batch["input_ids"].shape[1], 9, dtype=torch.float64)
    whole = _mean_loss(logits, batch["labels"])
    parts = split_batch({**batch, "logits": logits}, 2)
    assert [batch_rows(c) for c, _ in parts] == [2, 2, 1] and sum(w for _, w in parts) == pytest.approx(1)
    assert sum(w * _mean_loss(c["logits"], c["labels"]) for c, w in parts) == pytest.approx(float(whole), abs=1e-12)
    rows = split_batch({**batch, "logits": logits}, 2, weight="rows")
    assert [w for _, w in rows] == [0.4, 0.4, 0.2]  # a mean over samples: rows


def test_row_weights_make_a_per_sample_mean_and_sum_weights_a_sum() -> None:
    x = torch.randn(7, 3, dtype=torch.float64)
    for weight, whole in (("rows", x.sum(1).mean()), ("sum", x.sum())):
        parts = split_batch((x, x), 3, weight=weight)
        loss = (lambda c: c[0].sum(1).mean()) if weight == "rows" else (lambda c: c[0].sum())
        assert sum(w * loss(c) for c, w in parts) == pytest.approx(float(whole), abs=1e-12)
    assert all(c[0].data_ptr() == x[a:].data_ptr() for (c, _), (a, _b) in zip(split_batch((x, x), 3),
                                                                              chunk_rows(7, 3), strict=True))


def test_a_batch_without_rows_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"tensors \(4x2, 3x2\) have no common leading size"):
        split_batch((torch.zeros(4, 2), torch.zeros(3, 2)), 2)
    with pytest.raises(ValueError, match="weight='tokens'"):
        split_batch(torch.zeros(4, 2), 2, weight="tokens")
    assert split_batch((torch.zeros(4, 2), torch.zeros(3, 2)), None)[0][1] == 1.0


def test_the_longest_batch_is_the_longest_samples_padded() -> None:
    samples = [torch.arange(n) for n in (5, 40, 7, 33, 12, 40)]
    batch, line = longest_batch(DataLoader(samples, batch_size=3, collate_fn=pad_hf))
    assert tuple(batch["input_ids"].shape) == (3, 40) and int(batch["attention_mask"].sum()) == 40 + 40 + 33
    assert line == "the 3 longest of all 6 samples (40 and 33 elements)"
    dicts = [{"input_ids": list(range(n))} for n in (4, 9)]
    assert sample_length(dicts[1]) == 9 and sample_length((torch.zeros(2, 3), torch.zeros(5))) == 6


def test_text_tokenized_in_collate_fn_is_measured_as_the_model_receives_it() -> None:
    """Samples of text have no length of their own: each is collated alone (here: its UTF-8 bytes as tokens, with
    a prefix the collator adds) and the longest collated ones make the batch; no "0 elements"."""
    def tokenize(texts: list[str]) -> dict[str, torch.Tensor]:
        return pad_hf([torch.tensor([1, 2, *t.encode()]) for t in texts])

    texts = ["short", "a rather longer line of text", "mid-sized line", "é" * 20]  # 40 bytes, 22 characters
    batch, line = longest_batch(DataLoader(texts, batch_size=2, collate_fn=tokenize))
    assert tuple(batch["input_ids"].shape) == (2, 42)
    assert line == "the 2 longest of all 4 samples (42 and 30 elements, each sample collated alone)"
    records = [{"text": t} for t in texts]  # a dict of strings: the same
    assert longest_batch(DataLoader(records, batch_size=2, collate_fn=lambda rs: tokenize([r["text"] for r in rs])))[
        1] == line
    # nothing has a length, collated or not: no scan (the budget plans on the first batch and says why)
    assert longest_batch(DataLoader(texts, batch_size=2, collate_fn=lambda ts: ts)) is None


def test_the_scan_stops_at_its_time_limit_and_says_so() -> None:
    loader = DataLoader([torch.ones(n, dtype=torch.long) for n in range(1, 50)], batch_size=2, collate_fn=pad_hf)
    batch, line = longest_batch(loader, seconds=0)
    assert line == "the 2 longest of the first 2 (the 0 s limit) of 49 samples (2 and 1 elements)"
    assert tuple(batch["input_ids"].shape) == (2, 2)  # a whole batch, of the samples read


def test_no_scan_without_a_sized_indexable_data_set() -> None:
    class Stream(IterableDataset):
        def __iter__(self):
            yield from (torch.zeros(3) for _ in range(4))

    assert longest_batch(DataLoader(Stream(), batch_size=2)) is None
    assert longest_batch(DataLoader([torch.zeros(2)] * 4, batch_sampler=[[0, 1], [2, 3]])) is None


def test_reading_the_data_leaves_the_global_random_states_alone() -> None:
    class Drawing(torch.utils.data.Dataset):
        def __len__(self):
            return 6

        def __getitem__(self, i):
            random.random()
            return torch.randn(int(torch.randint(2, 9, ())))

    torch.manual_seed(1)
    random.seed(1)
    expected = torch.rand(3), random.random()
    torch.manual_seed(1)
    random.seed(1)
    with rng_untouched():
        longest_batch(DataLoader(Drawing(), batch_size=2, shuffle=True, collate_fn=lambda b: b))
    assert torch.equal(torch.rand(3), expected[0]) and random.random() == expected[1]
