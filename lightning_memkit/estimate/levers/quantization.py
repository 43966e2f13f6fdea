"""The ``quantization`` lever: a stronger 4-bit mode for a run that already trains LoRA adapters on a quantized
base (``nf4-lora``, then double quantization ``nf4-dq-lora``); the LoRA rank is kept, and a full fine-tune is
never turned into a LoRA one.

    >>> from lightning_memkit.estimate.levers.quantization import QUANTIZATION
    >>> QUANTIZATION.options("int8-lora", None), QUANTIZATION.options(None, None)
    (['int8-lora', 'nf4-lora', 'nf4-dq-lora'], [None])
"""

from __future__ import annotations

import copy
from typing import Any

from lightning_memkit.estimate.levers.base import Lever, StepSpec, Written

__all__ = ["QUANTIZATION", "Quantization", "plugin_entry"]

_STRENGTH = {None: 0, "int8-lora": 0, "nf4-lora": 1, "fp4-lora": 1, "nf4-dq-lora": 2, "fp4-dq-lora": 2}
PLUGIN = "lightning_memkit.plugins.NoSaveBitsandbytesPrecision"


class Quantization(Lever):
    name, kind, keeps_math, default = "quantization", "work", False, None
    plugin = PLUGIN  # the precision plugin carrying the choice

    def strength(self, choice: Any) -> int:
        return _STRENGTH.get(choice, 0)

    def options(self, base: Any, run: Any) -> list[Any]:
        if base is None:
            return [None]
        return [base] + [m for m in ("nf4-lora", "nf4-dq-lora") if _STRENGTH[m] > _STRENGTH[base]]

    def words(self, choice: Any, base: Any) -> str:
        return f"quantization {choice}"

    def to_step(self, choice: Any, spec: StepSpec) -> None:
        spec.plugin = choice

    def write_hf(self, plan: Any, run: Any, out: Written) -> None:
        if plan[self.name] is not None:
            out.trainer["plugins"] = [plugin_entry(plan[self.name], plan["precision"], run.lora_rank)]

    def write_config(self, plan: Any, run: Any, out: Written) -> None:
        if plan[self.name] is not None:
            entry = copy.deepcopy(run.plugin_entry)
            entry.setdefault("init_args", {})["mode"] = plan[self.name].removesuffix("-lora")
            out.trainer["plugins"] = [entry]


def plugin_entry(mode: str, precision: str, lora_rank: int) -> dict[str, Any]:
    """The ``NoSaveBitsandbytesPrecision`` config entry for ``mode`` (``"nf4-lora"``), in ``precision``'s dtype."""
    from lightning_memkit.estimate.hf import plugin_dtype

    dtype = str(plugin_dtype(precision)).removeprefix("torch.")
    return {"class_path": PLUGIN, "init_args": {"mode": mode.removesuffix("-lora"), "dtype": dtype,
                                                 "lora_rank": lora_rank}}


QUANTIZATION = Quantization()
