"""One rank of tests/strategies/test_fsdp2_strategy.py: a tiny transformers Llama fit with ``strategy="memkit_fsdp2"``
on the gloo ranks, each rank its half of every global batch (``fsdp2_data``); the mean loss over the ranks at each
step, the strategy, the parameters' type and the state dict gathered whole, written to ``OUT/rank{r}.json``.

    LOCAL_RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python _fsdp2_strategy_worker.py OUT [keep] [features]

``keep``: ``reshard_after_forward=False``; ``features``: with ``fsdp2_data.features()`` (activation checkpointing,
the fused loss, the tiled MLP); ``moe``: a Qwen3-MoE (its router aux loss on) instead of the Llama, fit with DDP too
(``ddp``: its losses; each rank's aux loss is its own batch's, so DDP, not one process, is the reference); ``nf4``:
the QLoRA plugin (``fsdp2_data.plugins()``: nf4, LoRA rank 8, float32 compute), its adapters exported at the end of
the fit (``ExportAdapters`` to ``OUT/adapters``); ``peft``: the model wrapped by peft, its adapters the ones trained;
``resume``: the fit stopped after its second step with a checkpoint (each rank its shards,
``torch.distributed.checkpoint``), then a new Trainer resumed from it for the last step (``resumed``: that step's
loss).
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
import fsdp2_data  # noqa: E402

import lightning_memkit  # noqa: E402,F401  (registers "memkit_fsdp2" after Lightning: any import order)

warnings.filterwarnings("ignore")
torch.set_num_threads(1)


class MeanLoss(pl.Callback):
    """The loss of each step averaged over the ranks: the global batch's mean loss."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"].detach().clone()
        dist.all_reduce(loss)
        self.losses.append(loss.item() / trainer.world_size)


def fit(rank: int, world: int, reshard: bool, features: bool, qlora: bool, steps: int, checkpoints: Path | None = None,
        resume: str | None = None, family: str = "llama", strategy: str = "memkit_fsdp2", peft: bool = False,
        export: Path | None = None) -> tuple[pl.LightningModule, pl.Trainer, MeanLoss]:
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_memkit.finetune import ExportAdapters

    model = fsdp2_data.module(family, peft)
    record = MeanLoss()
    saving = [ModelCheckpoint(dirpath=checkpoints, save_last=True, every_n_train_steps=1)] if checkpoints else []
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=steps,
                         callbacks=[fsdp2_data.seeded(), record, *(fsdp2_data.features() if features else []),
                                    *saving, *([ExportAdapters(str(export))] if export else [])], logger=False,
                         enable_checkpointing=bool(checkpoints), enable_progress_bar=False,
                         enable_model_summary=False, use_distributed_sampler=False,
                         plugins=fsdp2_data.plugins(peft) if qlora else None)
    if strategy == "memkit_fsdp2":
        trainer.strategy.reshard_after_forward = reshard
    trainer.fit(model, fsdp2_data.loader(rank, world), ckpt_path=resume)
    return model, trainer, record


def main(out: Path, reshard: bool, features: bool, qlora: bool, resume: bool, family: str, peft: bool) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    rank, world = int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
    model, trainer, record = fit(rank, world, reshard, features, qlora, fsdp2_data.STEPS, family=family, peft=peft,
                                 export=out / "adapters" if qlora else None)
    resumed = None
    ddp = fit(rank, world, reshard, features, qlora, fsdp2_data.STEPS, family=family, strategy="ddp")[2].losses \
        if family != "llama" else None
    if resume:
        fit(rank, world, reshard, features, qlora, fsdp2_data.STEPS - 1, checkpoints=out / "checkpoints", peft=peft)
        last = out / "checkpoints" / "last.ckpt"
        resumed = fit(rank, world, reshard, features, qlora, fsdp2_data.STEPS, resume=str(last), peft=peft)[2].losses
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    param = next(model.parameters())
    (out / f"rank{rank}.json").write_text(json.dumps({
        "losses": record.losses, "resumed": resumed, "ddp": ddp, "strategy": type(trainer.strategy).__name__,
        "param": type(param).__name__,
        "state": {k: v.float().flatten()[:64].tolist() for k, v in state.items()} if rank == 0 else {}}))


if __name__ == "__main__":
    flags = sys.argv[2:]
    main(Path(sys.argv[1]), "keep" not in flags, "features" in flags, "nf4" in flags, "resume" in flags,
         "qwen3_moe" if "moe" in flags else "llama", "peft" in flags)
