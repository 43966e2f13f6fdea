"""One rank of the 2-process DDP out-of-memory tests. Run by tests/callbacks/test_budget_ddp.py.

    LOCAL_RANK=r NODE_RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 python _ddp_oom_worker.py OUT

Fits TinyLM under DDP (gloo) with ``MemoryBudget``, five optimizer steps of two accumulated batches each: once as
is, then with an out-of-memory error injected on rank 1 only at step 3, in the forward, the backward and the
optimizer step (a fit each), then with the error raised three times (past the two retries), then with rank 1
holding 40% of the prediction more in every backward under a budget of 1.3 times the prediction (rank 1 re-plans,
rank 0 applies its plan); and,
with gradient
clipping, once as is and once with rank 1's AdamW running out of memory in its first step after clipping and after
creating part of its state. Writes each fit's step losses, final weights, recoveries and error to
``OUT/rank{r}.json``.
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
from step_faults import OOM, WHERE, InjectOOM, StepLosses  # noqa: E402

from lightning_memkit.callbacks import MemoryBudget  # noqa: E402
from lightning_memkit.demo import ByteTextDataModule, TinyLM  # noqa: E402

warnings.filterwarnings("ignore")
torch.set_num_threads(1)


class FlakyAdamW(torch.optim.AdamW):
    """AdamW whose first step, once, runs the closure (forward, backward, clipping), creates the state of its
    first parameter and then runs out of memory, as a real first step can while allocating its state."""

    def __init__(self, params, fail: bool, **kw) -> None:
        super().__init__(params, **kw)
        self.fail = fail

    def step(self, closure=None):
        if not self.fail or closure is None:  # the budget's estimate steps a copy without a closure
            return super().step(closure)
        self.fail = False
        closure()
        first = self.param_groups[0]["params"][0]
        self.state[first]["exp_avg"] = torch.zeros_like(first)
        raise RuntimeError(OOM)


class FlakyLM(TinyLM):
    def __init__(self, fail: bool, **kw) -> None:
        super().__init__(**kw)
        self.fail = fail

    def configure_optimizers(self):
        return FlakyAdamW(self.parameters(), fail=self.fail, lr=1e-3)


class Hog(pl.Callback):
    """Holds ``nbytes`` more during every step's backward on this rank: its steps peak above the prediction (a
    prediction wrong on purpose, on one rank), and it re-plans."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes, self.held = nbytes, None

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        self.held = torch.ones(self.nbytes, dtype=torch.uint8)

    def on_after_backward(self, trainer, pl_module) -> None:
        self.held = None


def fit(rank: int, fault: InjectOOM | None | str, budget: int | str = "1GiB", hog: int = 0) -> dict:
    pl.seed_everything(0, verbose=False)
    clip = isinstance(fault, str)
    kw = dict(d_model=64, n_layers=2, n_heads=4, seq_len=32)
    model = FlakyLM(fault == "adam" and rank == 1, **kw) if clip else TinyLM(**kw)
    fault = None if clip else fault
    data = ByteTextDataModule(batch_size=8, seq_len=32, max_bytes=50_000, samples_per_epoch=80)
    budget, losses = MemoryBudget(budget, **({} if budget == "1GiB" else {"allow": ["micro_batch"]})), StepLosses()
    callbacks = [losses, budget] + ([fault] if fault is not None and rank == 1 else []) + ([Hog(hog)] if hog else [])
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=DDPStrategy(), max_steps=5, accumulate_grad_batches=2,
                         gradient_clip_val=0.5 if clip else None,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, limit_val_batches=0, callbacks=callbacks)
    result = {"error": None}
    try:
        trainer.fit(model, data)
    except Exception as err:  # noqa: BLE001 - reported to the test
        result["error"] = f"{type(err).__name__}: {err}"
    split = next(c for c in trainer.callbacks if type(c).__name__ == "MicroBatchSplit")
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    result.update(steps=losses.steps, step=trainer.global_step, recoveries=split.recoveries,
                  replans=[str(r) for r in budget.replans], weights=flat.tolist(),
                  plan=budget.plan.plan.to_dict(), predicted=budget.plan.peak_bytes)
    return result


def main() -> None:
    out, cases = Path(sys.argv[1]), sys.argv[2:] or ["as_is", *WHERE, "exhausted", "clipped", "clipped_adam", "replan"]
    rank = int(os.environ["LOCAL_RANK"])
    faults = {where: InjectOOM(where, at_step=3, micro=2 if where != "optimizer" else 1) for where in WHERE}
    faults.update(as_is=None, exhausted=InjectOOM("forward", at_step=3, times=3), clipped="", clipped_adam="adam")
    result = {case: fit(rank, faults[case]) for case in cases if case != "replan"}
    if "replan" in cases:  # rank 1 holds 40% more than predicted, the budget 1.3x the prediction: rank 1 re-plans
        true = result["as_is"]["predicted"]
        result["replan"] = fit(rank, None, budget=int(true * 1.3), hog=int(true * 0.4) if rank == 1 else 0)
    (out / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
