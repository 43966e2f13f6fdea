"""What the planner plans on: a run (an HF config, a LightningCLI config, a module as built) as one typed
:class:`Run` protocol, and :class:`LeverRun`, the base the three kinds share (their plans: the product of every
lever's options; a plan's fake-step settings).

Example (a run of the simplest kind: what each lever may try)::

    >>> from lightning_memkit.estimate.levers import Plan
    >>> from lightning_memkit.estimate.runs import LeverRun
    >>> class Run(LeverRun):
    ...     allow = ("recompute",)
    ...     base = Plan(micro_batch=4)
    >>> [p["recompute"] for p in Run().axes()]
    [None, 'selective', 'full']
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any, Protocol, runtime_checkable

from lightning_memkit.estimate.levers import LEVERS, Plan, StepSpec, Written
from lightning_memkit.estimate.levers import lever as named_lever
from lightning_memkit.estimate.step_spec import World

__all__ = ["LeverRun", "Run", "check_allow"]

_DTYPES = {"bf16-true": "bfloat16", "bf16-mixed": "bfloat16", "16-true": "float16", "16-mixed": "float16"}


def check_allow(allow: Any, key: str = "allow") -> tuple[str, ...] | None:
    """``allow`` as a tuple of lever names (``None``: every lever but the opt-in ones); a name that is not a lever
    raises ``ConfigError`` naming the levers."""
    if allow is None:
        return None
    from lightning_memkit.common.errors import ConfigError

    names = [x.name for x in LEVERS]
    if isinstance(allow, str) or not all(isinstance(a, str) for a in allow):
        raise ConfigError(f"{key}: {allow!r} is not a list of lever names; levers: {', '.join(names)}")
    bad = [a for a in allow if a not in names]
    if bad:
        raise ConfigError(f"{key}: {', '.join(map(repr, bad))} not a lever; levers: {', '.join(names)}")
    return tuple(dict.fromkeys(allow))


@runtime_checkable
class Run(Protocol):
    """A run the planner can search: the plan as given, the plans to try, their estimates and their YAML."""

    base: Plan
    batch_size: int

    def allows(self, lever: str) -> bool: ...

    def axes(self) -> Iterator[Plan]: ...

    def pipelines(self) -> Iterator[Plan]: ...

    def estimate(self, plan: Plan) -> Any: ...

    def fragment(self, plan: Plan) -> dict[str, Any]: ...

    def notes(self, plan: Plan) -> list[str]: ...


class LeverRun:
    """The levers' side of a run. Subclasses set ``base``, ``batch_size``, ``allow`` (the levers a plan may pull:
    ``None``, all of them) and answer what the levers ask: ``precision_fixed`` (a plugin sets the dtype),
    ``has_causal_lm`` (a loss to fuse), ``splits_inside_step`` (micro-batches inside the training step)."""

    kind = "module"
    allow: tuple[str, ...] | None = None
    base: Plan
    batch_size = 0
    precision_fixed = False
    has_causal_lm = False
    splits_inside_step = False
    accumulate = 1
    devices = 1  # the devices the run trains on (data parallel: each a replica, or a shard with the sharding lever)
    optimizer_name: str | None = None  # the class name of the run's optimizer, where known
    refusals: dict[str, str] = {}  # lever name -> why the run refuses it (a Trainer's settings, read by MemoryBudget)

    def allows(self, lever: str) -> bool:
        """Whether a plan may pull ``lever``: named in ``allow``; ``allow=None``: every lever but the opt-in ones."""
        if self.allow is None:
            return not named_lever(lever).opt_in
        return lever in self.allow

    def axes(self) -> Iterator[Plan]:
        """Every combination of the levers' options (each lever's choice as given first) that no lever refuses."""
        names = [x.name for x in LEVERS]
        for values in itertools.product(*(x.options(self.base[x.name], self) for x in LEVERS)):
            plan = Plan(dict(zip(names, values, strict=True)))
            if plan == self.base or not any(x.conflicts(plan, self) for x in LEVERS):
                yield plan

    def off_levers(self) -> dict[str, str]:
        """The allowed levers this run cannot pull, each with why."""
        out = {}
        for x in LEVERS:
            why = x.unavailable(self) if self.allows(x.name) else None
            if why:
                out[x.name] = why
        return out

    def pipelines(self) -> Iterator[Plan]:
        return iter(())

    target = "cpu"  # the device the run trains on: "cpu" or "cuda"

    def machine(self) -> Any:
        """The balance the run's plans are ranked with
        (:func:`~lightning_memkit.measure.machine.planning_balance` of the device it trains on)."""
        from lightning_memkit.measure.machine import planning_balance

        return planning_balance(self.target)

    def compute_dtype(self, plan: Plan) -> str:
        """The dtype of the step's matmuls under ``plan`` (its precision's)."""
        return _DTYPES.get(plan["precision"], "float32")

    def new_step(self) -> StepSpec:
        """The fake step before any lever's choice: what the run itself says (its device, its batch's rows, its
        accumulation); a run kind adds its own (a plugin it holds, the blocks it recomputes, its LoRA rank)."""
        return StepSpec(target=self.target, rows=self.batch_size, world=World(replicate=self.devices),
                        zero_grad="accumulate" if self.accumulate > 1 else "after_forward")

    def step_spec(self, plan: Plan) -> StepSpec:
        """The fake step of ``plan``: :meth:`new_step`, then each lever's choice entered in the registry's order."""
        spec = self.new_step()
        for x in LEVERS:
            x.to_step(plan[x.name], spec)
        return spec

    def written(self, plan: Plan) -> Written:
        """``plan`` written as LightningCLI settings for this kind of run."""
        out = Written()
        for x in LEVERS:
            getattr(x, f"write_{self.kind}")(plan, self, out)
        return out

    def fragment(self, plan: Plan) -> dict[str, Any]:
        """``plan`` as a LightningCLI ``trainer`` fragment (the callbacks last)."""
        out = self.written(plan)
        trainer = dict(out.trainer)
        if out.callbacks:
            trainer["callbacks"] = out.callbacks
        return {"trainer": trainer}

    def notes(self, plan: Plan) -> list[str]:
        return []
