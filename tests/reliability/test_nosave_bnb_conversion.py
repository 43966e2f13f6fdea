"""NoSaveBitsandbytesPrecision.convert_module: empty layers are refused by name up front; tied weights stay tied."""

import logging

import pytest
import torch
from torch import nn

pytest.importorskip("bitsandbytes")

from lightning_memkit.plugins import NoSaveBitsandbytesPrecision  # noqa: E402

MODES = ["nf4", "int8"]


def _dtype(mode):
    return torch.float16 if mode == "int8" else torch.float32


def _plugin(mode, **kw):
    return NoSaveBitsandbytesPrecision(mode, _dtype(mode), **kw)


class WithEmpty(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Linear(64, 64)
        self.body = nn.Sequential(nn.Linear(64, 64), nn.Linear(0, 8), nn.Linear(8, 4))


class TiedLM(nn.Module):
    def __init__(self, vocab=32, hidden=64):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.body = nn.Linear(hidden, hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        self.lm_head.weight = self.embed.weight

    def forward(self, tokens):
        return self.lm_head(torch.relu(self.body(self.embed(tokens))))


@pytest.mark.parametrize("mode", MODES)
def test_empty_linear_is_refused_by_name_before_anything_is_converted(mode):
    model = WithEmpty()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match=r"NoSaveBitsandbytesPrecision: Linear layer\(s\) 'body.1' \(in_features=0, "
                                         r"out_features=8\) of WithEmpty have no weights"):
        _plugin(mode, lora_rank=2).convert_module(model)
    assert all(type(m) is nn.Linear for m in (model.first, *model.body))
    assert {n: p for n, p in model.named_parameters()}.keys() == before.keys()  # no adapter was added
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), before[n]) and p.requires_grad, n


def test_empty_linear_listed_in_ignore_modules_is_left_alone():
    model = _plugin("nf4", ignore_modules={"body.1"}).convert_module(WithEmpty())
    assert type(model.body[1]) is nn.Linear
    assert type(model.first).__name__ == "NoSaveNF4Linear" and type(model.body[2]).__name__ == "NoSaveNF4Linear"


@pytest.mark.parametrize("mode", MODES)
def test_head_tied_to_the_embedding_stays_tied_and_unquantized(mode, caplog):
    caplog.set_level(logging.INFO, logger="lightning_memkit")
    model = TiedLM()
    embed_before = model.embed.weight.detach().clone()
    model = _plugin(mode, lora_rank=2).convert_module(model)
    assert model.lm_head.weight is model.embed.weight
    assert type(model.lm_head) is nn.Linear and torch.equal(model.embed.weight.detach(), embed_before)
    assert type(model.body).__name__.startswith("NoSave") and model.body.lora is not None
    assert "'lm_head' stays an unquantized nn.Linear: its parameters are shared with embed.weight" in caplog.text
    out = model(torch.tensor([[1, 2, 3]]))
    out.float().sum().backward()
    assert model.embed.weight.grad is not None and model.body.lora.B.grad is not None


def test_linear_registered_under_two_names_stays_one_module():
    shared = nn.Linear(64, 64)
    model = nn.Sequential(shared, nn.ReLU(), shared, nn.Linear(64, 8))
    weight = shared.weight.detach().clone()
    model = _plugin("nf4").convert_module(model)
    assert model[0] is model[2] is shared and torch.equal(shared.weight.detach(), weight)
    assert type(model[3]).__name__ == "NoSaveNF4Linear"
