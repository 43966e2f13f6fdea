"""Every tiny transformers family with every layer-level feature at once (QLoRA, checkpointing and the fused loss):
the composed step equals the full trace (its layer kinds, and QLoRA's first layer a kind of its own)."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_compose import FEATURES, LAYERS, TOKENS, assert_same, config_file, full_trace

from lightning_memkit.demo.hf_models import TINY_HF_FAMILIES
from lightning_memkit.estimate.hf import estimate_from_hf_config

ALL_AT_ONCE = "qlora+checkpointing+fused"
#: Llama's and Qwen3-MoE's run in test_compose.py (the default suite's and every feature's cases)
FAMILIES = sorted(set(TINY_HF_FAMILIES) - {"llama", "qwen3_moe"})


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_composed_equals_the_full_trace_for_every_family(family: str, tmp_path: Path) -> None:
    # Gemma3's alternating sliding and full layers, each with its own rotary table, need samples up to 8 layers
    path = config_file(tmp_path, family, layers=16 if family == "gemma3_text" else LAYERS)
    kw = {**TOKENS, "precision": "bf16-true", **FEATURES[ALL_AT_ONCE]}
    assert_same(estimate_from_hf_config(path, compose=True, **kw), full_trace(path, **kw))
