"""A memkit / LightningCLI config as ``memkit estimate --config`` runs it, as a run for the planner: its settings read
into the plan as given, a plan written as the edit of its parsed keys.

Example (from a checkout)::

    >>> from lightning_memkit.estimate.config_run import ConfigRun
    >>> run = ConfigRun("examples/configs/tiny_lm.yaml", ["--data.init_args.batch_size", "4"])
    >>> run.fragment(run.base.replace(micro_batch=2))
    {'trainer': {'accumulate_grad_batches': 2}, 'data': {'init_args': {'batch_size': 2}}}
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning_memkit.common.class_paths import class_name
from lightning_memkit.common.errors import ConfigError
from lightning_memkit.estimate.levers import LEVERS, Plan
from lightning_memkit.estimate.runs import LeverRun, check_allow
from lightning_memkit.estimate.step import MemoryEstimate

__all__ = ["ConfigRun"]

_OWN = {class_name(x.callback) for x in LEVERS if x.callback}  # callbacks a plan writes (settings of the config's kept)


class ConfigRun(LeverRun):
    """A memkit / LightningCLI config as ``memkit estimate --config`` runs it; plans edit its parsed keys."""

    kind = "config"

    def __init__(self, config: str | Path, overrides: list[str] | tuple[str, ...] = (),
                 allow: Sequence[str] | None = None):
        from lightning_memkit.config.lightning_cli import parse_config
        from lightning_memkit.estimate.config import config_devices, config_features, config_plan

        self.allow = check_allow(allow)
        self.config = Path(config)
        if not self.config.is_file():
            raise ConfigError(f"--config: no such file: {self.config}")
        self.parsed = parse_config(self.config, [str(a) for a in overrides])
        trainer = self.parsed.get("trainer") or {}
        features = config_features(trainer)
        self.accumulate = int(trainer.get("accumulate_grad_batches") or 1)
        self.devices = config_devices(trainer)
        plugin = features["plugin"]
        self.plugin_entry = (trainer.get("plugins") or [None])[0] if plugin is not None else None
        self.base = config_plan(self.parsed, features)
        self.batch_size = self.base["micro_batch"]  # the data module's batch size
        self.lora_rank = getattr(plugin, "lora_rank", 0)
        self.plugin_dtype = getattr(plugin, "dtype", None)
        self.target = "cpu" if trainer.get("accelerator") == "cpu" else "cuda"
        self.precision_fixed = plugin is not None
        self.has_causal_lm, self.optimizer_name = _model_facts(self.parsed["model"])

    def compute_dtype(self, plan: Plan) -> str:
        if self.plugin_dtype is not None:
            return str(self.plugin_dtype).removeprefix("torch.")
        return super().compute_dtype(plan)

    def edited(self, plan: Plan) -> dict[str, Any]:
        """The parsed config with ``plan`` applied."""
        parsed = copy.deepcopy(self.parsed)
        trainer = parsed.setdefault("trainer", {})
        out = self.written(plan)
        trainer["callbacks"] = _with_callbacks(trainer.get("callbacks") or [], out.callbacks)
        trainer.update(out.trainer)
        if out.batch_size is not None:
            parsed["data"]["init_args"]["batch_size"] = out.batch_size
        return parsed

    def estimate(self, plan: Plan) -> MemoryEstimate:
        from lightning_memkit.estimate.config import estimate_parsed_config

        return estimate_parsed_config(self.edited(plan))

    def fragment(self, plan: Plan) -> dict[str, Any]:
        edited, out = self.edited(plan), {}
        for section in ("trainer", "data"):
            old, new = self.parsed.get(section) or {}, edited.get(section) or {}
            changed = {k: v for k, v in new.items() if old.get(k) != v}
            if section == "data" and changed:
                changed = {"init_args": {"batch_size": plan["micro_batch"]}}
            if changed:
                out[section] = changed
        return out

    def notes(self, plan: Plan) -> list[str]:
        return [f"memkit fit --config {self.config} --config this.yaml"]


def _model_facts(model_entry: dict[str, Any]) -> tuple[bool, str | None]:
    """Whether the config's model has a causal LM the ``FusedLinearCrossEntropy`` callback can patch (its
    ``find_causal_lms``), and the class name of the optimizer it configures (``None`` where it cannot say); the model
    built on fake tensors."""
    from lightning_memkit.common.class_paths import instantiate
    from lightning_memkit.estimate.step import configured_optimizer
    from lightning_memkit.estimate.trace import fake_tensors
    from lightning_memkit.hf.fused_loss import find_causal_lms

    with fake_tensors():
        model = instantiate(model_entry)
        try:
            optimizer = type(configured_optimizer(model)).__name__
        except Exception:  # noqa: BLE001 - only narrows the levers offered; the estimate reports the error itself
            optimizer = None
    try:
        return bool(find_causal_lms(model)), optimizer
    except (ValueError, ImportError):
        return False, optimizer


def _with_callbacks(callbacks: list[Any], planned: list[dict[str, Any]]) -> list[Any]:
    """The config's ``callbacks`` with the plan's: a callback of a lever the config has is replaced where it stands
    (its other settings kept), a new one appended, one the plan drops removed."""
    planned_by_name = {class_name(entry): entry for entry in planned}
    out = [_keep_settings(planned_by_name.pop(class_name(c)), c) if class_name(c) in planned_by_name else c
           for c in callbacks if class_name(c) not in _OWN or class_name(c) in planned_by_name]
    return out + list(planned_by_name.values())


def _keep_settings(entry: dict[str, Any], given: Any) -> Any:
    """A plan's callback ``entry`` with the settings of the config's own entry of that callback (``given``) kept:
    its other init args (``policy``, ``budget_bytes``...) stay as the config sets them, the plan's replace theirs."""
    if not isinstance(given, dict):
        return entry
    out = copy.deepcopy(given)
    args = {**(out.get("init_args") or {}), **entry.get("init_args", {})}
    if args:
        out["init_args"] = args
    return out
