"""A tiny Llama fit with some of the package's features, as a process of its own: it records its losses after
every step and can kill itself with SIGKILL at a step (before that step's checkpoint is written), or resume from
the last checkpoint. ``python resume_child.py OUT FEATURES KILL_AT fit|resume`` (FEATURES: comma-separated
names of :data:`FEATURES`, or ``-``)."""

import json
import os
import signal
import sys
from pathlib import Path

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

STEPS, PER_EPOCH = 6, 2


def features(names: str) -> tuple[list, list]:
    """``(callbacks, plugins)`` for comma-separated feature names."""
    from lightning_memkit.callbacks import (
        ActivationCheckpointing,
        ActivationOffloading,
        FusedLinearCrossEntropy,
        MemoryBudget,
        OffloadOptimizer,
        Optimizer8bit,
        OptimizerInBackward,
        TiledMLP,
    )
    from lightning_memkit.plugins import NoSaveBitsandbytesPrecision

    made = {
        "checkpointing": lambda: ActivationCheckpointing(),
        "fused": lambda: FusedLinearCrossEntropy(),
        "budget": lambda: MemoryBudget("2500KiB"),  # plans checkpointing and the fused loss for this model
        "qlora": lambda: NoSaveBitsandbytesPrecision("nf4", "bfloat16", lora_rank=4),
        "offload": lambda: ActivationOffloading(),
        "in_backward": lambda: OptimizerInBackward(),
        "host_optimizer": lambda: OffloadOptimizer(offload_gradients=True),
        "adamw8bit": lambda: Optimizer8bit(),
        "tiled": lambda: TiledMLP(tile_tokens=16),  # 4 x 32 tokens: 8 tiles
    }
    objs = [made[n]() for n in names.split(",") if n and n != "-"]
    plugins = [o for o in objs if not isinstance(o, Callback)]
    return [o for o in objs if isinstance(o, Callback)], plugins


class Record(Callback):
    def __init__(self, path: Path, kill_at: int):
        self.losses, self.path, self.kill_at = [], path, kill_at

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))
        self.path.write_text(json.dumps(self.losses))
        self.path.with_suffix(".active.json").write_text(json.dumps(active(trainer)))
        if trainer.global_step == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)


def active(trainer: Trainer) -> dict:
    """What shows the levers at work in the batch just ended: the optimizer's class (a lever's stand-in) and the
    bytes activation offload moved to host memory."""
    moved = [c.step_bytes for c in trainer.callbacks if type(c).__name__ == "ActivationOffloading"]
    return {"optimizer": type(trainer.optimizers[0]).__name__, "offloaded_bytes": sum(b or 0 for b in moved)}


def fit(out: Path, names: str, kill_at: int = -1, resume: bool = False, steps: int = STEPS) -> list[float]:
    from lightning_memkit.demo import ByteTextDataModule, HFCausalLM

    torch.manual_seed(0)
    model = HFCausalLM("llama")
    data = ByteTextDataModule(batch_size=4, seq_len=32, batch_format="hf", max_bytes=20_000,
                              samples_per_epoch=4 * PER_EPOCH)
    callbacks, plugins = features(names)
    out.mkdir(parents=True, exist_ok=True)
    record = Record(out / ("resumed.json" if resume else "losses.json"), kill_at)
    trainer = Trainer(accelerator="cpu", max_steps=steps, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, limit_val_batches=0, plugins=plugins,
                      callbacks=[record, *callbacks, ModelCheckpoint(dirpath=out / "ckpt", save_last=True,
                                                                     every_n_train_steps=1)])
    trainer.fit(model, data, ckpt_path="last" if resume else None)
    return record.losses


if __name__ == "__main__":
    fit(Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4] == "resume")
