"""The ``offload_activations`` lever: what backward needs from the repeated blocks goes to host memory as it is made
and comes back ahead of its use (:class:`~lightning_memkit.callbacks.ActivationOffloading`; with recompute, each
checkpointed block's inputs); the same gradients, bitwise. Its bytes are counted as host memory, and its copies cost
the step time model twice the offloaded bytes over the host link, per micro-batch: in full on a CPU, where nothing
runs beside them, and only beyond the micro-batch's own time on a GPU, where they run on a side stream.

    >>> from lightning_memkit.estimate.levers.offload_activations import OFFLOAD_ACTIVATIONS
    >>> OFFLOAD_ACTIVATIONS.words(True, False), OFFLOAD_ACTIVATIONS.kind
    ('activation offload', 'work')
"""

from __future__ import annotations

from typing import Any

from lightning_memkit.estimate.levers.base import StepCost, StepSpec
from lightning_memkit.estimate.levers.switch import SwitchLever

__all__ = ["OFFLOAD_ACTIVATIONS", "OffloadActivations", "offload_patch"]


def offload_patch(model: Any) -> Any:
    """The fake step's activation offload: the blocks ``ActivationOffloading(policy="auto")`` picks, ``model`` as
    root (a patch for :func:`~lightning_memkit.estimate.step.estimate_training_memory`)."""
    from lightning_memkit.hf.layers import decoder_layers
    from lightning_memkit.offload.activations import offload_activations
    from lightning_memkit.recompute.activation_recompute import repeated_blocks
    from lightning_memkit.recompute.blocks import choose_blocks

    blocks = choose_blocks(model, "auto", owner="ActivationOffloading", verb="offload",
                           finders=(decoder_layers, repeated_blocks))
    return offload_activations(blocks, root=model)


class OffloadActivations(SwitchLever):
    name, kind, keeps_math = "offload_activations", "work", True
    callback = "lightning_memkit.callbacks.ActivationOffloading"
    wraps_module = True
    label, change_label = "activation offload", "activation offload to host memory"
    runs_sharded = False  # it would copy each unit's gathered weights, saved for backward, to host memory too
    host_choices = (True,)

    def scale_cost(self, choice: Any, base: Any, cost: StepCost, run: Any, est: Any = None,
                   machine: Any = None) -> StepCost:
        if not choice or est is None or machine is None:
            return cost
        moved = getattr(est, "host_bytes", 0) - getattr(est, "host_steady_bytes", 0)  # not an offloaded optimizer's
        copies = 2 * moved / machine.link_bytes_per_s
        overlapped = not machine.device.startswith("cpu")
        return cost.replace(micro=cost.micro + (max(copies - cost.micro, 0.0) if overlapped else copies))

    def to_step(self, choice: Any, spec: StepSpec) -> None:
        if choice:
            spec.patches.append(offload_patch)


OFFLOAD_ACTIVATIONS = OffloadActivations()
