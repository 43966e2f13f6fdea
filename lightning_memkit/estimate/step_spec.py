"""The fake step a plan is estimated on, as one object: what the run seeds (its device, its plugin, its blocks, its
batch rows), what each lever adds (its patches, model transforms and optimizer wrappers) and the world the step runs
in (:class:`World`: pipeline stages, sharded and replicated data parallel, as torchtitan's ``ParallelDims``). It
travels whole from the plan (:meth:`~lightning_memkit.estimate.runs.LeverRun.step_spec`) to the tracer
(:func:`~lightning_memkit.estimate.step.estimate_training_memory` ``step=``); no run kind unpacks it.

Example (a bf16 step of one rank of two that shard the parameters)::

    >>> from lightning_memkit.estimate.step_spec import StepSpec, World
    >>> step = StepSpec(precision="bf16-true", world=World(shard=2))
    >>> step.world.devices, step.make_plugin(), step.checkpoint
    (2, None, (None, 'full'))
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["StepSpec", "World"]


@dataclass(frozen=True)
class World:
    """The devices one step runs on: ``pipeline`` stages x ``shard`` ranks sharing the parameters (FSDP2) x
    ``replicate`` copies (DDP). Each rank's peak is what a plan's estimate predicts.

    >>> World(pipeline=2, shard=4).devices
    8
    """

    pipeline: int = 1
    shard: int = 1
    replicate: int = 1

    def __post_init__(self) -> None:
        for name in ("pipeline", "shard", "replicate"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"World({name}=...) must be an int >= 1, got {value!r}")

    @property
    def devices(self) -> int:
        return self.pipeline * self.shard * self.replicate


@dataclass
class StepSpec:
    """How the fake step of a plan runs.

    Attributes:
        precision: Lightning's precision of the step (``"32-true"`` under a precision plugin).
        plugin: a zero-argument factory of the precision plugin that converts the model (a fresh one per model it
            converts), or ``None``.
        dtype: the dtype the run builds its model in (a checkpoint loaded in it), where the run's factory reads it
            (``None``: the precision's).
        lora_rank: the LoRA rank a quantization choice gives its adapters (the run's).
        recompute: ``None``, ``"selective"`` or ``"full"``; ``policy``: which blocks (``"auto"``: the repeated
            blocks; or a policy for :func:`~lightning_memkit.memory.select_modules`).
        fused_loss: whether the loss is fused with the head (its patch is in ``patches``).
        rows: the sequences of one forward (the micro-batch); ``zero_grad``: ``"after_forward"`` (Lightning's
            order), ``"before_forward"`` or ``"accumulate"`` (a micro-step of several: the gradients live through it).
        world: the devices the step runs on (:class:`World`).
        target: ``"cpu"`` or ``"cuda"``: the device kind it runs on.
        steps_in_backward: the optimizer steps each parameter in backward (read by the host-offload lever).
        patches: callables ``model -> context manager`` entered around the steps, in order.
        transforms: callables ``model -> model`` applied after the plugin's conversion, before the optimizer is made
            (sharding the parameters).
        optimizer: callables ``factory -> factory`` applied to the optimizer factory, in order.
    """

    precision: str = "32-true"
    plugin: Callable[[], Any] | None = None
    dtype: Any = None
    lora_rank: int = 16
    recompute: str | None = None
    policy: Any = "auto"
    fused_loss: bool = False
    rows: int = 0
    zero_grad: str = "after_forward"
    world: World = field(default_factory=World)
    target: str = "cpu"
    steps_in_backward: bool = False
    patches: list[Callable[[Any], Any]] = field(default_factory=list)
    transforms: list[Callable[[Any], Any]] = field(default_factory=list)
    optimizer: list[Callable[[Any], Any]] = field(default_factory=list)

    def make_plugin(self) -> Any:
        """A precision plugin for one model, or ``None``."""
        return None if self.plugin is None else self.plugin()

    @property
    def checkpoint(self) -> tuple[Any, str]:
        """``(policy, mode)`` as the tracer recomputes: ``(None, "full")`` when nothing is recomputed."""
        return (self.policy if self.recompute else None), self.recompute or "full"

    def wrap_optimizer(self, factory: Callable[[Any], Any], name: str) -> tuple[Callable[[Any], Any], str]:
        """``factory`` with the levers' wrappers applied, and its name (the outermost wrapper's)."""
        for wrap in self.optimizer:
            factory = wrap(factory)
            name = getattr(factory, "__name__", name)
        return factory, name
