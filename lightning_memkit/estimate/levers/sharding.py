"""The ``sharding`` lever: parameters, gradients and optimizer state sharded over the run's ranks with FSDP2
(``strategy="memkit_fsdp2"``: each decoder layer one unit, then the module), for a run on several devices.

Its choices, weakest first: ``None`` (each rank holds the whole model: DDP), ``"shard_grad_op"`` (each unit's gathered
parameters kept from its forward to its backward: one all-gather per micro-batch), ``"full_shard"`` (freed after the
forward, gathered again in backward) and ``"full_shard_offload"`` (as ``full_shard``, with the shards, their gradients
and the optimizer's state and step in host memory: FSDP2's ``CPUOffloadPolicy``). A sharded plan's step is estimated
for one rank on fake tensors under a fake process group of the run's ranks (the gathered parameters, the all-gather and
reduce-scatter buffers counted; offloaded bytes as host memory,
:func:`~lightning_memkit.sharding.offload.offloaded_like_a_gpu_run`), and costs the step time model its collectives:
per micro-batch each all-gather brings ``(N - 1) / N`` of the parameters' bytes and the reduce-scatter sends as much of
the gradients', at the devices' collective bandwidth; on a GPU they overlap the micro-batch's compute (FSDP2
prefetches), on a CPU they add to it. Offloaded, each gather's shards cross the host link first and each gradient shard
back, and the optimizer steps at the host's memory bandwidth (seven passes over the trainable shards, as AdamW).

    >>> from lightning_memkit.estimate.levers.sharding import SHARDING
    >>> class Run:
    ...     devices = 2
    ...     def allows(self, name): return True
    >>> SHARDING.options(None, Run()), SHARDING.words("full_shard", None)
    ([None, 'shard_grad_op', 'full_shard', 'full_shard_offload'], 'FSDP2 sharding over the ranks')
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
_STRENGTH = {None: 0, "shard_grad_op": 1, "full_shard": 2, "full_shard_offload": 3}
_OFFLOAD = "full_shard_offload"


def shard_transform(model: Any, reshard_after_forward: bool = True, mesh: Any = None, offload: bool = False) -> Any:
    """The fake step's sharding: ``model``'s decoder layers (or repeated blocks), then ``model``, over ``mesh``
    (default: the mesh of the fake process group the step runs in), as ``memkit_fsdp2`` shards a module (a model
    transform for :class:`~lightning_memkit.estimate.step_spec.StepSpec`); ``offload``: FSDP2's CPU offload."""
    from lightning_memkit.hf.layers import decoder_layers
    from lightning_memkit.recompute.activation_recompute import repeated_blocks
    from lightning_memkit.recompute.blocks import choose_blocks
    from lightning_memkit.sharding import current_mesh, shard_model

    blocks = choose_blocks(model, "auto", owner="sharding", verb="shard", finders=(decoder_layers, repeated_blocks))
    return shard_model(model, current_mesh() if mesh is None else mesh, blocks=[m for _, m in blocks],
                       reshard_after_forward=reshard_after_forward, offload=offload)


class Sharding(Lever):
    name, kind, keeps_math, default = "sharding", "work", True, None
    callback = None  # the strategy carries it
    host_choices = (_OFFLOAD,)

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
        kept = {"shard_grad_op": ", parameters kept gathered from forward to backward",
                _OFFLOAD: ", shards, gradients and optimizer state in host memory"}.get(choice, "")
        return f"FSDP2 sharding over the ranks{kept}"

    def to_step(self, choice: Any, spec: StepSpec) -> None:
        if choice is None:
            return
        world = spec.world
        spec.world = dataclasses.replace(world, shard=world.shard * world.replicate, replicate=1)
        offload = choice == _OFFLOAD
        spec.transforms.append(functools.partial(shard_transform, reshard_after_forward=choice != "shard_grad_op",
                                                 offload=offload))
        if offload:
            from lightning_memkit.sharding.offload import offloaded_like_a_gpu_run, steps_on_host

            spec.patches.append(offloaded_like_a_gpu_run)
            spec.optimizer.append(steps_on_host)

    def scale_cost(self, choice: Any, base: Any, cost: StepCost, run: Any, est: Any = None,
                   machine: Any = None) -> StepCost:
        if not choice or est is None or machine is None:
            return cost
        ranks = getattr(run, "devices", 1)
        shard = getattr(est, "parameter_bytes", 0) or est.phases[-1].weights  # this rank's 1/N of the model
        size = 2 if getattr(est, "precision", "") in ("bf16-true", "16-true") else 4
        gathers = 1 if choice == "shard_grad_op" else 2
        grads = getattr(est, "trainable_parameters", 0) * size
        seconds = (gathers * shard * ranks + grads) * (ranks - 1) / ranks / machine.collective_bandwidth
        overlapped = not machine.device.startswith("cpu")
        cost = cost.replace(micro=cost.micro + (max(seconds - cost.micro, 0.0) if overlapped else seconds))
        if choice != _OFFLOAD:
            return cost
        # per micro-batch the gathers' shards go up the host link and the gradients' shards down; the host steps
        return cost.replace(link=cost.link + (gathers * shard + grads / ranks) / machine.link_bytes_per_s,
                            once=cost.once + 7 * grads / ranks / machine.host_bandwidth)

    def write_hf(self, plan: Any, run: Any, out: Written) -> None:
        if plan[self.name]:
            out.trainer["devices"] = run.devices
            args: dict[str, Any] = {"reshard_after_forward": plan[self.name] != "shard_grad_op"}
            if plan[self.name] == _OFFLOAD:
                args["offload"] = True
            out.trainer["strategy"] = {"class_path": STRATEGY, "init_args": args}

    write_config = write_hf

    def read_config(self, trainer: dict[str, Any]) -> Any:
        strategy = trainer.get("strategy")
        if strategy == "memkit_fsdp2":
            return "full_shard"
        if not isinstance(strategy, dict) or class_name(strategy) != _CLASS:
            return None
        args = strategy.get("init_args") or {}
        return _choice(args.get("reshard_after_forward", True), args.get("offload", False))

    def read_trainer(self, trainer: Any) -> Any:
        strategy = trainer.strategy
        if type(strategy).__name__ != _CLASS:
            return None
        return _choice(strategy.reshard_after_forward, strategy.offload)


def _choice(reshard_after_forward: bool, offload: bool) -> str:
    """The lever's choice for ``memkit_fsdp2``'s arguments."""
    if offload:
        return _OFFLOAD
    return "full_shard" if reshard_after_forward else "shard_grad_op"


SHARDING = Sharding()
