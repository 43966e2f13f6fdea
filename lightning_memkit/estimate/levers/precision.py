"""The ``precision`` lever: train in ``bf16-true`` (weights, gradients and optimizer state in bfloat16).

Opt-in for ``MemoryBudget`` (it changes the numerics). Where a precision plugin sets the dtype (a LightningCLI config
or a Trainer with ``NoSaveBitsandbytesPrecision``) the run keeps its precision; an HF-config run builds its plugin
from the precision, so the two go together there.

    >>> from lightning_memkit.estimate.levers.precision import PRECISION
    >>> [PRECISION.strength(p) for p in ("32-true", "bf16-mixed", "bf16-true")], PRECISION.words("bf16-true", "32-true")
    ([0, 0, 1], 'precision bf16-true')
"""

from __future__ import annotations

from typing import Any

from lightning_memkit.estimate.levers.base import Lever, StepSpec, TrainerEdit, Written

__all__ = ["PRECISION", "Precision"]

_STRENGTH = {"32-true": 0, "32": 0, "bf16-mixed": 0, "bf16-true": 1, "16-true": 1}
_LIGHTNING_NAMES = {"32": "32-true", "bf16": "bf16-mixed", "16": "16-mixed"}


class Precision(Lever):
    name, kind, keeps_math, default = "precision", "free", False, "32-true"

    def strength(self, choice: Any) -> int:
        return _STRENGTH.get(choice, 0)

    def options(self, base: Any, run: Any) -> list[Any]:
        if not run.allows(self.name) or run.precision_fixed:
            return [base]
        return [base] + (["bf16-true"] if self.strength(base) == 0 else [])

    def words(self, choice: Any, base: Any) -> str:
        return f"precision {choice}"

    def to_step(self, choice: Any, spec: StepSpec) -> None:
        spec.precision = choice

    def write_hf(self, plan: Any, run: Any, out: Written) -> None:
        if plan["quantization"] is None and plan[self.name] != "32-true":
            out.trainer["precision"] = plan[self.name]

    def write_config(self, plan: Any, run: Any, out: Written) -> None:
        if plan["quantization"] is None and plan[self.name] != run.base[self.name]:
            out.trainer["precision"] = plan[self.name]

    def write_module(self, plan: Any, run: Any, out: Written) -> None:
        if plan[self.name] != run.base[self.name]:
            out.trainer["precision"] = plan[self.name]

    def read_trainer(self, trainer: Any) -> Any:
        precision = str(trainer.precision)
        return _LIGHTNING_NAMES.get(precision, precision)

    def apply(self, choice: Any, base: Any, edit: TrainerEdit) -> None:
        from lightning.pytorch.plugins.precision import HalfPrecision

        edit.trainer.strategy.precision_plugin = HalfPrecision(choice)
        edit.change(f"precision {choice}")


PRECISION = Precision()
