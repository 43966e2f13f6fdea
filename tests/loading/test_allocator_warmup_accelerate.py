"""The allocator warmup guard around a real ``from_pretrained(device_map=...)`` with ``accelerate`` installed.

Nothing in transformers is forced here: ``accelerate`` is importable, so transformers accepts the device map
itself and calls its ``caching_allocator_warmup`` as it does on a GPU machine.
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import transformers.modeling_utils as mu  # noqa: E402
from transformers.integrations.accelerate import is_accelerate_available  # noqa: E402

from lightning_memkit.memory import guard_allocator_warmup  # noqa: E402


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    path = tmp_path_factory.mktemp("tiny_llama_accelerate")
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return path


@pytest.fixture
def reached(monkeypatch):
    """A pass-through spy at the module attribute, so the guard wraps it: records whether the real warmup ran."""
    real, calls = mu.caching_allocator_warmup, []

    def spy(*args, **kwargs):
        calls.append(args[1])  # the expanded device map
        return real(*args, **kwargs)

    monkeypatch.setattr(mu, "caching_allocator_warmup", spy)
    return calls


@pytest.mark.parametrize("device_map", ["cpu", "auto", {"": "cpu"}], ids=["cpu", "auto", "dict"])
@pytest.mark.parametrize("mode", ["on", "off", "cap"])
def test_guard_decides_a_real_accelerate_load(tiny_llama, reached, device_map, mode):
    assert is_accelerate_available()
    plain = transformers.LlamaForCausalLM.from_pretrained(tiny_llama)
    with guard_allocator_warmup(mode=mode, device="cpu") as guard:
        model = transformers.LlamaForCausalLM.from_pretrained(tiny_llama, device_map=device_map)
    assert [c.mode for c in guard.calls] == [mode] and guard.calls[0].skip == (mode == "off")
    assert len(reached) == (0 if mode == "off" else 1)  # skipped: the real function is never entered
    assert mu.caching_allocator_warmup.__name__ == "spy"  # the guard put back what it found
    for name, t in plain.state_dict().items():
        assert torch.equal(model.state_dict()[name], t), name
