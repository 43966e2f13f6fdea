"""Hugging Face ``transformers`` adapters: which layers, experts, heads and loss a causal LM has.

This package knows transformers' module layout and maps it onto the pure-torch core; it imports
``transformers`` lazily (inside functions), so importing it costs nothing when transformers is absent.
"""

from lightning_memkit.hf.fused_loss import fused_linear_cross_entropy
from lightning_memkit.hf.layers import decoder_layers, kv_cache_off

__all__ = ["decoder_layers", "fused_linear_cross_entropy", "kv_cache_off"]
