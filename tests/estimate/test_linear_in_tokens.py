"""Long sequences: the step's largest tensor at 16,384 tokens grows linearly with the tokens (attention through SDPA,
the causal mask never materialized, the loss fused), and a family that does materialize a
``(T x T)`` tensor is named in the estimate."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
TOKENS = 16_384


def estimate(tmp_path, family: str, **kwargs):
    from lightning_memkit.demo.hf_models import tiny_hf_config
    from lightning_memkit.estimate.hf import estimate_from_hf_config

    config = tiny_hf_config(family, hidden_size=64, num_layers=2, vocab_size=256)
    config.max_position_embeddings = TOKENS
    path = tmp_path / f"{family}.json"
    path.write_text(config.to_json_string())
    return config, estimate_from_hf_config(path, seq_len=TOKENS, precision="bf16-true", activation_checkpointing=True,
                                           fused_loss=True, device="cpu", compose=False, **kwargs)


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_the_largest_tensor_of_a_16k_step_is_linear_in_the_tokens(tmp_path, family):
    config, est = estimate(tmp_path, family)
    width = max(config.hidden_size, getattr(config, "moe_intermediate_size", 0) * config.num_experts_per_tok
                if hasattr(config, "num_experts_per_tok") else config.intermediate_size)
    largest = est.largest_tensor
    assert largest["bytes"] <= TOKENS * width * 4, largest  # a few bf16 or float32 values per token and feature
    assert TOKENS in largest["shape"] or TOKENS * config.num_experts_per_tok in largest["shape"], largest
    assert not any("materializes" in line for line in est.assumptions)


def test_a_family_that_materializes_a_square_mask_is_named(tmp_path):
    _, est = estimate(tmp_path, "gemma3_text")
    line = next(line for line in est.assumptions if "materializes" in line)
    assert line.startswith("gemma3_text materializes a (16,384 x 16,384) tensor in model.layers.")
    assert est.largest_tensor["shape"][-2:] == [TOKENS, TOKENS]
