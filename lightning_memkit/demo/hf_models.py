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

__all__ = ["HF_FAMILIES", "TINY_HF_FAMILIES", "tiny_hf_config", "tiny_hf_causal_lm"]

#: The demo families (``HFCausalLM``, the benchmarks): a dense model, an MoE and an MoE with sliding windows.
HF_FAMILIES = ("llama", "qwen3_moe", "gpt_oss")
#: Every family :func:`tiny_hf_config` builds (its ``config.model_type``): the demo ones and the other families
#: the pipeline tests train.
TINY_HF_FAMILIES = (*HF_FAMILIES, "mistral", "qwen2", "qwen3", "mixtral", "gemma2", "gemma3_text", "phi3",
                    "qwen2_moe", "olmoe", "deepseek_v3")


def tiny_hf_config(family: str = "llama", hidden_size: int = 64, num_layers: int = 2, vocab_size: int = 256,
                   num_experts: int = 4, **overrides: Any):
    """A transformers config of ``family`` (one of :data:`TINY_HF_FAMILIES`) small enough for a CPU test.

    Heads: 4 query heads of dimension ``hidden_size // 4``, 2 key/value heads; MoE families get
    ``num_experts`` experts, 2 per token, with the router auxiliary loss on (where the family has one).
    Families with sliding windows get a window of 16 tokens; where the family mixes layer kinds, they alternate
    (sliding first). ``gemma2``/``gemma3_text`` cap their final logits at 30 (Gemma3's default is no cap);
    ``qwen2_moe`` has a shared expert and a dense first layer, ``deepseek_v3`` MLA attention and a dense first
    layer before its MoE layers (4 key/value heads: MLA has no grouped heads). ``overrides`` go to the config
    class as keyword arguments.
    """
    if family not in TINY_HF_FAMILIES:
        raise ValueError(f"family={family!r} is not supported; allowed: {', '.join(map(repr, TINY_HF_FAMILIES))}")
    import transformers

    common: dict[str, Any] = dict(hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                                  num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                                  head_dim=hidden_size // 4, vocab_size=vocab_size, max_position_embeddings=4096)
    alternating = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]
    moe = dict(num_experts=num_experts, num_experts_per_tok=2, moe_intermediate_size=hidden_size // 2,
               output_router_logits=True)
    gemma = dict(sliding_window=16, layer_types=alternating, query_pre_attn_scalar=hidden_size // 4,
                 final_logit_softcapping=30.0, pad_token_id=0)
    families = {
        "llama": ("LlamaConfig", {}),
        "qwen3_moe": ("Qwen3MoeConfig", moe),
        "gpt_oss": ("GptOssConfig", dict(num_local_experts=num_experts, num_experts_per_tok=2,
                                         output_router_logits=True, sliding_window=16, layer_types=alternating,
                                         rope_scaling=None)),
        "mistral": ("MistralConfig", dict(sliding_window=16)),
        "qwen2": ("Qwen2Config", dict(use_sliding_window=True, sliding_window=16, max_window_layers=1)),
        "qwen3": ("Qwen3Config", {}),
        "mixtral": ("MixtralConfig", dict(num_local_experts=num_experts, num_experts_per_tok=2,
                                          output_router_logits=True, sliding_window=16)),
        "gemma2": ("Gemma2Config", gemma),
        "gemma3_text": ("Gemma3TextConfig", gemma),
        "phi3": ("Phi3Config", dict(pad_token_id=0)),
        "qwen2_moe": ("Qwen2MoeConfig", dict(moe, shared_expert_intermediate_size=hidden_size,
                                             mlp_only_layers=[0])),
        "olmoe": ("OlmoeConfig", dict(num_experts=num_experts, num_experts_per_tok=2, output_router_logits=True,
                                      pad_token_id=0)),
        "deepseek_v3": ("DeepseekV3Config", dict(n_routed_experts=num_experts, num_experts_per_tok=2,
                                                 moe_intermediate_size=hidden_size // 2, n_shared_experts=1,
                                                 n_group=1, topk_group=1, first_k_dense_replace=1,
                                                 kv_lora_rank=hidden_size // 4, q_lora_rank=hidden_size // 2,
                                                 qk_rope_head_dim=hidden_size // 8,
                                                 qk_nope_head_dim=hidden_size // 8, v_head_dim=hidden_size // 4,
                                                 head_dim=hidden_size // 8, num_key_value_heads=4)),
    }
    name, extra = families[family]
    return getattr(transformers, name)(**{**common, **extra, **overrides})


def tiny_hf_causal_lm(family: str = "llama", seed: int | None = None, dtype: torch.dtype = torch.float32,
                      **config_kwargs: Any):
    """A randomly initialised ``<Family>ForCausalLM`` from :func:`tiny_hf_config` (same arguments), in ``dtype``."""
    import transformers

    config = tiny_hf_config(family, **config_kwargs)
    if seed is not None:
        torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    return model.to(dtype)
