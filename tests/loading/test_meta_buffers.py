"""Meta-device models through load_mxfp4_into: non-persistent buffers recomputed by a hook, or refused by name."""

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from lightning_memkit.loading import load_mxfp4_into
from lightning_memkit.loading.meta_buffers import initialize_meta_buffers, meta_buffer_names, meta_tensor_names


class Rope(nn.Module):
    def __init__(self, dim=8):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, dim, 2).float() / dim), persistent=False)
        self.register_buffer("positions", torch.arange(4), persistent=False)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.rope = Rope()
        self.other = Rope()
        self.other.inv_freq = self.rope.inv_freq  # one buffer under two names


def recompute(module, names):
    """What the model's own __init__ computes, written into the allocated buffers."""
    fresh = Rope()
    for name in names:
        module.get_buffer(name).copy_(fresh.get_buffer(name.rpartition(".")[2]))


@pytest.fixture
def path(tmp_path):
    file = tmp_path / "net.safetensors"
    save_file({"proj.weight": torch.randn(4, 4), "proj.bias": torch.randn(4)}, file)
    return file


def meta_net():
    with torch.device("meta"):
        return Net()


def test_buffers_recomputed_and_ties_kept(path):
    model = meta_net()
    assert meta_buffer_names(model) == ["rope.inv_freq", "rope.positions", "other.positions"]
    result = load_mxfp4_into(model, path, device="cpu", init_buffers=recompute)
    assert meta_tensor_names(model) == []
    assert result.initialized == ["rope.inv_freq", "rope.positions", "other.positions"]
    assert torch.equal(model.rope.inv_freq, Rope().inv_freq) and model.other.inv_freq is model.rope.inv_freq
    assert model.other.positions.tolist() == [0, 1, 2, 3]


def test_missing_hook_names_the_buffers_and_loads_nothing(path):
    model = meta_net()
    with pytest.raises(ValueError, match=r"rope\.inv_freq, rope\.positions, other\.positions: non-persistent "
                                         r"buffer\(s\) on the meta device, which no checkpoint holds; pass "
                                         r"init_buffers=") as info:
        load_mxfp4_into(model, path, device="cpu")
    assert "nothing was loaded" in str(info.value)
    assert len(meta_tensor_names(model)) == 5  # proj.weight, proj.bias and the three buffers


@pytest.mark.parametrize("hook, error, match", [
    (lambda m, n: m.rope.inv_freq.fill_(1.0), ValueError, r"rope\.positions: init_buffers did not write it"),
    (lambda m, n: setattr(m.rope, "inv_freq", torch.empty(4, device="meta")), ValueError,
     r"rope\.inv_freq: init_buffers left it on the meta device"),
    (lambda m, n: 1 / 0, ZeroDivisionError, "division by zero"),
])
def test_failing_hook_puts_every_buffer_back(path, hook, error, match):
    model = meta_net()
    before = {name: t for name, t in model.named_buffers()}
    weight = model.proj.weight
    with pytest.raises(error, match=match):
        load_mxfp4_into(model, path, device="cpu", init_buffers=hook)
    assert {name: t for name, t in model.named_buffers()} == before  # the very same meta tensors
    assert model.other.inv_freq is model.rope.inv_freq and model.proj.weight is weight and weight.is_meta


def test_meta_buffers_without_device_are_refused(path):
    with pytest.raises(ValueError, match=r"rope\.inv_freq: on the meta device \(3 tensor\(s\) are\); pass device="):
        load_mxfp4_into(_only_buffers_meta(), path, init_buffers=recompute)


def _only_buffers_meta():
    model = Net()
    with torch.device("meta"):
        model.rope = Rope()
        model.other = Rope()
        model.other.inv_freq = model.rope.inv_freq
    return model


def test_non_strict_leftover_is_named(tmp_path):
    file = tmp_path / "partial.safetensors"
    save_file({"proj.weight": torch.randn(4, 4)}, file)
    model = meta_net()
    with pytest.raises(ValueError, match=r"proj\.bias: on the meta device with no checkpoint entry, so it would stay "
                                         r"there"):
        load_mxfp4_into(model, file, device="cpu", strict=False, init_buffers=recompute)
    assert len(meta_tensor_names(model)) == 5  # proj.weight, proj.bias and the three buffers


def test_init_buffers_must_be_callable(path):
    with pytest.raises(TypeError, match=r"load_mxfp4_into\(init_buffers=\.\.\.\) must be a callable"):
        load_mxfp4_into(meta_net(), path, device="cpu", init_buffers="hf")


def test_initialize_meta_buffers_alone():
    model = meta_net()
    initialize_meta_buffers(model, ["rope.positions"], "cpu", recompute)
    assert model.rope.positions.tolist() == [0, 1, 2, 3] and model.rope.inv_freq.is_meta
