"""The ``fused_loss`` lever: the causal LM's cross-entropy fused with its head, the logits never built whole
(:class:`~lightning_memkit.callbacks.FusedLinearCrossEntropy`); for a transformers causal LM, peft-wrapped too.

    >>> from lightning_memkit.estimate.levers.fused_loss import FUSED_LOSS
    >>> FUSED_LOSS.strength(True), FUSED_LOSS.words(True, False)
    (1, 'fused loss')
"""

from __future__ import annotations

from typing import Any

from lightning_memkit.estimate.levers.base import Lever, StepSpec, TrainerEdit, Written, find_callback

__all__ = ["FUSED_LOSS", "FusedLoss"]


class FusedLoss(Lever):
    name, kind, keeps_math, between_steps, default = "fused_loss", "free", True, True, False
    wraps_module = True
    callback = "lightning_memkit.callbacks.FusedLinearCrossEntropy"

    def strength(self, choice: Any) -> int:
        return int(choice)

    def options(self, base: Any, run: Any) -> list[Any]:
        return sorted({base, run.allows(self.name) and run.has_causal_lm})

    def words(self, choice: Any, base: Any) -> str:
        return "fused loss" if choice else "no fused loss"

    def to_step(self, choice: Any, spec: StepSpec) -> None:
        spec.fused_loss = choice

    def write_hf(self, plan: Any, run: Any, out: Written) -> None:
        if plan[self.name] and plan["stages"] == 1:  # a pipeline's last stage fuses its loss itself
            out.callbacks.append({"class_path": self.callback})

    def write_config(self, plan: Any, run: Any, out: Written) -> None:
        if plan[self.name]:
            out.callbacks.append({"class_path": self.callback})

    def write_module(self, plan: Any, run: Any, out: Written) -> None:
        if plan[self.name] and not run.base[self.name]:
            out.callbacks.append({"class_path": self.callback})

    def read_trainer(self, trainer: Any) -> Any:
        return find_callback(trainer, self.callback) is not None

    def apply(self, choice: Any, base: Any, edit: TrainerEdit) -> None:
        from lightning_memkit.common.class_paths import instantiate

        if choice and not base:
            edit.added.append(instantiate({"class_path": self.callback}))
            edit.change("fused cross-entropy (FusedLinearCrossEntropy)")


FUSED_LOSS = FusedLoss()
