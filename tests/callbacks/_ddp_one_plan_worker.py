"""One rank of the 2-process test that every rank trains with one plan. Run by tests/callbacks/test_budget_ddp.py.

    LOCAL_RANK=r NODE_RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 python _ddp_one_plan_worker.py OUT

Fits TinyLM under DDP (gloo) with ``MemoryBudget`` for two steps, rank 0 on sequences of 32 bytes and rank 1 on
sequences of 64, each rank ranking plans with a balance of its own (``MEMKIT_MACHINE``: a GEMM-bound one on rank 0,
a memory-bound one on rank 1), as two ranks that probed a busy machine at different moments would. Writes the
changes, the predicted peak, the balance the plans were ranked with and the measured peak to ``OUT/rank{r}.json``.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402

from lightning_memkit.callbacks import MemoryBudget  # noqa: E402
from lightning_memkit.demo import ByteTextDataModule, TinyLM  # noqa: E402

warnings.filterwarnings("ignore")
torch.set_num_threads(1)
BALANCES = [
    {"device": "rank 0's", "gemm_flops": {"float32": 1e9}, "memory_bytes_per_s": 1e13, "link_bytes_per_s": 1e13},
    {"device": "rank 1's", "gemm_flops": {"float32": 1e14}, "memory_bytes_per_s": 1e9, "link_bytes_per_s": 1e7},
]


def main() -> None:
    out, rank = Path(sys.argv[1]), int(os.environ["LOCAL_RANK"])
    os.environ["MEMKIT_MACHINE"] = json.dumps(BALANCES[rank])
    pl.seed_everything(0, verbose=False)
    model = TinyLM(d_model=64, n_layers=2, n_heads=4, seq_len=64)
    data = ByteTextDataModule(batch_size=8, seq_len=32 * (rank + 1), max_bytes=50_000, samples_per_epoch=32)
    budget = MemoryBudget("5MiB", allow=["recompute", "micro_batch"])
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=DDPStrategy(), max_steps=2, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0, callbacks=[budget])
    trainer.fit(model, data)
    (out / f"rank{rank}.json").write_text(json.dumps({
        "changes": budget.changes, "plan": budget.plan.plan.to_dict(), "predicted": budget.plan.peak_bytes,
        "ranked_on": budget.ranked_on, "replans": [str(r) for r in budget.replans],
        "measured": budget.measured_peak_bytes, "budget": budget.budget_bytes}))


if __name__ == "__main__":
    main()
