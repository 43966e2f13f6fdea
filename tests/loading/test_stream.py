import weakref

import pytest
import torch

from lightning_memkit.loading import dequantize_mxfp4, stream_dequantize
from lightning_memkit.loading.mxfp4 import _Tables, chunk_transient_bytes
from lightning_memkit.memory import LivePeak

LAYERS, E, R, G = 3, 2, 64, 4


def packed_state_dict():
    sd = {}
    for i in range(LAYERS):
        sd[f"layers.{i}.experts.down_proj_blocks"] = torch.randint(0, 256, (E, R, G, 16), dtype=torch.uint8)
        sd[f"layers.{i}.experts.down_proj_scales"] = torch.randint(120, 135, (E, R, G), dtype=torch.uint8)
        sd[f"layers.{i}.experts.down_proj_bias"] = torch.randn(E, R)
    return sd


def test_yields_in_order_pops_everything_and_matches():
    sd = packed_state_dict()
    expected = {k: v.clone() for k, v in sd.items()}
    got = list(stream_dequantize(sd, dtype=torch.float32))
    assert sd == {}
    assert [name for name, _ in got] == [n for i in range(LAYERS) for n in
                                         (f"layers.{i}.experts.down_proj", f"layers.{i}.experts.down_proj_bias")]
    for name, tensor in got:
        if name.endswith("_bias"):
            assert torch.equal(tensor, expected[name])
        else:
            ref = dequantize_mxfp4(expected[name + "_blocks"], expected[name + "_scales"], dtype=torch.float32)
            assert torch.equal(tensor, ref) and tensor.shape == (E, G * 32, R)


def test_each_pair_is_freed_before_the_next_layer():
    sd = packed_state_dict()
    refs = {i: weakref.ref(sd[f"layers.{i}.experts.down_proj_blocks"]) for i in range(LAYERS)}
    stream = stream_dequantize(sd)
    name, _ = next(stream)
    assert name == "layers.0.experts.down_proj" and refs[0]() is None and refs[1]() is not None
    next(stream)  # the bias
    name, _ = next(stream)
    assert name == "layers.1.experts.down_proj" and refs[1]() is None and refs[2]() is not None


def test_peak_is_one_weight_not_all_of_them():
    sd = packed_state_dict()
    params = {n[: -len("_blocks")]: torch.empty(E, G * 32, R, dtype=torch.bfloat16) for n in sd if "blocks" in n}
    one = E * G * 32 * R * 2
    with LivePeak() as lp:
        for name, tensor in stream_dequantize(sd, rows_per_chunk=16):
            if name in params:
                params[name].copy_(tensor)
            del tensor
    with LivePeak() as tables:
        _Tables(torch.bfloat16, torch.device("cpu"))
    # the largest thing alive at once: one dequantized weight, one chunk of temporaries and the lookup tables
    assert one <= lp.peak_bytes <= one + chunk_transient_bytes(16, G, torch.bfloat16) + tables.peak_bytes
    assert lp.peak_bytes < 2 * one < LAYERS * one


def test_validated_before_anything_is_popped():
    sd = packed_state_dict()
    del sd["layers.2.experts.down_proj_scales"]
    n = len(sd)
    with pytest.raises(ValueError, match="layers.2.experts.down_proj_blocks has no matching "
                                         "layers.2.experts.down_proj_scales"):
        stream_dequantize(sd)
    assert len(sd) == n
    sd = packed_state_dict()
    del sd["layers.0.experts.down_proj_blocks"]
    with pytest.raises(ValueError, match="layers.0.experts.down_proj_scales has no matching"):
        stream_dequantize(sd)
    sd = packed_state_dict()
    sd["layers.1.experts.down_proj_scales"] = sd["layers.1.experts.down_proj_scales"][:, :-1]
    with pytest.raises(ValueError, match=r"layers.1.experts.down_proj_scales: shape \[2, 63, 4\] does not match"):
        stream_dequantize(sd)
    assert len(sd) == 3 * LAYERS
    with pytest.raises(ValueError, match="dtype=torch.int8 is not allowed"):
        stream_dequantize(packed_state_dict(), dtype=torch.int8)
    with pytest.raises(TypeError, match="state_dict must be a mutable mapping"):
        stream_dequantize([("a", torch.zeros(1))])
