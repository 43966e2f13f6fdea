"""One rank of tests/callbacks/test_budget_fsdp2.py: ``MemoryBudget`` on 2 gloo ranks, under DDP and under
``memkit_fsdp2``: a plentiful budget first (each strategy's predicted and measured peak of a rank), then a budget
between the sharded and the replicated predictions with no lever allowed (DDP cannot meet it, the sharded run fits as
given). Writes each fit's plan, predicted and measured peaks, changes and error to ``OUT/rank{r}.json``.

    LOCAL_RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python _budget_fsdp2_worker.py OUT
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch

from lightning_memkit.callbacks import MemoryBudget
from lightning_memkit.demo import ByteTextDataModule, HFCausalLM

warnings.filterwarnings("ignore")
torch.set_num_threads(1)


def fit(strategy: str, budget: MemoryBudget) -> dict:
    pl.seed_everything(0, verbose=False)
    model = HFCausalLM(family="llama", hidden_size=64, num_layers=2, vocab_size=256, seed=0)
    data = ByteTextDataModule(batch_size=4, seq_len=32, max_bytes=20_000, samples_per_epoch=16, batch_format="hf")
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=3, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0, num_sanity_val_steps=0, callbacks=[budget])
    result = {"error": None}
    try:
        trainer.fit(model, data)
    except Exception as err:  # noqa: BLE001 - reported to the test
        result["error"] = f"{type(err).__name__}: {err}"
    plan = budget.plan
    result.update(predicted=None if plan is None else plan.peak_bytes, measured=budget.measured_peak_bytes,
                  plan=None if plan is None else plan.plan.to_dict(), changes=budget.changes)
    return result


def main() -> None:
    out, rank = Path(sys.argv[1]), int(os.environ["LOCAL_RANK"])
    result = {"ddp": fit("ddp", MemoryBudget("1GiB")), "fsdp2": fit("memkit_fsdp2", MemoryBudget("1GiB"))}
    between = (result["ddp"]["predicted"] + result["fsdp2"]["predicted"]) // 2
    result["between"] = between
    result["fsdp2_tight"] = fit("memkit_fsdp2", MemoryBudget(between, allow=()))
    result["ddp_tight"] = fit("ddp", MemoryBudget(between, allow=()))  # raises: last
    (out / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
