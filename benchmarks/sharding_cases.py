"""The models of the FSDP2 checks, built the same way by the gloo ranks (real) and the estimate (fake): a tiny
transformers Llama in bf16, a Qwen3-MoE in float32, a Llama wrapped by peft (LoRA on q and v) in float32; the Llamas
once more with the shards, gradients and optimizer state offloaded to host memory; the Llama and the Qwen3-MoE once
more with their MLPs in tiles of ``TILE`` tokens (``TiledMLP``) inside the FSDP2 units."""

from __future__ import annotations

import torch

CASES = {"llama": ("llama", "bf16-true", False), "qwen3_moe": ("qwen3_moe", "32-true", False),
         "peft": ("llama", "32-true", True)}
#: the cases run again with FSDP2's CPU offload, its host bytes placed as on a GPU (``offloaded_like_a_gpu_run``)
OFFLOADED = ("llama", "peft")
#: the cases run again with tiled MLPs (each rank's 2 x 32 tokens in 8 tiles)
TILED = ("llama", "qwen3_moe")
ROWS, SEQ, TILE = 2, 32, 8


def model_factory(case: str):
    family, _, peft = CASES[case]

    def build() -> torch.nn.Module:
        import transformers

        from lightning_memkit.demo.hf_models import tiny_hf_config

        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(
            tiny_hf_config(family, hidden_size=64, num_layers=2, vocab_size=1024, use_cache=False))
        if peft:
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(model, LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))
        return model

    return build


def batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 1024, (ROWS, SEQ), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids}


def estimate(case: str, ranks: int, reshard: bool = True, offload: bool = False, tiled: bool = False):
    """One rank's step of ``case`` sharded over ``ranks`` (``memkit_fsdp2``'s units), estimated on fake tensors;
    ``offload``: the sharding lever's ``full_shard_offload``; ``tiled``: the MLPs in tiles of ``TILE`` tokens."""
    from lightning_memkit.estimate.levers.sharding import SHARDING
    from lightning_memkit.estimate.levers.tiled_mlp import TILED_MLP
    from lightning_memkit.estimate.step import estimate_training_memory
    from lightning_memkit.estimate.step_spec import StepSpec, World

    step = StepSpec(precision=CASES[case][1], world=World(replicate=ranks))
    SHARDING.to_step("full_shard_offload" if offload else "full_shard" if reshard else "shard_grad_op", step)
    TILED_MLP.to_step(TILE if tiled else False, step)
    return estimate_training_memory(model_factory(case), batch, step=step, optimizer="adamw")
