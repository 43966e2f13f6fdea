"""The ``fused_loss`` lever: the causal LM's cross-entropy fused with its head, the logits never built whole
(:class:`~lightning_memkit.callbacks.FusedLinearCrossEntropy`); for a transformers causal LM, peft-wrapped too.

    >>> from lightning_memkit.estimate.levers.fused_loss import FUSED_LOSS
    >>> FUSED_LOSS.strength(True), FUSED_LOSS.words(True, False)
    (1, 'fused loss')
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from lightning_memkit.estimate.levers.base import Lever, StepSpec, TrainerEdit, Written, find_callback

__all__ = ["FUSED_LOSS", "FusedLoss", "fused_linear_cross_entropy_inside"]


@contextlib.contextmanager
def fused_linear_cross_entropy_inside(module: Any) -> Iterator[None]:
    """:func:`~lightning_memkit.hf.fused_linear_cross_entropy` on the causal LMs the ``FusedLinearCrossEntropy``
    callback would patch in ``module`` (its ``find_causal_lms``: itself, or those a LightningModule holds): the fake
    step's fused loss."""
    from lightning_memkit.common.errors import ConfigError
    from lightning_memkit.hf import fused_linear_cross_entropy
    from lightning_memkit.hf.fused_loss import find_causal_lms

    try:
        models = find_causal_lms(module)
    except ValueError as err:
        raise ConfigError(f"fused loss (FusedLinearCrossEntropy, --fused-loss): {err}") from err
    with contextlib.ExitStack() as stack:
        for model in models:
            stack.enter_context(fused_linear_cross_entropy(model))
        yield


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
        if choice:
            spec.patches.append(fused_linear_cross_entropy_inside)

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
