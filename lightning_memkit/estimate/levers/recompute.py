"""The ``recompute`` lever: activation checkpointing of the repeated blocks, selective (matmul and attention outputs
kept) or full (only the inputs kept), by :class:`~lightning_memkit.callbacks.ActivationCheckpointing`.

    >>> from lightning_memkit.estimate.levers.recompute import RECOMPUTE
    >>> class Run:
    ...     def allows(self, name): return True
    >>> RECOMPUTE.options("selective", Run()), RECOMPUTE.entry("selective")["init_args"]
    (['selective', 'full'], {'selective': True})
"""

from __future__ import annotations

from typing import Any

from lightning_memkit.estimate.levers.base import Lever, StepSpec, TrainerEdit, Written, find_callback

__all__ = ["RECOMPUTE", "Recompute"]

_STRENGTH = {None: 0, "selective": 1, "full": 2}


class Recompute(Lever):
    name, kind, keeps_math, between_steps, default = "recompute", "work", True, True, None
    wraps_module = True
    callback = "lightning_memkit.callbacks.ActivationCheckpointing"

    def strength(self, choice: Any) -> int:
        return _STRENGTH[choice]

    def options(self, base: Any, run: Any) -> list[Any]:
        if not run.allows(self.name):
            return [base]
        return [c for c in _STRENGTH if _STRENGTH[c] >= _STRENGTH[base]]

    def words(self, choice: Any, base: Any) -> str:
        return f"{choice or 'no'} activation checkpointing"

    def entry(self, choice: str) -> dict[str, Any]:
        return {"class_path": self.callback, "init_args": {"selective": choice == "selective"}}

    def to_step(self, choice: Any, spec: StepSpec) -> None:
        from lightning_memkit.hf.layers import kv_cache_off

        spec.recompute = choice
        if choice is not None:  # as ActivationCheckpointing does: recomputed layers keep no KV cache
            spec.patches.append(kv_cache_off)

    def write_hf(self, plan: Any, run: Any, out: Written) -> None:
        if plan[self.name] is not None:
            out.callbacks.append(self.entry(plan[self.name]))

    write_config = write_hf

    def write_module(self, plan: Any, run: Any, out: Written) -> None:
        if plan[self.name] != run.base[self.name]:
            self.write_hf(plan, run, out)

    def read_trainer(self, trainer: Any) -> Any:
        found = find_callback(trainer, self.callback)
        return None if found is None else ("selective" if found.selective else "full")

    def apply(self, choice: Any, base: Any, edit: TrainerEdit) -> None:
        from lightning_memkit.common.class_paths import instantiate

        found = edit.find(self.callback)
        edit.change(f"{choice} activation checkpointing (ActivationCheckpointing"
                    f"{'' if found is None else ', its policy kept'})")
        if found is None:
            edit.added.append(instantiate(self.entry(choice)))
        else:
            found.selective = choice == "selective"


RECOMPUTE = Recompute()
