"""What the three optimizer-state levers share (``optimizer_in_backward``, ``offload_optimizer``, ``optimizer_8bit``):
a choice on or off, carried by a callback that replaces the run's one optimizer, so at most one of them per plan (the
step in backward and the host offload go together as ``OffloadOptimizer(offload_gradients=True)``: each gradient
leaves the device as it is complete), and a wrapper of the optimizer factory in the fake step
(:mod:`lightning_memkit.optim`).

A lever is off for a run (:meth:`OptimizerStateLever.unavailable`, one line saying why) when the run's optimizer is
not one it can wrap, or when the run says so (``run.refusals``: what ``MemoryBudget`` reads from the Trainer, e.g.
gradient clipping); a plan that pulls one with another, or that needs a gradient buffer the lever frees, is not
tried (:meth:`OptimizerStateLever.conflicts`).

    >>> from lightning_memkit.estimate.levers.optimizer_in_backward import OPTIMIZER_IN_BACKWARD
    >>> OPTIMIZER_IN_BACKWARD.words(True, False), OPTIMIZER_IN_BACKWARD.entry()
    ('optimizer step in backward', {'class_path': 'lightning_memkit.callbacks.OptimizerInBackward'})
"""

from __future__ import annotations

from typing import Any

from lightning_memkit.estimate.levers.base import StepSpec
from lightning_memkit.estimate.levers.switch import SwitchLever

__all__ = ["OPTIMIZER_LEVERS", "OptimizerStateLever"]

OPTIMIZER_LEVERS = ("optimizer_in_backward", "offload_optimizer", "optimizer_8bit")
# the pairs one callback carries together: OffloadOptimizer(offload_gradients=True) steps on the host in backward
TOGETHER = frozenset({"optimizer_in_backward", "offload_optimizer"})


class OptimizerStateLever(SwitchLever):
    """Base of the optimizer-state levers. Subclasses set ``name``, ``kind``, ``keeps_math``, ``callback``, ``label``
    (plan words), ``accepts`` (optimizer class names it wraps, ``None``: torch's per-parameter ones) and define
    :meth:`wrap`."""

    accepts: tuple[str, ...] | None = None
    runs_sharded = False  # each wraps the optimizer over whole parameters; FSDP2's gradients skip its hooks
    # not planned with gradient accumulation (micro-batches included): the step in backward would step each one
    refuses_accumulation = False

    def unavailable(self, run: Any) -> str | None:
        """Why ``run`` cannot pull this lever, or ``None``."""
        refused = getattr(run, "refusals", {}).get(self.name)
        if refused:
            return refused
        name = getattr(run, "optimizer_name", None)
        if name is not None and not self.takes(name):
            return f"it wraps {', '.join(self.accepted())}, not {name}"
        if self.refuses_accumulation and getattr(run, "accumulate", 1) > 1:
            return f"accumulate_grad_batches={run.accumulate}: each backward would step the parameters at once"
        return None

    def accepted(self) -> tuple[str, ...]:
        """The optimizer classes it wraps, by name."""
        from lightning_memkit.optim.wrapper import SEPARABLE

        return self.accepts or tuple(c.__name__ for c in SEPARABLE)

    def takes(self, optimizer: str) -> bool:
        return optimizer.lower() in {n.lower() for n in self.accepted()}

    def conflicts(self, plan: Any, run: Any) -> bool:
        if not plan[self.name]:
            return False
        others = [n for n in OPTIMIZER_LEVERS if n != self.name and n in plan and plan[n]]
        if len(others) == 1 and {self.name, *others} == TOGETHER:
            others = []
        split = 0 < plan["micro_batch"] < run.batch_size
        return bool(others) or (self.refuses_accumulation and split)

    def wrap(self, factory: Any) -> Any:
        """The fake step's optimizer factory with the lever on."""
        raise NotImplementedError

    def to_step(self, choice: Any, spec: StepSpec) -> None:
        if choice:
            spec.optimizer.append(self.wrap)
