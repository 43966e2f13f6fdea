"""A lever that is a callback switched on or off (activation offload, the optimizer-state levers): its choice read from
and written as that callback's presence, in a Trainer, a LightningCLI config or a plan's YAML.

    >>> from lightning_memkit.estimate.levers.offload_activations import OFFLOAD_ACTIVATIONS
    >>> OFFLOAD_ACTIVATIONS.words(False, True), OFFLOAD_ACTIVATIONS.entry()
    ('no activation offload', {'class_path': 'lightning_memkit.callbacks.ActivationOffloading'})
"""

from __future__ import annotations

from typing import Any

from lightning_memkit.estimate.levers.base import Lever, TrainerEdit, Written, find_callback

__all__ = ["SwitchLever"]


class SwitchLever(Lever):
    """Base: ``True`` puts ``callback`` on the Trainer. Subclasses set ``name``, ``kind``, ``callback``, ``label``
    (the plan's words) and, if the line saying the change differs, ``change_label``."""

    default = False
    label = ""
    change_label = ""

    def strength(self, choice: Any) -> int:
        return int(choice)

    def options(self, base: Any, run: Any) -> list[Any]:
        if base or not run.allows(self.name) or self.unavailable(run):
            return [base]
        return [False, True]

    def words(self, choice: Any, base: Any) -> str:
        return self.label if choice else f"no {self.label}"

    def entry_for(self, plan: Any) -> dict[str, Any]:
        """The callback's config entry under ``plan``."""
        return {"class_path": self.callback}

    def entry(self) -> dict[str, Any]:
        return self.entry_for({})

    def write_hf(self, plan: Any, run: Any, out: Written) -> None:
        if plan[self.name]:
            out.callbacks.append(self.entry_for(plan))

    write_config = write_hf

    def write_module(self, plan: Any, run: Any, out: Written) -> None:
        if plan[self.name] and not run.base[self.name]:
            out.callbacks.append(self.entry_for(plan))

    def read_trainer(self, trainer: Any) -> Any:
        return find_callback(trainer, self.callback) is not None

    def read_config(self, trainer: dict[str, Any]) -> Any:
        from lightning_memkit.common.class_paths import class_name

        return any(class_name(c) == class_name(self.callback) for c in trainer.get("callbacks") or [])

    def apply(self, choice: Any, base: Any, edit: TrainerEdit) -> None:
        from lightning_memkit.common.class_paths import instantiate

        if choice and not base:
            edit.added.append(instantiate(self.entry_for(edit.plan or {})))
            edit.change(f"{self.change_label or self.label} ({self.callback.rpartition('.')[2]})")
