"""The estimate of a module as built: a fake copy of its parameters (no memory), its own ``training_step`` and
``configure_optimizers``, one real batch; and :class:`ModuleRun`, the plans :func:`search_plans` tries on it.

:class:`~lightning_memkit.callbacks.MemoryBudget` plans with this at ``setup``: the module is the one the user
built (weights already in memory), so it is not built again; :func:`fake_copy` copies its structure with every
parameter and buffer replaced by a fake tensor of the same shape, dtype and ``requires_grad``.

Example (a two-layer MLP whose ``training_step`` is the loss; plans for 70% of its predicted peak)::

    >>> import torch
    >>> from lightning_memkit.estimate.module import ModuleRun
    >>> from lightning_memkit.estimate.plans import search_plans
    >>> class MLP(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.blocks = torch.nn.ModuleList(torch.nn.Linear(256, 256) for _ in range(4))
    ...     def training_step(self, batch, batch_idx):
    ...         x = batch
    ...         for block in self.blocks:
    ...             x = torch.relu(block(x))
    ...         return x.square().mean()
    ...     def configure_optimizers(self):
    ...         return torch.optim.SGD(self.parameters(), lr=0.1)
    >>> run = ModuleRun(MLP(), torch.randn(2048, 256))
    >>> base = run.estimate(run.base)
    >>> result = search_plans(run, int(base.peak_bytes * 0.7), margin=0.0)
    >>> result.fitting[0].plan.describe(run.base)
    'micro-batch 1024 x 2 accumulation'
"""

from __future__ import annotations

import copy
import functools
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from lightning_memkit.common.batches import batch_rows, batch_tensors, chunk_rows, micro_batch
from lightning_memkit.estimate.levers import Plan
from lightning_memkit.estimate.runs import LeverRun
from lightning_memkit.estimate.step import (
    PRECISIONS,
    MemoryEstimate,
    configured_optimizer,
    estimate_training_memory,
    step_loss,
)
from lightning_memkit.estimate.step_spec import StepSpec

__all__ = ["AXES", "ModuleRun", "batch_rows", "batch_tensors", "fake_copy", "micro_batch"]

AXES = ("recompute", "offload_activations", "fused_loss", "micro_batch", "precision", "optimizer_in_backward",
        "offload_optimizer", "optimizer_8bit", "sharding", "tiled_mlp")
_OWNER = "ModuleRun"


def fake_copy(module: nn.Module, keep: Sequence[Any] = ()) -> nn.Module:
    """A copy of ``module`` whose parameters and buffers are new tensors of the same shapes, dtypes, devices and
    ``requires_grad`` (fake ones, made under the estimate's fake mode: no memory); every other attribute is
    deep-copied, except the objects in ``keep`` (e.g. the Trainer: shared, never copied) and a LightningModule's
    trainer reference, which the copy does not get (``self.log`` in its ``training_step`` then does nothing).

    A bitsandbytes packed weight (a model the QLoRA plugin converted) becomes a frozen fake parameter of the same
    packed bytes with its quant state (:mod:`~lightning_memkit.estimate.packed_copy`).

    Raises:
        TypeError: a parameter of another subclass (a ``DTensor``): its storage cannot be reproduced from its shape;
            estimate before sharding the module.
    """
    from lightning_memkit.estimate.packed_copy import packed_like

    memo: dict[int, Any] = {id(obj): obj for obj in keep}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in memo:
            continue
        if type(p) is not nn.Parameter and (packed := packed_like(p, _like, memo)) is not None:
            memo[id(p)] = packed
        elif type(p) is not nn.Parameter:
            raise TypeError(f"{_OWNER}: parameter {name!r} is a {type(p).__name__}, not a torch.nn.Parameter; "
                            "estimate the module before it is sharded")
        else:
            memo[id(p)] = nn.Parameter(_like(p), requires_grad=p.requires_grad)
    for b in module.buffers():
        memo.setdefault(id(b), _like(b))
    trainer = getattr(module, "_trainer", None)
    if trainer is not None:
        memo[id(trainer)] = None
    for m in module.modules():  # a device mesh (ModelParallelStrategy gives the module one) is shared, not copied
        for value in vars(m).values():
            if type(value).__name__ == "DeviceMesh":
                memo[id(value)] = value
    return copy.deepcopy(module, memo)


def _like(t: torch.Tensor) -> torch.Tensor:
    """A new tensor of ``t``'s shape, dtype and device from a factory: fake under the estimate's fake mode (an op
    on the real ``t``, such as ``empty_like``, would run for real there and allocate a real copy)."""
    return torch.empty(t.shape, dtype=t.dtype, device=t.device)


class ModuleRun(LeverRun):
    """A module as built, trained on batches like ``batch``, as :func:`search_plans` plans it.

    The axes a plan may change are ``allow``'s: ``"recompute"`` (none, selective or full activation
    checkpointing of the repeated blocks, ``policy``), ``"offload_activations"`` (what backward needs from them kept
    in host memory), ``"fused_loss"`` (when the module holds a transformers causal LM, peft-wrapped too),
    ``"micro_batch"`` (the batch split inside the step into micro-batches of at most a
    plan's ``micro_batch`` rows, their gradients accumulated: :class:`~lightning_memkit.callbacks.MicroBatchSplit`;
    needs rows, a common leading size of the batch's tensors, above 1) and ``"precision"`` (``bf16-true``: changes
    the numerics, opt-in), and the optimizer-state levers ``"optimizer_in_backward"``, ``"offload_optimizer"`` and
    ``"optimizer_8bit"`` (:mod:`~lightning_memkit.estimate.levers.optimizer_state`). The base plan is the run as
    configured (``precision``, ``checkpoint``, ``fused_loss``, ``micro_batch``, ``levers``).

    Args:
        module: the module (a LightningModule or any ``nn.Module`` with ``training_step`` and
            ``configure_optimizers``); never modified.
        batch: one training batch as the module's ``training_step`` receives it (real tensors; they count).
        micro_batch: the rows of the micro-batches the batch is already split into (``None``: not split).
        keep: objects the fake copy shares instead of copying (the Trainer, data).
        plugin: a precision plugin the Trainer applies (``NoSaveBitsandbytesPrecision``), estimated as applied.
        target: ``"cpu"`` or ``"cuda"`` (:func:`~lightning_memkit.estimate.step.estimate_training_memory`).
        levers: the choices the run already makes, lever by lever (``{"optimizer_in_backward": True}``; a Trainer's
            whole current plan, as ``MemoryBudget`` reads it from the levers); they override the arguments above.
        refusals: lever name -> why the run cannot pull it (the Trainer's settings; one line each).
        devices: the ranks the Trainer runs on; with the ``sharding`` lever's choice in ``levers`` (a Trainer under
            ``memkit_fsdp2``) the step estimated is one rank's, the module sharded over them.
    """

    def __init__(self, module: nn.Module, batch: Any, *, micro_batch: int | None = None, precision: str = "32-true",
                 checkpoint: str | None = None, policy: Any = "auto", fused_loss: bool = False,
                 accumulate: int = 1, allow: Sequence[str] = ("recompute", "fused_loss", "micro_batch"),
                 plugin: Any = None, target: str = "cpu", keep: Sequence[Any] = (),
                 levers: dict[str, Any] | None = None, refusals: dict[str, str] | None = None, devices: int = 1):
        bad = [a for a in allow if a not in AXES]
        if bad:
            raise ValueError(f"{_OWNER}(allow=...): {bad} not axes; allowed: {', '.join(AXES)}")
        given = {"precision": precision, "recompute": checkpoint, "fused_loss": fused_loss,
                 "micro_batch": micro_batch, **(levers or {})}
        precision, fused_loss = given["precision"], bool(given["fused_loss"])
        if precision not in PRECISIONS:
            raise ValueError(f"{_OWNER}(precision=...): {precision!r} is not estimated; allowed: "
                             f"{', '.join(PRECISIONS)}")
        for name in ("training_step", "configure_optimizers"):
            if not callable(getattr(module, name, None)):
                raise TypeError(f"{_OWNER}(module=...): {type(module).__name__} has no {name}()")
        if plugin is not None:
            from lightning_memkit.estimate.packed_copy import Converted, holds_packed

            plugin = Converted(plugin) if holds_packed(module) else plugin  # quantized already: estimated as it is
        self.module, self.batch, self.allow, self.plugin, self.target = module, batch, tuple(allow), plugin, target
        self.policy, self.accumulate, self.keep, self.devices = policy, accumulate, tuple(keep), devices
        self.batch_size = batch_rows(batch) or 0
        split = min(given["micro_batch"] or self.batch_size, self.batch_size)
        self.has_causal_lm = fused_loss or _has_causal_lm(module)
        self.precision_fixed = plugin is not None
        self.splits_inside_step = True
        self.refusals = dict(refusals or {})
        self.base = Plan({**given, "fused_loss": fused_loss, "micro_batch": split})

    def compute_dtype(self, plan: Plan) -> str:
        dtype = getattr(self.plugin, "dtype", None)
        return str(dtype).removeprefix("torch.") if dtype is not None else super().compute_dtype(plan)

    @functools.cached_property
    def optimizer_name(self) -> str | None:
        """The class name of the optimizer the module configures (on a fake copy), or ``None`` if it cannot say."""
        from lightning_memkit.estimate.trace import fake_tensors

        try:
            with fake_tensors(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return type(configured_optimizer(fake_copy(self.module, self.keep))).__name__
        except Exception:  # noqa: BLE001 - only narrows the levers offered; the estimate reports the error itself
            return None

    def new_step(self) -> StepSpec:
        step = super().new_step()
        step.policy = self.policy
        if self.plugin is not None:
            plugin = self.plugin
            step.plugin = lambda: plugin  # the Trainer's: estimated as it converts
        return step

    def estimate(self, plan: Plan) -> MemoryEstimate:
        """The predicted step of the module with ``plan`` applied."""
        step = self.step_spec(plan)
        split = step.rows < self.batch_size
        batch = micro_batch(self.batch, chunk_rows(self.batch_size, step.rows)[0][1]) if split else self.batch
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return estimate_training_memory(lambda: fake_copy(self.module, self.keep), lambda: batch,
                                            loss_fn=step_loss, optimizer=configured_optimizer, step=step,
                                            warmup="synthetic")


def _has_causal_lm(module: nn.Module) -> bool:
    from lightning_memkit.hf.fused_loss import find_causal_lms

    try:
        return bool(find_causal_lms(module))
    except (ValueError, ImportError):
        return False
