"""The plugin's packed layers as FSDP2 needs them: plain parameters and buffers of the layer, bitsandbytes' state-dict
layout, the forward of bitsandbytes' weights; and under ``fully_shard`` on two gloo ranks (slow, run by
``_packed_fsdp2_worker.py``): the packed bytes gathered exactly, the losses of one process, checkpoints that round
trip through ``torch.distributed.checkpoint``."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import ranks
import torch
from torch import nn

bnb = pytest.importorskip("bitsandbytes")

from bitsandbytes.utils import unpack_tensor_to_dict  # noqa: E402

from lightning_memkit.ops.nosave_matmul import nosave_linear  # noqa: E402
from lightning_memkit.plugins import NoSaveBitsandbytesPrecision  # noqa: E402
from lightning_memkit.plugins.nosave_bitsandbytes import packed_modes  # noqa: E402
from lightning_memkit.plugins.packed_state import STATE_PARAMETERS  # noqa: E402

MODES = ["nf4", "nf4-dq", "fp4", "int8"]
IN, OUT = 64, 48
NAN_BF16 = torch.tensor([0xFF, 0x7F, 0x81, 0xFF, 0xC0, 0x7F, 0x81, 0x7F], dtype=torch.uint8)  # NaN read as bf16
WORKER = Path(__file__).with_name("_packed_fsdp2_worker.py")


def _dtype(mode: str) -> torch.dtype:
    return torch.float16 if mode == "int8" else torch.float32


def _model(mode: str, seed: int = 0, lora_rank: int = 4) -> nn.Module:
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(IN, OUT), nn.ReLU(), nn.Linear(OUT, IN, bias=False))
    model = NoSaveBitsandbytesPrecision(mode, _dtype(mode), lora_rank=lora_rank).convert_module(net)
    if lora_rank:
        with torch.no_grad():
            model[0].lora.B.normal_(0, 0.3)  # a fresh adapter is zero: make it contribute
    return model


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


def _bnb_layer(layer: nn.Module) -> nn.Module:
    """bitsandbytes' own layer over the same packed bytes, with the quant state bitsandbytes reads from the state
    dict: the layer type the plugin's layers were (their weight a ``Params4bit`` / ``Int8Params``)."""
    sd = layer.state_dict()
    if layer.weight.dtype == torch.int8:
        twin = bnb.nn.Linear8bitLt(IN, OUT, has_fp16_weights=False)
        twin.weight = bnb.nn.Int8Params(sd["weight"].clone(), requires_grad=False, has_fp16_weights=False,
                                        SCB=sd["SCB"].clone())
        twin.weight.CB = twin.weight.data
    else:
        stats = {k.removeprefix("weight."): v.clone() for k, v in sd.items() if k.startswith("weight.")}
        state = bnb.functional.QuantState.from_dict(stats, device=torch.device("cpu"))
        twin = bnb.nn.Linear4bit(IN, OUT, quant_type=state.quant_type, compress_statistics=state.nested,
                                 compute_dtype=layer.compute_dtype)
        twin.weight = bnb.nn.Params4bit(sd["weight"].clone(), requires_grad=False, quant_state=state,
                                        quant_type=state.quant_type, compress_statistics=state.nested,
                                        bnb_quantized=True)
    twin.bias = nn.Parameter(sd["bias"].clone(), requires_grad=False)
    return twin


# -- one process ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_a_converted_layer_holds_plain_frozen_tensors(mode):
    layer = _model(mode)[0]
    tensors = [*layer.named_parameters(recurse=False), *layer.named_buffers(recurse=False)]
    assert all(type(t) in (nn.Parameter, torch.Tensor) for _, t in tensors), [type(t) for _, t in tensors]
    assert layer.weight.dtype == (torch.int8 if mode == "int8" else torch.uint8)
    state = {n: t for n, t in layer.named_parameters(recurse=False) if n in STATE_PARAMETERS}
    expected = {"scb_bytes"} if mode == "int8" else {"absmax_bytes", "nested_absmax_bytes"}
    assert state.keys() == (expected if mode.endswith("-dq") or mode == "int8" else {"absmax_bytes"})
    assert all(t.dtype == torch.uint8 and t.dim() == 1 and not t.requires_grad for t in state.values())
    assert not layer.weight.requires_grad and all(b.dtype == torch.uint8 for b in layer.buffers(recurse=False))


@pytest.mark.parametrize("mode", MODES)
def test_the_state_dict_is_bitsandbytes_own_layout(mode):
    layer = _model(mode, lora_rank=0)[0]
    mine, theirs = layer.state_dict(), _bnb_layer(layer).state_dict()
    assert list(mine) == list(theirs)
    assert packed_modes(mine) == {mode}
    for key, value in theirs.items():
        if "bitsandbytes__" in key:  # the same JSON (a double-quantized one padded to a fixed width)
            assert unpack_tensor_to_dict(mine[key]) == unpack_tensor_to_dict(value)
        else:
            assert mine[key].dtype == value.dtype and torch.equal(mine[key], value), key


@pytest.mark.parametrize("mode", MODES)
def test_a_state_dict_round_trip_is_bitwise(mode):
    source, target = _model(mode), _model(mode, seed=1)
    saved = source.state_dict()
    assert not torch.equal(_bytes(target[0].weight), _bytes(source[0].weight))
    target.load_state_dict(saved)
    loaded = target.state_dict()
    assert list(loaded) == list(saved)
    assert all(torch.equal(_bytes(loaded[k]), _bytes(v)) for k, v in saved.items())
    for (name, a), (_, b) in zip([*source.named_parameters(), *source.named_buffers()],
                                 [*target.named_parameters(), *target.named_buffers()]):
        assert torch.equal(_bytes(a), _bytes(b)), name


@pytest.mark.parametrize("mode", MODES)
def test_forward_and_backward_equal_bitsandbytes_weights_bitwise(mode):
    """The layer against bitsandbytes' parameter of the same bytes (what the layer held before) through the same
    no-save matmul, and against bitsandbytes' own dequantization of them."""
    layer = _model(mode)[0]
    twin, lora, dtype = _bnb_layer(layer), layer.lora, _dtype(mode)
    x = torch.randn(2, 5, IN, dtype=dtype, requires_grad=True)
    ours = layer(x)
    before = nosave_linear(x, twin) + lora(x)
    if mode == "int8":
        dense = bnb.functional.int8_vectorwise_dequant(twin.weight.data, twin.weight.SCB)
    else:
        dense = bnb.functional.dequantize_4bit(twin.weight.data, twin.weight.quant_state)
    reference = torch.nn.functional.linear(x, dense.to(dtype), twin.bias.to(dtype)) + lora(x)
    assert torch.equal(ours, before) and torch.equal(ours, reference)
    grad = torch.linspace(-1, 1, ours.numel()).reshape(ours.shape).to(dtype)
    grads = [torch.autograd.grad(out, (x, lora.A, lora.B), grad) for out in (ours, before)]
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_packed_bytes_survive_chunk_and_cat_with_bf16_nan_patterns():
    """What FSDP2 does to a packed weight (chunk on dim 0, cat when gathering): the bytes stay, also read as bf16,
    where the pairs 0xFF 0x7F and the like are NaN."""
    weight = _model("nf4")[0].weight
    with torch.no_grad():
        weight.view(-1).copy_(NAN_BF16.repeat(weight.numel() // len(NAN_BF16)))
    as_bf16 = weight.detach().view(-1).view(torch.bfloat16)
    assert torch.isnan(as_bf16).all()
    for parts in (2, 3, 7):
        assert torch.equal(torch.cat(torch.chunk(weight.detach(), parts, dim=0)), weight.detach())
        assert torch.equal(_bytes(torch.cat(torch.chunk(as_bf16, parts, dim=0))), _bytes(weight))


@pytest.mark.parametrize("mode", ["nf4-dq", "int8"])
def test_moves_and_copies_keep_the_quant_state_bytes_and_the_bitsandbytes_attributes(mode):
    """``to(dtype)`` casts no quant-state byte; after a move or a copy the weight's bitsandbytes attributes are views
    of the layer's own tensors again."""
    model = _model(mode)
    x = torch.randn(3, IN, dtype=_dtype(mode))
    out = model(x)
    state = {n: _bytes(t).clone() for n, t in [*model.named_parameters(), *model.named_buffers()]
             if t.dtype == torch.uint8}
    moved = copy.deepcopy(model).to(torch.float64).to(_dtype(mode))
    for m in (copy.deepcopy(model), moved):
        assert all(torch.equal(_bytes(t), state[n]) for n, t in [*m.named_parameters(), *m.named_buffers()]
                   if n in state)
        w = m[0].weight
        held = w.SCB if mode == "int8" else w.quant_state.absmax
        own = m[0].scb_bytes if mode == "int8" else m[0].absmax_bytes
        assert held.untyped_storage().data_ptr() == own.untyped_storage().data_ptr()
    assert torch.equal(copy.deepcopy(model)(x), out)


@pytest.mark.parametrize("mode", ["nf4-dq", "int8"])
def test_a_layer_released_to_meta_saves_its_weight_and_bias_only(mode):
    """A pipeline rank moves the other stages' layers to ``meta``: their state dict entries are dropped as meta."""
    from lightning_memkit.pipeline.runtime import release_to_meta

    model = _model(mode, lora_rank=0)
    release_to_meta(model[0], set())
    assert {k: v.device.type for k, v in model.state_dict().items() if k.startswith("0.")} == {
        "0.weight": "meta", "0.bias": "meta"}


@pytest.mark.parametrize("mode", ["nf4-dq", "int8"])
def test_the_memory_table_counts_the_quant_state_once_with_the_weight(mode):
    from lightning_memkit.measure.report import static_memory_table

    model = _model(mode)
    layer, row = model[0], static_memory_table(model).rows[0]
    packed = [t for t in [*layer.parameters(recurse=False), *layer.buffers(recurse=False)] if not t.is_floating_point()]
    dense = [layer.bias, *layer.lora.parameters()]
    assert row.param_bytes == sum(t.numel() * t.element_size() for t in packed + dense)
    assert row.buffer_bytes == 0 and row.frozen == IN * OUT + OUT  # logical weight elements and the bias


# -- FSDP2, two gloo ranks -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sharded_runs(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("packed_fsdp2")
    return ranks.collect(WORKER, out, 2, 480, "packed FSDP2 run")


CASES = ["nf4-own", "nf4-dq-own", "int8-own", "nf4-peft"]


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_fully_shard_gathers_the_packed_bytes_exactly(sharded_runs, case):
    for rank, results in enumerate(sharded_runs):
        res = results[case]
        assert res["sharded_quant_state"], (rank, "the quant state is not sharded")
        assert res["gathered_equal"] and res["unsharded_equal"], (rank, res)
        assert res["packed_unchanged"], rank  # training leaves them as they were


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_fully_shard_training_has_the_losses_of_one_process(sharded_runs, case):
    for results in sharded_runs:
        res = results[case]
        assert res["max_loss_diff"] <= 1e-5, (res["losses"], res["reference"])


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_distributed_checkpoint_round_trips_the_packed_bytes_and_quant_state(sharded_runs, case):
    for results in sharded_runs:
        res = results[case]
        assert res["keys_as_one_process"] and res["packed_modes"] == [case.rsplit("-", 1)[0]]
        assert res["fresh_differed"] and res["loaded_equal"] and res["state_dict_mismatches"] == []


@pytest.mark.slow
def test_a_bf16_mixed_precision_policy_casts_no_packed_byte_and_trains_the_adapters(sharded_runs):
    for results in sharded_runs:
        assert results["mixed_precision"] == {"bytes_equal": True, "finite": True, "adapters_train": True}
