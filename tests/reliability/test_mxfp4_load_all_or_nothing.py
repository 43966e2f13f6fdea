"""load_mxfp4_into validates every shard, source and destination before it writes any parameter."""

import json
import os
import struct

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from lightning_memkit.loading import dequantize_mxfp4, load_mxfp4_into
from lightning_memkit.loading.safetensors_loader import read_safetensors_header

E, IN, OUT = 2, 64, 8


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(IN, OUT)
        self.b = nn.Linear(IN, OUT)
        self.experts = nn.Parameter(torch.randn(E, IN, OUT))  # [E, in, out] <- blocks [E, out, in // 32, 16]


def _shards(tmp_path):
    """Two shards: the first holds a and the MXFP4 experts, the second b; returns (first, second, checkpoint)."""
    first = {"a.weight": torch.ones(OUT, IN), "a.bias": torch.ones(OUT),
             "experts_blocks": torch.randint(0, 256, (E, OUT, IN // 32, 16), dtype=torch.uint8),
             "experts_scales": torch.randint(120, 130, (E, OUT, IN // 32), dtype=torch.uint8)}
    second = {"b.weight": torch.full((OUT, IN), 2.0), "b.bias": torch.full((OUT,), 2.0)}
    save_file(first, tmp_path / "model-00001-of-00002.safetensors")
    save_file(second, tmp_path / "model-00002-of-00002.safetensors")
    return tmp_path / "model-00001-of-00002.safetensors", tmp_path / "model-00002-of-00002.safetensors", first


def _write_raw(path, header, data: bytes):
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def _entry(shape, begin):
    end = begin + 4 * (shape[0] * (shape[1] if len(shape) > 1 else 1))
    return {"dtype": "F32", "shape": list(shape), "data_offsets": [begin, end]}


def _gap(path):
    _write_raw(path, {"b.weight": _entry((OUT, IN), 0), "b.bias": _entry((OUT,), 4 * OUT * IN + 4)},
               bytes(4 * OUT * IN + 4 + 4 * OUT))


def _overlap(path):
    _write_raw(path, {"b.weight": _entry((OUT, IN), 0), "b.bias": _entry((OUT,), 0)}, bytes(4 * OUT * IN))


def _trailing(path):
    _write_raw(path, {"b.weight": _entry((OUT, IN), 0), "b.bias": _entry((OUT,), 4 * OUT * IN)},
               bytes(4 * OUT * IN + 4 * OUT + 7))


def _bad_metadata(path):
    _write_raw(path, {"__metadata__": {"format": 1}, "b.weight": _entry((OUT, IN), 0),
                      "b.bias": _entry((OUT,), 4 * OUT * IN)}, bytes(4 * OUT * IN + 4 * OUT))


def _lone_surrogate(path):
    """Valid for Python's json, refused by safetensors' own parser: caught by opening every shard first."""
    header = {"__metadata__": {"note": "\ud800"}, "b.weight": _entry((OUT, IN), 0),
              "b.bias": _entry((OUT,), 4 * OUT * IN)}
    _write_raw(path, header, bytes(4 * OUT * IN + 4 * OUT))


def _empty(path):
    path.write_bytes(b"")


def _truncated(path):
    os.truncate(path, path.stat().st_size - 5)


def _truncated_header(path):
    os.truncate(path, 12)


MALFORMED = {
    "gap": (_gap, r"tensor 'b.bias' in {path}: its data starts at byte \d+, but the previous tensor ends"),
    "overlap": (_overlap, r"in {path}: its data starts at byte \d+, but the previous tensor ends at byte \d+ \(gap "
                          r"or overlap\)"),
    "trailing": (_trailing, r"{path}: the tensors' data ends at byte \d+ but the file has \d+ bytes"),
    "metadata": (_bad_metadata, r"{path}: safetensors __metadata__ must map str to str"),
    "lone_surrogate": (_lone_surrogate, r"{path}: safetensors cannot open it \(SafetensorError"),
    "empty": (_empty, r"{path}: truncated safetensors file \(0 bytes, no header length\)"),
    "truncated": (_truncated, r"tensor 'b.\w+' in {path} is truncated: its data ends at byte \d+, the file has"),
    "truncated_header": (_truncated_header, r"{path}: truncated or not a safetensors file"),
}


def _snapshot(model):
    return {name: t.detach().clone() for name, t in model.state_dict().items()}


def _assert_unchanged(model, before):
    now = model.state_dict()
    assert now.keys() == before.keys()
    for name, t in before.items():
        assert torch.equal(now[name], t), f"{name} was written"


def _fails(model, path, match):
    before = _snapshot(model)
    with pytest.raises(ValueError, match=match) as info:
        load_mxfp4_into(model, path)
    assert "nothing was loaded" in str(info.value)
    _assert_unchanged(model, before)


@pytest.mark.parametrize("case", list(MALFORMED))
@pytest.mark.parametrize("with_index", [False, True])
def test_malformed_second_shard_names_the_file_and_writes_nothing(tmp_path, case, with_index):
    first, second, _ = _shards(tmp_path)
    if with_index:
        weight_map = {**{k: first.name for k in ("a.weight", "a.bias", "experts_blocks", "experts_scales")},
                      **{k: second.name for k in ("b.weight", "b.bias")}}
        (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    corrupt, pattern = MALFORMED[case]
    corrupt(second)
    _fails(Net(), tmp_path, pattern.format(path=str(second)))


@pytest.mark.parametrize("case", ["empty", "truncated", "truncated_header"])
def test_empty_or_truncated_file_names_its_path(tmp_path, case):
    _, second, _ = _shards(tmp_path)
    corrupt, pattern = MALFORMED[case]
    corrupt(second)
    with pytest.raises(ValueError, match=pattern.format(path=str(second))):
        read_safetensors_header(second)
    _fails(Net(), second, pattern.format(path=str(second)))


@pytest.mark.parametrize(
    "make, name",
    [
        (lambda: nn.Parameter(torch.zeros(IN).expand(OUT, IN)), "b.weight"),  # zero stride
        (lambda: nn.Parameter(torch.zeros(E * OUT + IN).as_strided((E, IN, OUT), (1, 1, 1))), "experts"),
    ],
    ids=["zero_stride", "as_strided"],
)
def test_self_overlapping_destination_is_refused_by_name(tmp_path, make, name):
    _shards(tmp_path)
    model = Net()
    owner, _, attr = name.rpartition(".")
    setattr(model.get_submodule(owner) if owner else model, attr, make())
    _fails(model, tmp_path, rf"{name}: shape \[.*\] with strides \[.*\] overlaps itself")


def test_non_contiguous_destination_is_written_correctly(tmp_path):
    _, _, first = _shards(tmp_path)
    model = Net()
    model.b.weight = nn.Parameter(torch.zeros(IN, OUT).t())  # transposed: strided, but no element shared
    model.experts = nn.Parameter(torch.zeros(E, OUT, IN).transpose(1, 2))
    load_mxfp4_into(model, tmp_path)
    assert torch.equal(model.b.weight.detach(), torch.full((OUT, IN), 2.0))
    want = dequantize_mxfp4(first["experts_blocks"], first["experts_scales"], dtype=torch.float32)
    assert torch.equal(model.experts.detach(), want)


def _partly_meta():
    model = Net()
    with torch.device("meta"):
        model.b = nn.Linear(IN, OUT)
    return model


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine where device='cuda' cannot allocate")
def test_partly_meta_model_with_an_unusable_device_writes_nothing(tmp_path):
    _shards(tmp_path)
    model = _partly_meta()
    before = {k: v.clone() for k, v in model.state_dict().items() if not v.is_meta}
    with pytest.raises(ValueError, match=r"device='cuda': cannot create the 2 meta tensor\(s\) there") as info:
        load_mxfp4_into(model, tmp_path, device="cuda")
    assert "nothing was loaded" in str(info.value)
    for k, v in before.items():
        assert torch.equal(model.state_dict()[k], v), k
    assert model.b.weight.is_meta and model.b.bias.is_meta


def test_partly_meta_model_loads_with_a_device(tmp_path):
    _shards(tmp_path)
    model = _partly_meta()
    result = load_mxfp4_into(model, tmp_path, device="cpu")
    assert sorted(result.materialized) == ["b.bias", "b.weight"]
    assert torch.equal(model.b.weight.detach(), torch.full((OUT, IN), 2.0))


def test_inference_tensor_destination_is_refused_by_name(tmp_path):
    _shards(tmp_path)
    model = Net()
    with torch.inference_mode():
        model.a.bias = nn.Parameter(torch.zeros(OUT), requires_grad=False)
    _fails(model, tmp_path, r"a.bias: is an inference tensor \(made under torch.inference_mode\)")
