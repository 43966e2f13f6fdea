"""The ``micro_batch`` lever: fewer sequences per forward, the batch's gradients accumulated over the rest.

An HF-config or LightningCLI-config run splits by ``accumulate_grad_batches`` (the data module's batch size divided:
halvings while they divide evenly); a module as built splits each batch inside the training step
(:class:`~lightning_memkit.callbacks.MicroBatchSplit`: halvings rounded up, down to one row), the loader unchanged.
Each micro-batch costs a forward and a backward of its own in the step time model; the optimizer steps once.

    >>> from lightning_memkit.estimate.levers.micro_batch import MICRO_BATCH, batch_splits, halvings
    >>> batch_splits(12), halvings(12), MICRO_BATCH.words(3, 12)
    ([12, 6, 3], [12, 6, 3, 2, 1], 'micro-batch 3 x 4 accumulation')
"""

from __future__ import annotations

import math
from typing import Any

from lightning_memkit.estimate.levers.base import Lever, StepCost, StepSpec, TrainerEdit, Written, find_callback

__all__ = ["MICRO_BATCH", "MicroBatch", "batch_splits", "halvings"]


def batch_splits(batch_size: int) -> list[int]:
    """Micro-batch sizes to try: ``batch_size`` halved while it divides evenly."""
    sizes = [batch_size]
    while sizes[-1] % 2 == 0:
        sizes.append(sizes[-1] // 2)
    return sizes


def halvings(rows: int) -> list[int]:
    """Micro-batch rows to try: ``rows``, then halved (rounded up) down to 1."""
    out = [rows]
    while out[-1] > 1:
        out.append(-(-out[-1] // 2))
    return out


def _steps(choice: int, base: int) -> int:
    return -(-max(base, 1) // max(choice, 1))


class MicroBatch(Lever):
    name, kind, keeps_math, between_steps, default = "micro_batch", "work", True, True, 0
    callback = "lightning_memkit.callbacks.MicroBatchSplit"

    def strength(self, choice: Any) -> int:
        return -choice

    def options(self, base: Any, run: Any) -> list[Any]:
        if not base or not run.allows(self.name):
            return [base]
        return halvings(base) if run.splits_inside_step else batch_splits(base)

    def work(self, choice: Any, base: Any) -> float:
        return math.log2(max(base, 1) / max(choice, 1))

    def words(self, choice: Any, base: Any) -> str:
        return f"micro-batch {choice} x {_steps(choice, base)} accumulation"

    def scale_cost(self, choice: Any, base: Any, cost: StepCost, run: Any, est: Any = None,
                   machine: Any = None) -> StepCost:
        return cost.replace(micro=cost.micro * _steps(choice, base))  # the optimizer still steps once

    def to_step(self, choice: Any, spec: StepSpec) -> None:
        if choice and spec.rows and choice < spec.rows:  # fewer rows than a batch: one micro-step of several
            spec.zero_grad = "accumulate"
        spec.rows = choice or spec.rows

    def write_hf(self, plan: Any, run: Any, out: Written) -> None:
        if plan[self.name] != run.batch_size:
            out.trainer["accumulate_grad_batches"] = run.batch_size // plan[self.name]

    def write_config(self, plan: Any, run: Any, out: Written) -> None:
        if plan[self.name] != run.batch_size:
            out.batch_size = plan[self.name]
            out.trainer["accumulate_grad_batches"] = run.accumulate * (run.batch_size // plan[self.name])

    def write_module(self, plan: Any, run: Any, out: Written) -> None:
        if plan[self.name] != run.base[self.name]:
            out.callbacks.append({"class_path": self.callback, "init_args": {"max_rows": plan[self.name]}})

    def read_trainer(self, trainer: Any) -> Any:
        found = find_callback(trainer, self.callback)
        return None if found is None else found.max_rows

    def apply(self, choice: Any, base: Any, edit: TrainerEdit) -> None:
        rows = edit.run.batch_size
        edit.split.max_rows = choice if choice < rows else None
        edit.change(f"micro-batches of at most {choice} rows inside the step ({_steps(choice, rows)} per batch of "
                    f"{rows} rows; the same samples per optimizer step) (MicroBatchSplit)")


MICRO_BATCH = MicroBatch()
