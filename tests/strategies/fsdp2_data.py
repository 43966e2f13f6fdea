"""The module and data of the ``memkit_fsdp2`` checks: a tiny transformers Llama (``HFCausalLM``), a fixed token
dataset whose global batch ``i`` is rows ``[4 i, 4 i + 4)``; a rank of ``world`` reads its ``4 / world`` of them."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import Dataset

ROWS, SEQ, STEPS = 4, 32, 3


class Tokens(Dataset):
    def __init__(self, rank: int = 0, world: int = 1) -> None:
        ids = torch.randint(0, 256, (ROWS * STEPS, SEQ), generator=torch.Generator().manual_seed(0))
        per = ROWS // world
        self.rows = [ids[step * ROWS + rank * per + i] for step in range(STEPS) for i in range(per)]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def loader(rank: int = 0, world: int = 1) -> Any:
    """The rank's batches, from a stateful loader (Lightning checkpoints where it stands: a resume goes on there)."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    return StatefulDataLoader(Tokens(rank, world), batch_size=ROWS // world, shuffle=False)


def module(family: str = "llama", peft: bool = False):
    """The tiny model; ``peft``: wrapped by peft (LoRA of rank 8 on q and v: the only trainable parameters)."""
    from lightning_memkit.demo import HFCausalLM

    lora = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]} if peft else None
    return HFCausalLM(family, hidden_size=64, num_layers=2, vocab_size=256, seed=0, peft_lora=lora)


def features() -> list:
    """Callbacks that run inside the FSDP2 units: every decoder layer recomputed, the loss fused with the head, the
    MLPs in tiles of 16 tokens."""
    from lightning_memkit.callbacks import ActivationCheckpointing, FusedLinearCrossEntropy, TiledMLP

    return [ActivationCheckpointing(), FusedLinearCrossEntropy(), TiledMLP(tile_tokens=16)]


def plugins(peft: bool = False) -> list:
    """The QLoRA plugin of the quantized checks: nf4 weights, LoRA adapters of rank 8 (``peft``: none, peft's
    train), float32 compute."""
    import torch

    from lightning_memkit.plugins import NoSaveBitsandbytesPrecision

    return [NoSaveBitsandbytesPrecision("nf4", torch.float32, lora_rank=0 if peft else 8)]


def seeded() -> Any:
    """A callback that seeds torch's generator at ``setup``, right before the strategy converts and shards the module:
    the plugin's LoRA adapters start the same in every run, whatever drew from the generator before."""
    import lightning.pytorch as pl

    class SeedAtSetup(pl.Callback):
        def setup(self, trainer, pl_module, stage):
            torch.manual_seed(0)

    return SeedAtSetup()
