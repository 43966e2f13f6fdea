"""A memory budget per rank under ``memkit_pipeline``: the fewest changes to its microbatches and fused loss whose
split keeps every rank's predicted peak within the budget.

The strategy predicts each rank's peak itself (its ``partition="memory"`` measurement: each layer's bytes on one
microbatch, then the split with the smallest largest rank peak, the schedule's in-flight microbatches counted, as
``memkit estimate --pipeline`` reports); ``MemoryBudget`` asks it for candidate options in order and keeps the
first whose busiest rank fits. Example (the plan a ``MemoryBudget`` makes in ``setup`` under the strategy)::

    from lightning_memkit.callbacks.budget_pipeline import candidates

    class Options:  # what candidates() reads from the strategy
        microbatches, fused_loss, splits_hf_model = 2, False, True

    list(candidates(Options(), allow=("fused_loss", "micro_batch"), doublings=2))
    # [(2, False), (2, True), (4, True), (8, True)]
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["PipelinePlan", "candidates", "plan_pipeline"]

_OWNER = "MemoryBudget"
DOUBLINGS = 4  # the most times the microbatches are doubled


@dataclass(frozen=True)
class PipelinePlan:
    """The options a pipeline run gets, the split the strategy predicted for them and this rank."""

    microbatches: int
    fused_loss: bool
    partition: Any
    rank: int

    @property
    def peak_bytes(self) -> int:
        """This rank's predicted peak."""
        return int(self.partition.predicted_peak_bytes[self.rank])

    @property
    def busiest_bytes(self) -> int:
        return int(max(self.partition.predicted_peak_bytes))

    def describe(self) -> str:
        ranks = ", ".join(f"{b:,}" for b in self.partition.predicted_peak_bytes)
        return (f"{self.microbatches} microbatches{', fused loss' if self.fused_loss else ''}, stages of "
                f"{list(self.partition.sizes)} layers; predicted peak per rank [B]: {ranks}")


def candidates(strategy: Any, allow: Sequence[str], doublings: int = DOUBLINGS) -> Iterator[tuple[int, bool]]:
    """``(microbatches, fused_loss)`` to try, the run as given first: the fused loss (a Hugging Face model's last
    stage without logits), then twice the microbatches each time (smaller microbatches in flight)."""
    microbatches, fused = strategy.microbatches, strategy.fused_loss
    yield microbatches, fused
    if "fused_loss" in allow and strategy.splits_hf_model and not fused:
        fused = True
        yield microbatches, fused
    if "micro_batch" in allow:
        for _ in range(doublings):
            microbatches *= 2
            yield microbatches, fused


def plan_pipeline(trainer: Any, limit: int, allow: Sequence[str],
                  say: Any) -> tuple[PipelinePlan | None, list[str], PipelinePlan | None]:
    """The first candidate whose busiest rank is predicted within ``limit`` bytes, the changes it makes in words,
    and the smallest prediction seen; ``(None, [], best)`` when none fits. Every rank calls it (the strategy's
    measurement is rank 0's, broadcast)."""
    strategy = trainer.strategy
    if strategy.partition_method != "memory":
        raise ValueError(f"{_OWNER} plans memkit_pipeline runs with partition='memory' (the split measured with its "
                         f"activations); this run has partition={strategy.partition_method!r}")
    given, best = (strategy.microbatches, strategy.fused_loss), None
    for microbatches, fused in candidates(strategy, allow):
        try:
            partition = strategy.predict_partition(trainer, microbatches=microbatches, fused_loss=fused)
        except ValueError as err:  # e.g. the batch does not split into that many microbatches
            say(f"{_OWNER}: {microbatches} microbatches not tried: {str(err).splitlines()[0]}")
            break
        plan = PipelinePlan(microbatches, fused, partition, trainer.global_rank)
        say(f"{_OWNER}: memkit_pipeline with {plan.describe()}")
        best = plan if best is None or plan.busiest_bytes < best.busiest_bytes else best
        if plan.busiest_bytes <= limit:
            changes = []
            if microbatches != given[0]:
                changes.append(f"memkit_pipeline microbatches {microbatches} (from {given[0]})")
            if fused != given[1]:
                changes.append("memkit_pipeline fused loss (the last stage's head without logits)")
            return plan, changes, best
    return None, [], best
