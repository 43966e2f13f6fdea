"""Layers that pass tuples: LayerChain, the per-call stage scratch, BatchLoss, and their costs (one process)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_memkit.pipeline import BatchLoss, LayerChain, measure_layer_costs, stage_scratch
from lightning_memkit.pipeline.runtime import measure_pipeline_costs


class Scale(nn.Module):
    """``(x, mask) -> (w * x * mask, mask)``; records the scratch dict it saw."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.tensor(2.0))
        self.seen: list = []

    def forward(self, x, mask):
        scratch = stage_scratch()
        self.seen.append(scratch)
        if scratch is not None:
            scratch[id(self)] = True
        return self.w * x * mask, mask


class Sum(nn.Module):
    def forward(self, x, mask):
        return x.sum(-1)


def test_layer_chain_unpacks_tuples_and_shares_one_scratch_per_call():
    a, b = Scale(), Scale()
    chain = LayerChain(a, b, Sum())
    x, mask = torch.ones(2, 3), torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert chain(x, mask).tolist() == [8.0, 4.0]
    assert a.seen[0] is b.seen[0] and a.seen[0] == {id(a): True, id(b): True}  # one dict for the whole call
    chain(x, mask)
    assert a.seen[1] is not a.seen[0] and a.seen[1] == {id(a): True, id(b): True}  # a fresh one per call
    assert stage_scratch() is None
    a(x, mask)
    assert a.seen[-1] is None  # outside a chain: no scratch
    assert LayerChain()(x) is x  # an empty chain passes its input through


def test_a_sending_chain_refuses_tuples_on_an_older_torch(monkeypatch):
    class Split(nn.Module):
        def forward(self, x):
            return x, x.long()

    chain = LayerChain(Split())
    chain.sends = True
    assert len(chain(torch.ones(2))) == 2  # this torch passes tuples between stages
    monkeypatch.setattr(torch, "__version__", "2.11.0+cu130")
    with pytest.raises(TypeError, match=r"passes a tuple of 2 tensors to the next one, which needs torch >= 2\.13"):
        chain(torch.ones(2))
    chain.sends = False  # the last stage's output goes to the loss, not to torch's stage transfer
    assert len(chain(torch.ones(2))) == 2


def test_scratch_is_closed_when_a_layer_raises():
    class Boom(nn.Module):
        def forward(self, *args):
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        LayerChain(Scale(), Boom())(torch.ones(1), torch.ones(1))
    assert stage_scratch() is None


def test_batch_loss_defaults():
    class Plain(BatchLoss):
        def __call__(self, output, target):
            return (output - target).abs().mean()

    loss = Plain()
    assert float(loss.end([torch.tensor(1.0), torch.tensor(3.0)])) == 2.0
    assert float(loss.whole(torch.ones(3), torch.zeros(3))) == 1.0
    assert loss.observes_forward is False
    with pytest.raises(NotImplementedError, match="must implement __call__"):
        BatchLoss()(torch.ones(1), torch.ones(1))


def test_costs_of_layers_that_pass_tuples():
    """Tuple outputs count every storage once; an int mask passed through adds its bytes; it never requires grad."""
    layers = [Scale(), Scale(), Sum()]
    x, mask = torch.ones(4, 8), torch.ones(4, 8, dtype=torch.int64)
    costs = measure_layer_costs(layers, (x, mask), optimizer="sgd")
    assert [c.output_bytes for c in costs] == [4 * 8 * 4 + 4 * 8 * 8] * 2 + [4 * 4]

    class Mean(BatchLoss):
        def begin(self, target, microbatches):
            self.started = (target.shape, microbatches)

        def __call__(self, output, target):
            return (output - target).pow(2).mean()

    loss = Mean()
    measure_pipeline_costs(layers, (x, mask), torch.zeros(4), loss_fn=loss, optimizer="sgd")
    assert loss.started == (torch.Size([4]), 1)  # a BatchLoss is told about the one measured microbatch
