"""The levers a plan pulls, one module each (:mod:`~lightning_memkit.estimate.levers.base` says what a lever is;
:mod:`~lightning_memkit.estimate.levers.registry` lists them), and the :class:`Plan` that maps each to a choice."""

from lightning_memkit.estimate.levers.base import Lever, StepCost, StepSpec, TrainerEdit, Written, find_callback
from lightning_memkit.estimate.levers.plan import Plan
from lightning_memkit.estimate.levers.registry import LEVERS, lever

__all__ = ["LEVERS", "Lever", "Plan", "StepCost", "StepSpec", "TrainerEdit", "Written", "find_callback", "lever"]
