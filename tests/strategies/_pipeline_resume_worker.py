"""One rank of a 2-rank ``memkit_pipeline`` fit of a tiny Hugging Face Llama with some of the package's features, as a
process of its own: it records the plan it runs and the loss of every step, and the rank ``VICTIM`` can kill itself
with SIGKILL in optimizer step ``KILL_AT`` (after the checkpoint of the step before was committed, before this step
updates a weight), or it resumes from the last checkpoint. Run by tests/strategies/test_pipeline_resume.py::

    LOCAL_RANK=r NODE_RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 \\
        python _pipeline_resume_worker.py OUT FEATURES KILL_AT VICTIM fit|resume

FEATURES: comma-separated names of :data:`FEATURES` (or ``-``); KILL_AT: a 0-based optimizer step (-1: never).
``fit`` writes ``OUT/fit_rank{r}.json``, ``resume`` (``ckpt_path="last"``) ``OUT/resume_rank{r}.json``: the plan
(microbatches, fused loss, split, predicted peaks, ``MemoryBudget``'s changes, the layers ``ActivationCheckpointing``
recomputes), the step training started from, and per step its loss and the calls of this rank's attention modules
(rewritten after every step, so that a killed run leaves them).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_memkit.callbacks import ActivationCheckpointing, MemoryBudget
from lightning_memkit.demo import ByteTextDataModule, HFCausalLM
from lightning_memkit.plugins import NoSaveBitsandbytesPrecision
from lightning_memkit.plugins.nosave_linear import NoSaveLinearMixin
from lightning_memkit.strategies import MemkitPipelineStrategy

STEPS, PER_EPOCH, BATCH, MICROBATCHES = 6, 2, 8, 2  # checkpoints resume at epoch ends (a plain DataLoader)
TIMEOUT = 20  # seconds (process group): a rank whose peer is gone fails instead of waiting for it
# The busiest rank's predicted peak is 639,048 B with 2 microbatches (fused loss or not: it is rank 0's) and
# 477,768 B with 4 and the fused loss: with its 5% margin this budget makes MemoryBudget run 4 microbatches and the
# fused loss (turned on by the budget where the strategy does not have it already).
BUDGET = 600_000
FEATURES = ("fused", "checkpointing", "budget", "qlora")


class Record(Callback):
    """The plan at the start of training and, per step, the loss and the calls of this rank's attention modules,
    written to ``path`` as they come; SIGKILL in optimizer step ``kill_at`` (the gradients are there, no weight has
    been updated yet)."""

    def __init__(self, path: Path, budget: MemoryBudget | None, checkpointing: ActivationCheckpointing | None,
                 kill_at: int):
        self.path, self.budget, self.checkpointing, self.kill_at = path, budget, checkpointing, kill_at
        self.result: dict = {"losses": [], "attention_calls": []}
        self._calls = 0

    def _write(self) -> None:
        self.path.write_text(json.dumps(self.result))

    def on_train_start(self, trainer, pl_module):
        strategy = trainer.strategy
        part = strategy.partition
        self.result["plan"] = {
            "microbatches": strategy.microbatches, "fused_loss": strategy.fused_loss, "sizes": list(part.sizes),
            "peaks": [int(b) for b in part.predicted_peak_bytes],
            "budget_changes": None if self.budget is None else list(self.budget.changes),
            "checkpointed": None if self.checkpointing is None else list(self.checkpointing.checkpointed),
        }
        self.result["start_step"] = trainer.global_step
        local = [layer for layer in pl_module.model.model.layers if layer.self_attn.o_proj.weight.device.type != "meta"]
        self.result["local_layers"] = len(local)
        self.result["quantized_local_layers"] = sum(  # NoSaveBitsandbytesPrecision's packed layers on this rank
            isinstance(m, NoSaveLinearMixin) and m.is_quantized for layer in local for m in layer.modules())
        for layer in local:  # recomputed in backward under ActivationCheckpointing: called twice per microbatch
            layer.self_attn.register_forward_hook(self._count)
        self._write()

    def _count(self, *_args) -> None:
        self._calls += 1

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._calls = 0

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_step == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.result["losses"].append(float(outputs["loss"]))
        self.result["attention_calls"].append(self._calls)
        self._write()


def run(out: Path, names: str, kill_at: int, victim: int, resume: bool) -> None:
    chosen = [n for n in names.split(",") if n and n != "-"]
    assert set(chosen) <= set(FEATURES), chosen
    rank = int(os.environ["LOCAL_RANK"])
    out.mkdir(parents=True, exist_ok=True)
    model = HFCausalLM("llama", hidden_size=32, num_layers=2, vocab_size=256, lr=1e-2, seed=0)
    data = ByteTextDataModule(batch_size=BATCH, seq_len=16, max_bytes=20_000, samples_per_epoch=BATCH * PER_EPOCH,
                              batch_format="hf")
    strategy = MemkitPipelineStrategy(microbatches=MICROBATCHES, partition="memory", fused_loss="fused" in chosen,
                                      timeout=TIMEOUT)
    budget = MemoryBudget(BUDGET) if "budget" in chosen else None
    checkpointing = ActivationCheckpointing() if "checkpointing" in chosen else None
    record = Record(out / f"{'resume' if resume else 'fit'}_rank{rank}.json", budget, checkpointing,
                    kill_at if rank == victim else -1)
    # last.ckpt after every step, in place (a crash-consistent directory of shards)
    save = ModelCheckpoint(dirpath=out / "ckpt", save_top_k=0, save_last=True, every_n_train_steps=1)
    callbacks = [record, *(c for c in (checkpointing, budget) if c is not None), save]
    plugins = [NoSaveBitsandbytesPrecision("nf4", "bfloat16", lora_rank=4)] if "qlora" in chosen else []
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=STEPS, logger=False,
                         plugins=plugins, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                         num_sanity_val_steps=0, callbacks=callbacks)
    trainer.fit(model, data, ckpt_path="last" if resume else None)


def main() -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    out, names, kill_at, victim, mode = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    run(out, names, kill_at, victim, mode == "resume")
    # Leave together and skip interpreter finalization (as tests/reliability/_pipeline_crash_worker.py does: a gloo
    # worker thread still destroying a collective's work can abort the process after everything is written).
    torch.distributed.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
