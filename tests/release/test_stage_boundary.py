import contextlib

import pytest
import torch
from torch import nn

from lightning_memkit.demo.moe import MoEFeedForward
from lightning_memkit.memory import (
    LivePeak,
    PoisonedReadError,
    UnsafeReleaseError,
    release_stage_boundaries,
    stage_boundaries_enabled,
    stage_boundary,
)
from lightning_memkit.ops.padded_index_gather import padded_rows
from lightning_memkit.release.storage_release import is_released


class Exchange(nn.Module):
    def __init__(self, copy):
        super().__init__()
        self.copy = copy

    def forward(self, x):
        return x.clone() if self.copy else x


def _act(*shape):
    return torch.randn(*shape, requires_grad=True) * 2


def test_marks_are_noops_outside_a_block_but_still_validated():
    assert not stage_boundaries_enabled()
    h = _act(4, 4)
    assert stage_boundary(h, consumers=h + 1) is h
    assert not is_released(h)
    with pytest.raises(ValueError, match="leaf that requires grad"):
        stage_boundary(torch.randn(3, requires_grad=True), consumers=h)
    with pytest.raises(TypeError, match="consumers=...\\) must be a module, a tensor"):
        stage_boundary(h, consumers="exchange")
    with pytest.raises(TypeError, match="only modules or only tensors"):
        stage_boundary(h, consumers=[nn.Identity(), h])
    m = nn.Identity()
    with pytest.raises(ValueError, match="lists a module twice"):
        stage_boundary(h, consumers=[m, m])
    with pytest.raises(ValueError, match="on_refuse='drop'"):
        stage_boundary(h, consumers=m, on_refuse="drop")
    with pytest.raises(TypeError, match="check=...\\) must be a bool"), release_stage_boundaries(check="no"):
        pass


def test_released_after_every_consumer_module_ran():
    a, b = Exchange(copy=True), Exchange(copy=True)
    h = _act(8, 4)
    with release_stage_boundaries() as stats:
        assert stage_boundaries_enabled()
        stage_boundary(h, consumers=[a, b])
        ya = a(h)
        assert not is_released(h)  # b has not run yet
        yb = b(h)
        assert is_released(h)
        assert not a._forward_hooks and not b._forward_hooks
    assert stats.released == 1 and stats.released_bytes == 8 * 4 * 4
    assert torch.equal(ya, yb) and not stage_boundaries_enabled()


def test_tensor_consumers_release_now():
    h = _act(16, 2)
    with release_stage_boundaries() as stats:
        y = h.sum(dim=1)
        stage_boundary(h, consumers=y)
        assert is_released(h)
    assert stats.released_bytes == 128


def test_identity_exchange_is_refused_or_kept():
    # the DualPipeV failure: with expert parallelism off the exchange returns its input,
    # so freeing the dispatch input would empty the expert input.
    ex, expert = Exchange(copy=False), nn.Linear(4, 4)
    h = _act(8, 4)
    with release_stage_boundaries(), pytest.raises(UnsafeReleaseError, match="returned its input"):
        stage_boundary(h, consumers=ex)
        expert(ex(h))
    assert not is_released(h)
    with release_stage_boundaries() as stats:
        stage_boundary(h, consumers=ex, on_refuse="keep")
        out = expert(ex(h))
    assert not is_released(h) and stats.released == 0 and len(stats.kept) == 1
    assert "returned its input" in stats.kept[0]
    out.sum().backward()


def test_poison_mode_catches_an_unchecked_identity_release():
    ex, expert = Exchange(copy=False), nn.Linear(4, 4)
    h = _act(8, 4)
    with release_stage_boundaries(check=False, poison=True), pytest.raises(PoisonedReadError, match="addmm"):
        stage_boundary(h, consumers=ex)
        expert(ex(h))


def test_block_exit_removes_waiting_hooks_even_on_error():
    m = Exchange(copy=True)
    h = _act(4)
    with pytest.raises(RuntimeError, match="boom"), release_stage_boundaries() as stats:
        stage_boundary(h, consumers=m)
        assert m._forward_hooks
        raise RuntimeError("boom")
    assert not m._forward_hooks and stats.pending == 1 and not is_released(h)
    m(h)
    assert not is_released(h)


def _moe_step(layer, x, g, release, keep_stages):
    ctx = release_stage_boundaries() if release else contextlib.nullcontext()
    with LivePeak() as lp, ctx as stats:
        keep = [] if keep_stages else None
        y = layer(x, keep=keep)
        ((y * g).sum() + layer.aux_loss).backward()
        del y, keep
    return lp.peak_bytes, stats


def _grads(layer, x):
    return [p.grad.clone() for p in layer.parameters()] + [x.grad.clone()]


@pytest.mark.parametrize("exchange", ["copy", "identity"])
def test_moe_gradients_bitwise_identical(exchange):
    results = []
    for release in (False, True):
        torch.manual_seed(0)
        layer = MoEFeedForward(32, n_experts=8, top_k=2, d_expert=16, exchange=exchange, pad_to_multiple=64)
        x = torch.randn(96, 32, requires_grad=True)
        _, stats = _moe_step(layer, x, torch.randn(96, 32), release, keep_stages=True)
        results.append(_grads(layer, x))
    for got, want in zip(*results):
        assert torch.equal(got, want)
    if exchange == "copy":
        assert stats.released == 2 and not stats.kept
        assert stats.released_bytes == (padded_rows(96 * 2, 64) + 96 * 2) * 32 * 4
    else:
        assert stats.released == 0 and len(stats.kept) == 2


@pytest.mark.parametrize("keep_stages", [False, True])
def test_moe_peak_reduced_by_a_quarter(keep_stages):
    # fine-grained experts (hidden 3/8 of the width, 8 of 32 experts per token), expert-parallel exchange
    peaks = {}
    for release in (False, True):
        torch.manual_seed(0)
        layer = MoEFeedForward(64, n_experts=32, top_k=8, d_expert=24, exchange="copy", pad_to_multiple=256)
        x = torch.randn(256, 64, requires_grad=True)
        peaks[release], _ = _moe_step(layer, x, torch.randn(256, 64), release, keep_stages)
    assert peaks[True] <= 0.75 * peaks[False], peaks
