"""The step time model counts attention: a causal SDPA step's FLOPs grow with the square of its tokens by exactly
the causal half of torch's SDPA formulas, forward and backward, for every layer (the CPU flash kernel the fake step
runs had no formula: its FLOPs were 0)."""

import torch
from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

from lightning_memkit.demo.hf_models import tiny_hf_causal_lm
from lightning_memkit.estimate.step import estimate_training_memory


def test_a_causal_attention_counts_half_of_torchs_sdpa_formulas_per_layer():
    def flops(tokens: int) -> int:
        ids = torch.zeros(1, tokens, dtype=torch.long)
        est = estimate_training_memory(lambda: tiny_hf_causal_lm("llama", hidden_size=64, num_layers=2),
                                       lambda: {"input_ids": ids, "labels": ids}, target="cuda")
        return est.step_flops

    def attention(tokens: int) -> int:  # one layer: 4 heads of 16, causal (half), forward and backward
        q = (1, 4, tokens, 16)
        return (sdpa_flop_count(q, q, q) + sdpa_backward_flop_count(q, q, q, q)) // 2

    # everything else is linear in the tokens: doubling them adds attention(2T) - 2 attention(T) per layer
    assert flops(1024) - 2 * flops(512) == 2 * (attention(1024) - 2 * attention(512))
    assert attention(1024) - 2 * attention(512) > 0
