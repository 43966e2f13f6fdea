"""A plan: one choice per registered lever (a read-only mapping ``lever name -> choice``, hashable).

    >>> from lightning_memkit.estimate.levers.plan import Plan
    >>> base = Plan(precision="32-true", micro_batch=8)
    >>> plan = base.replace(recompute="full", micro_batch=2)
    >>> plan["recompute"], base.at_most(plan), plan.describe(base)
    ('full', True, 'full activation checkpointing, micro-batch 2 x 4 accumulation')
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any

from lightning_memkit.estimate.levers.registry import LEVERS

__all__ = ["Plan"]

_NAMES = tuple(x.name for x in LEVERS)
_RENAMED = {"plugin": "quantization", "checkpoint": "recompute"}  # the keys of plans saved before the levers


class Plan(Mapping[str, Any]):
    """One choice per lever of :data:`~lightning_memkit.estimate.levers.registry.LEVERS`; a lever not given takes its
    ``default`` (the run does not pull it)."""

    __slots__ = ("_values",)

    def __init__(self, choices: Mapping[str, Any] | None = None, /, **given: Any) -> None:
        given = {**(choices or {}), **given}
        unknown = [k for k in given if k not in _NAMES]
        if unknown:
            raise ValueError(f"Plan: {', '.join(map(repr, unknown))} not a lever; levers: {', '.join(_NAMES)}")
        self._values = tuple(given.get(x.name, x.default) for x in LEVERS)

    @classmethod
    def from_dict(cls, saved: Mapping[str, Any]) -> Plan:
        """A plan as :meth:`to_dict` wrote it (a checkpoint's), older key names read too."""
        return cls({_RENAMED.get(k, k): v for k, v in saved.items()})

    def to_dict(self) -> dict[str, Any]:
        return dict(zip(_NAMES, self._values, strict=True))

    def replace(self, **changes: Any) -> Plan:
        return Plan({**self.to_dict(), **changes})

    def __getitem__(self, name: str) -> Any:
        try:
            return self._values[_NAMES.index(name)]
        except ValueError:
            raise KeyError(name) from None

    def __iter__(self) -> Iterator[str]:
        return iter(_NAMES)

    def __len__(self) -> int:
        return len(_NAMES)

    def __hash__(self) -> int:
        return hash(self._values)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Plan) and self._values == other._values

    def __repr__(self) -> str:
        return f"Plan({', '.join(f'{k}={v!r}' for k, v in zip(_NAMES, self._values, strict=True))})"

    def levers(self) -> tuple[Any, ...]:
        """The registered levers, in the plan's order."""
        return LEVERS

    def strength(self) -> tuple[int, ...]:
        """Per lever, how much the choice lowers memory (larger: more)."""
        return tuple(x.strength(v) for x, v in zip(LEVERS, self._values, strict=True))

    def uses_host(self) -> bool:
        """Whether a lever's choice keeps bytes in host memory (``host_choices``)."""
        return any(v in x.host_choices for x, v in zip(LEVERS, self._values, strict=True))

    def devices(self) -> int:
        """The devices the plan's choices need (:meth:`~lightning_memkit.estimate.levers.base.Lever.devices`: the
        scale levers'; 1 when none adds a device)."""
        return math.prod(x.devices(v) for x, v in zip(LEVERS, self._values, strict=True))

    def at_most(self, other: Plan) -> bool:
        """Whether every lever of this plan lowers memory no more than ``other``'s does."""
        return all(a <= b for a, b in zip(self.strength(), other.strength(), strict=True))

    def describe(self, base: Plan) -> str:
        """What this plan changes from ``base``, in words."""
        words = [x.words(v, b) for x, v, b in zip(LEVERS, self._values, base._values, strict=True) if v != b]
        return ", ".join(w for w in words if w) or "the run as given"

    def changes(self, base: Plan) -> int:
        """How many levers this plan sets otherwise than ``base``."""
        return sum(v != b for v, b in zip(self._values, base._values, strict=True))

    def search_order(self, base: Plan) -> tuple[float, int]:
        """Least added work first; then the choices that lower memory without adding work, strongest first."""
        work, free = 0, 0
        for x, v, b in zip(LEVERS, self._values, base._values, strict=True):
            if x.kind == "work":
                work += x.work(v, b)
            elif x.kind == "free":
                free += x.strength(v)
        return work, -free

    def costlier(self, cheaper: Plan) -> bool:
        """Whether this plan only adds work to ``cheaper`` (every lever that adds no work the same): it then costs at
        least as much in the step time model."""
        same = all(v == c for x, v, c in zip(LEVERS, self._values, cheaper._values, strict=True) if x.kind != "work")
        return self != cheaper and cheaper.at_most(self) and same

    def costs_at_least(self, other: Plan) -> bool:
        """Whether the step time model prices this plan at least as high as ``other``: every lever adding work
        at least as strong, every lever that only reorders ops (``reorders_only``) at most as strong, the others
        the same."""
        def holds(x: Any, v: Any, o: Any) -> bool:
            if x.kind == "work":
                return x.strength(v) >= x.strength(o)
            return x.strength(v) <= x.strength(o) if x.reorders_only else v == o

        return all(holds(x, v, o) for x, v, o in zip(LEVERS, self._values, other._values, strict=True))

    def scale_cost(self, base: Plan, cost: Any, run: Any, est: Any = None, machine: Any = None) -> Any:
        """The step time model's cost of this plan from its fake step's ``cost`` (``est``, priced by ``machine``)."""
        for x, v, b in zip(LEVERS, self._values, base._values, strict=True):
            cost = x.scale_cost(v, b, cost, run, est, machine)
        return cost
