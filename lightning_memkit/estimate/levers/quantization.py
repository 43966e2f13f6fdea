"""The ``quantization`` lever: a stronger 4-bit mode for a run that already trains LoRA adapters on a quantized
base (``nf4-lora``, then double quantization ``nf4-dq-lora``); the LoRA rank is kept, and a full fine-tune is
never turned into a LoRA one.

    >>> from lightning_memkit.estimate.levers.quantization import QUANTIZATION
    >>> QUANTIZATION.options("int8-lora", None), QUANTIZATION.options(None, None)
    (['int8-lora', 'nf4-lora', 'nf4-dq-lora'], [None])
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import torch

from lightning_memkit.estimate.levers.base import Lever, StepSpec, Written

__all__ = ["DEFAULT_LORA_RANK", "PLUGINS", "QUANTIZATION", "Quantization", "plugin_dtype", "plugin_entry",
           "qlora_plugin"]

DEFAULT_LORA_RANK = 16
PLUGINS = tuple(f"{mode}-lora" for mode in ("nf4", "nf4-dq", "fp4", "fp4-dq", "int8"))

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
        """The model built in the precision's dtype (a checkpoint loaded in it) and converted by a plugin of
        ``choice`` computing in that dtype; a plugin the run holds already (a Trainer's, a config's) is kept."""
        if choice is None or spec.plugin is not None:
            return
        spec.plugin = functools.partial(qlora_plugin, choice, spec.precision, spec.lora_rank)
        spec.dtype = plugin_dtype(spec.precision)
        spec.precision = "32-true"  # the plugin sets the dtype (a Trainer refuses both)

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
    dtype = str(plugin_dtype(precision)).removeprefix("torch.")
    return {"class_path": PLUGIN, "init_args": {"mode": mode.removesuffix("-lora"), "dtype": dtype,
                                                 "lora_rank": lora_rank}}


def plugin_dtype(precision: str) -> torch.dtype:
    """The compute dtype a ``--plugin`` gets from ``--precision``: bfloat16 (``bf16-*``), float16, else float32."""
    return {"bf16-true": torch.bfloat16, "bf16-mixed": torch.bfloat16, "16-true": torch.float16}.get(
        precision, torch.float32)


def qlora_plugin(name: str | None, precision: str, lora_rank: int = DEFAULT_LORA_RANK) -> Any:
    """The :class:`~lightning_memkit.plugins.NoSaveBitsandbytesPrecision` that ``--plugin name`` stands for:
    ``name`` without ``-lora`` as its mode, ``precision``'s dtype, LoRA adapters of ``lora_rank``."""
    from lightning_memkit.common.errors import ConfigError

    if name is None:
        return None
    if name not in PLUGINS:
        raise ConfigError(f"--plugin: {name!r} is not estimated; allowed: {', '.join(PLUGINS)} (quantized layers "
                          "are frozen: without LoRA adapters nothing would train)")
    if isinstance(lora_rank, bool) or not isinstance(lora_rank, int) or lora_rank < 1:
        raise ConfigError(f"--lora-rank: must be an int >= 1, got {lora_rank!r}")
    from lightning_memkit.plugins import NoSaveBitsandbytesPrecision

    try:
        return NoSaveBitsandbytesPrecision(name.removesuffix("-lora"), plugin_dtype(precision), lora_rank=lora_rank)
    except ValueError as err:
        raise ConfigError(f"--plugin {name} with --precision {precision}: {err}") from err


QUANTIZATION = Quantization()
