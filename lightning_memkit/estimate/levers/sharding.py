"""The ``sharding`` lever: parameters, gradients and optimizer state sharded over the run's ranks with FSDP2
(``strategy="memkit_fsdp2"``: each decoder layer one unit, then the module), for a run on several devices.

Its choices, weakest first: ``None`` (each rank holds the whole model: DDP), ``"shard_grad_op"`` (each unit's gathered
parameters kept from its forward to its backward: one all-gather per micro-batch) and ``"full_shard"`` (freed after the
forward, gathered again in backward). A sharded plan's step is estimated for one rank on fake tensors under a fake
process group of the run's ranks (the gathered parameters, the all-gather and reduce-scatter buffers counted), and costs
the step time model its collectives: per micro-batch each all-gather brings ``(N - 1) / N`` of the parameters' bytes
and the reduce-scatter sends as much of the gradients', at the devices' collective bandwidth; on a GPU they overlap the
micro-batch's compute (FSDP2 prefetches), on a CPU they add to it.

    >>> from lightning_memkit.estimate.levers.sharding import SHARDING
    >>> class Run:
    ...     devices = 2
    ...     def allows(self, name): return True
    >>> SHARDING.options(None, Run()), SHARDING.words("full_shard", None)
    ([None, 'shard_grad_op', 'full_shard'], 'FSDP2 sharding over the ranks')
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from lightning_memkit.common.class_paths import class_name
from lightning_memkit.estimate.levers.base import Lever, StepCost, StepSpec, Written

__all__ = ["SHARDING", "Sharding", "shard_transform"]

STRATEGY = "lightning_memkit.strategies.MemkitFSDP2Strategy"
_CLASS = STRATEGY.rpartition(".")[2]
_STRENGTH = {None: 0, "shard_grad_op": 1, "full_shard": 2}


def shard_transform(model: Any, reshard_after_forward: bool = True, mesh: Any = None) -> Any:
    """The fake step's sharding: ``model``'s decoder layers (or repeated blocks), then ``model``, over ``mesh``
    (default: the mesh of the fake process group the step runs in), as ``memkit_fsdp2`` shards a module (a model
    transform for :class:`~lightning_memkit.estimate.step_spec.StepSpec`)."""
    from lightning_memkit.hf.layers import decoder_layers
    from lightning_memkit.recompute.activation_recompute import repeated_blocks
    from lightning_memkit.recompute.blocks import choose_blocks
    from lightning_memkit.sharding import current_mesh, shard_model

    blocks = choose_blocks(model, "auto", owner="sharding", verb="shard", finders=(decoder_layers, repeated_blocks))
    return shard_model(model, current_mesh() if mesh is None else mesh, blocks=[m for _, m in blocks],
                       reshard_after_forward=reshard_after_forward)


class Sharding(Lever):
    name, kind, keeps_math, default = "sharding", "work", True, None
    callback = None  # the strategy carries it

    def strength(self, choice: Any) -> int:
        return _STRENGTH[choice]

    def options(self, base: Any, run: Any) -> list[Any]:
        if not run.allows(self.name) or self.unavailable(run):
            return [base]
        return [c for c in _STRENGTH if _STRENGTH[c] >= _STRENGTH[base]]

    def unavailable(self, run: Any) -> str | None:
        if getattr(run, "kind", "") == "module":
            return ("a Trainer's strategy is set before its callbacks run: pass strategy='memkit_fsdp2' to shard "
                    "(memkit estimate --devices N --budget B plans it)")
        devices = getattr(run, "devices", 1)
        return None if devices > 1 else f"the run has {devices} device (--devices N shards over N)"

    def conflicts(self, plan: Any, run: Any) -> bool:
        """A sharded plan with a lever that does not run sharded (``runs_sharded``) is not tried."""
        return bool(plan[self.name]) and any(not x.runs_sharded and plan[x.name] != x.default for x in plan.levers())

    def words(self, choice: Any, base: Any) -> str:
        if choice is None:
            return "no sharding"
        kept = ", parameters kept gathered from forward to backward" if choice == "shard_grad_op" else ""
        return f"FSDP2 sharding over the ranks{kept}"

    def to_step(self, choice: Any, spec: StepSpec) -> None:
        if choice is None:
            return
        world = spec.world
        spec.world = dataclasses.replace(world, shard=world.shard * world.replicate, replicate=1)
        spec.transforms.append(functools.partial(shard_transform, reshard_after_forward=choice == "full_shard"))

    def scale_cost(self, choice: Any, base: Any, cost: StepCost, run: Any, est: Any = None,
                   machine: Any = None) -> StepCost:
        if not choice or est is None or machine is None:
            return cost
        ranks = getattr(run, "devices", 1)
        weights = est.phases[-1].weights * ranks  # the whole model's bytes (each rank holds 1/N in the step)
        size = 2 if getattr(est, "precision", "") in ("bf16-true", "16-true") else 4
        gathers = 2 if choice == "full_shard" else 1
        moved = (gathers * weights + getattr(est, "trainable_parameters", 0) * size) * (ranks - 1) / ranks
        seconds = moved / machine.collective_bandwidth
        overlapped = not machine.device.startswith("cpu")
        return cost.replace(micro=cost.micro + (max(seconds - cost.micro, 0.0) if overlapped else seconds))

    def write_hf(self, plan: Any, run: Any, out: Written) -> None:
        if plan[self.name]:
            out.trainer["devices"] = run.devices
            out.trainer["strategy"] = {"class_path": STRATEGY,
                                       "init_args": {"reshard_after_forward": plan[self.name] == "full_shard"}}

    write_config = write_hf

    def read_config(self, trainer: dict[str, Any]) -> Any:
        strategy = trainer.get("strategy")
        if strategy == "memkit_fsdp2":
            return "full_shard"
        if not isinstance(strategy, dict) or class_name(strategy) != _CLASS:
            return None
        return "full_shard" if (strategy.get("init_args") or {}).get("reshard_after_forward", True) else "shard_grad_op"

    def read_trainer(self, trainer: Any) -> Any:
        strategy = trainer.strategy
        if type(strategy).__name__ != _CLASS:
            return None
        return "full_shard" if strategy.reshard_after_forward else "shard_grad_op"


SHARDING = Sharding()
