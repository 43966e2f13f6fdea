"""One rank of the 2-process MemoryBudget-under-memkit_pipeline tests. Run by tests/callbacks/test_budget_pipeline.py.

    LOCAL_RANK=r NODE_RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 python _budget_pipeline_worker.py OUT

A tiny Llama (hidden 64, 4 layers) on byte windows under ``MemkitPipelineStrategy(microbatches=2)``: a fit as
given; a fit with ``MemoryBudget`` at 85% of the busiest rank's predicted peak of the first (the run as given does
not fit it); a fit with a plentiful budget (nothing changes); a budget nothing reaches (``NoPlanFits`` on both
ranks). Writes each fit's step losses, the strategy's predicted peak per rank, microbatches, fused loss, the
budget's changes and error to ``OUT/rank{r}.json``.
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
from step_faults import StepLosses  # noqa: E402

from lightning_memkit.callbacks import MemoryBudget  # noqa: E402
from lightning_memkit.demo import ByteTextDataModule, HFCausalLM  # noqa: E402
from lightning_memkit.strategies import MemkitPipelineStrategy  # noqa: E402

warnings.filterwarnings("ignore")
torch.set_num_threads(1)


def fit(budget: MemoryBudget | None) -> dict:
    pl.seed_everything(0, verbose=False)
    model = HFCausalLM(family="llama", hidden_size=64, num_layers=4, vocab_size=256, seed=0)
    data = ByteTextDataModule(batch_size=8, seq_len=64, max_bytes=50_000, samples_per_epoch=24, batch_format="hf")
    losses = StepLosses()
    strategy = MemkitPipelineStrategy(microbatches=2, timeout=60)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=3, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0, num_sanity_val_steps=0, callbacks=[losses] + ([budget] if budget else []))
    result = {"error": None}
    try:
        trainer.fit(model, data)
    except Exception as err:  # noqa: BLE001 - reported to the test
        result["error"] = f"{type(err).__name__}: {err}"
    partition = strategy.partition
    result.update(steps=losses.steps, microbatches=strategy.microbatches, fused=strategy.fused_loss,
                  peaks=None if partition is None else list(partition.predicted_peak_bytes),
                  changes=None if budget is None else budget.changes,
                  report=None if budget is None or budget.plan is None else budget.memory_effect())
    return result


def main() -> None:
    out, rank = Path(sys.argv[1]), int(os.environ["LOCAL_RANK"])
    result = {"as_is": fit(None)}
    busiest = max(result["as_is"]["peaks"])
    result["busiest"] = busiest
    result["tight"] = fit(MemoryBudget(int(busiest * 0.85)))
    result["plentiful"] = fit(MemoryBudget("1GiB"))
    result["none"] = fit(MemoryBudget(busiest // 20))
    (out / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
