"""Tiny randomly initialised Hugging Face causal LMs built from their config classes (nothing downloaded).

Example::

    >>> import torch
    >>> from lightning_memkit.demo.hf_models import tiny_hf_causal_lm
    >>> model = tiny_hf_causal_lm("qwen3_moe", seed=0)
    >>> ids = torch.randint(0, 256, (2, 8))
    >>> model(input_ids=ids, labels=ids).logits.shape
    torch.Size([2, 8, 256])
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["HF_FAMILIES", "tiny_hf_config", "tiny_hf_causal_lm"]

HF_FAMILIES = ("llama", "qwen3_moe", "gpt_oss")


def tiny_hf_config(family: str = "llama", hidden_size: int = 64, num_layers: int = 2, vocab_size: int = 256,
                   num_experts: int = 4, **overrides: Any):
    """A transformers config of ``family`` (one of :data:`HF_FAMILIES`) small enough for a CPU test.

    Heads: 4 query heads of dimension ``hidden_size // 4``, 2 key/value heads; MoE families get
    ``num_experts`` experts, 2 per token, with the router auxiliary loss on. ``overrides`` go to the
    config class as keyword arguments.
    """
    if family not in HF_FAMILIES:
        raise ValueError(f"family={family!r} is not supported; allowed: {', '.join(map(repr, HF_FAMILIES))}")
    import transformers

    common: dict[str, Any] = dict(hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                                  num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                                  head_dim=hidden_size // 4, vocab_size=vocab_size, max_position_embeddings=4096)
    if family == "llama":
        return transformers.LlamaConfig(**{**common, **overrides})
    if family == "qwen3_moe":
        moe = dict(num_experts=num_experts, num_experts_per_tok=2, moe_intermediate_size=hidden_size // 2,
                   output_router_logits=True)
        return transformers.Qwen3MoeConfig(**{**common, **moe, **overrides})
    moe = dict(num_local_experts=num_experts, num_experts_per_tok=2, output_router_logits=True, sliding_window=16,
               layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)],
               rope_scaling=None)
    return transformers.GptOssConfig(**{**common, **moe, **overrides})


def tiny_hf_causal_lm(family: str = "llama", seed: int | None = None, dtype: torch.dtype = torch.float32,
                      **config_kwargs: Any):
    """A randomly initialised ``<Family>ForCausalLM`` from :func:`tiny_hf_config` (same arguments), in ``dtype``."""
    import transformers

    config = tiny_hf_config(family, **config_kwargs)
    if seed is not None:
        torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    return model.to(dtype)
