"""PackedLinear: NoSaveBitsandbytesPrecision on fake tensors holds what its bitsandbytes layers hold, byte for byte."""

from __future__ import annotations

import pytest
import torch

from lightning_memkit.demo import TinyLM
from lightning_memkit.demo.hf_models import tiny_hf_causal_lm
from lightning_memkit.estimate.trace import fake_tensors
from lightning_memkit.plugins import NoSaveBitsandbytesPrecision
from lightning_memkit.plugins.packed_linear import PackedLinear


def _layout(model: torch.nn.Module) -> dict[str, tuple]:
    """Per parameter and buffer: dtype, storage bytes, requires_grad; per 4-bit weight its quant state's bytes."""
    out = {}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        out[name] = (t.dtype, t.untyped_storage().nbytes(), t.requires_grad)
        state = getattr(t, "quant_state", None)
        if state is not None:
            out[name + ".absmax"] = (state.absmax.dtype, state.absmax.untyped_storage().nbytes())
            out[name + ".code"] = (state.code.dtype, state.code.numel())
            if state.nested:
                out[name + ".nested"] = (state.state2.absmax.untyped_storage().nbytes(), state.offset.numel())
        scb = getattr(t, "SCB", None)
        if scb is not None:
            out[name + ".SCB"] = (scb.dtype, scb.untyped_storage().nbytes())
    return out


def _converted(build, plugin_args: dict, fake: bool) -> dict[str, tuple]:
    plugin = NoSaveBitsandbytesPrecision(**plugin_args)
    if not fake:
        return _layout(plugin.convert_module(build()))
    with fake_tensors():
        model = plugin.convert_module(build())
        assert any(isinstance(m, PackedLinear) for m in model.modules())
        return _layout(model)


@pytest.mark.parametrize("mode", ["nf4", "nf4-dq", "fp4", "int8"])
def test_fake_conversion_matches_the_real_one(mode: str) -> None:
    args = {"mode": mode, "dtype": torch.float16 if mode == "int8" else torch.bfloat16, "lora_rank": 4,
            "ignore_modules": ["head"]}
    build = lambda: TinyLM(d_model=64, n_layers=2, n_heads=4, seq_len=16)  # noqa: E731
    real, fake = _converted(build, args, fake=False), _converted(build, args, fake=True)
    assert fake == real


def test_fake_hf_moe_conversion_matches_the_real_one() -> None:
    args = {"mode": "nf4", "dtype": torch.bfloat16, "lora_rank": 4}
    build = lambda: tiny_hf_causal_lm("qwen3_moe", seed=0, hidden_size=64, num_layers=2)  # noqa: E731
    assert _converted(build, args, fake=True) == _converted(build, args, fake=False)


def test_packed_linear_matches_the_plugin_layer_output() -> None:
    torch.manual_seed(0)
    dense = torch.nn.Linear(64, 32)
    real = NoSaveBitsandbytesPrecision("nf4", torch.float32).convert_module(torch.nn.Sequential(_copy(dense)))
    packed = PackedLinear.from_linear(_copy(dense), "nf4", torch.float32)
    x = torch.randn(5, 64)
    torch.testing.assert_close(packed(x), real(x), rtol=0, atol=0)


def _copy(linear: torch.nn.Linear) -> torch.nn.Linear:
    out = torch.nn.Linear(linear.in_features, linear.out_features)
    out.load_state_dict(linear.state_dict())
    return out
