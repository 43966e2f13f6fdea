"""Hugging Face ``transformers`` adapters: which layers, experts, heads and loss a causal LM has.

This package knows transformers' module layout and maps it onto the pure-torch core; it imports
``transformers`` lazily (inside functions), so importing it costs nothing when transformers is absent.
The pipeline stages are imported on first use (they pull in ``torch.distributed.pipelining``).
"""

from lightning_memkit.common.lazy import lazy_exports
from lightning_memkit.hf.fused_loss import fused_linear_cross_entropy
from lightning_memkit.hf.layers import decoder_layers, kv_cache_off
from lightning_memkit.hf.meta_init import default_buffer_init, holds_hf_model, init_hf_buffers
from lightning_memkit.hf.qlora import (
    QLoRAExperts,
    dequantized_experts,
    expert_modules,
    hf_models,
    output_embedding_names,
    prepare_experts,
)

_LAZY = {
    name: ".pipeline_stages"
    for name in ("CausalLMLoss", "CausalLMStages", "SUPPORTED_MODEL_TYPES", "TESTED_MODEL_TYPES", "causal_lm_stages",
                 "find_causal_lm")
}

__all__ = [
    "decoder_layers",
    "fused_linear_cross_entropy",
    "kv_cache_off",
    "default_buffer_init",
    "holds_hf_model",
    "init_hf_buffers",
    "QLoRAExperts",
    "dequantized_experts",
    "expert_modules",
    "hf_models",
    "output_embedding_names",
    "prepare_experts",
    *_LAZY,
]

__getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals())
