"""The ``stages`` lever: the model split into pipeline stages over as many devices (``memkit_pipeline``, 1F1B), when no
single-device plan fits an HF config. A plan of ``S`` stages and ``M`` microbatches costs the single-device step
over ``S`` plus the bubble ``(S - 1) / M``.

    >>> from lightning_memkit.estimate.levers.stages import STAGES
    >>> class Run:
    ...     batch_size = 4
    >>> from lightning_memkit.estimate.levers.base import StepCost
    >>> STAGES.words(2, 1), STAGES.scale_cost(2, 1, StepCost(100.0), Run()).seconds
    ('2 pipeline stages', 62.5)
"""

from __future__ import annotations

import dataclasses
from typing import Any

from lightning_memkit.estimate.levers.base import Lever, StepCost, StepSpec, Written

__all__ = ["STAGES", "Stages"]

STRATEGY = "lightning_memkit.strategies.MemkitPipelineStrategy"


class Stages(Lever):
    name, kind, keeps_math, default = "stages", "scale", True, 1
    runs_sharded = False  # FSDP2 inside pipeline stages is not planned

    def strength(self, choice: Any) -> int:
        return choice

    def words(self, choice: Any, base: Any) -> str | None:
        return f"{choice} pipeline stages" if choice > 1 else None

    def scale_cost(self, choice: Any, base: Any, cost: StepCost, run: Any, est: Any = None,
                   machine: Any = None) -> StepCost:
        if choice == 1:
            return cost
        return cost.scaled((1 + (choice - 1) / run.batch_size) / choice)

    def devices(self, choice: Any) -> int:
        return choice

    def to_step(self, choice: Any, spec: StepSpec) -> None:
        spec.world = dataclasses.replace(spec.world, pipeline=choice)

    def write_hf(self, plan: Any, run: Any, out: Written) -> None:
        if plan[self.name] > 1:
            out.trainer["devices"] = plan[self.name]
            out.trainer["strategy"] = {"class_path": STRATEGY,
                                       "init_args": {"schedule": "1f1b", "microbatches": run.batch_size,
                                                     "partition": "memory", "fused_loss": plan["fused_loss"]}}


STAGES = Stages()
