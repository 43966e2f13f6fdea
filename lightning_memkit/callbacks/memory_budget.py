"""Tell it the memory you have: plan the cheapest features that fit, apply them, and check the first steps.

Example::

    from lightning import Trainer
    from lightning_memkit.callbacks import MemoryBudget

    trainer = Trainer(callbacks=[MemoryBudget("24GiB")])   # or bytes, or 0.9 (of the device's memory)
    trainer.fit(module, datamodule)

YAML (LightningCLI; ``memkit fit --budget 24GiB`` adds it)::

    trainer:
      callbacks:
        - class_path: lightning_memkit.callbacks.MemoryBudget
          init_args: {budget: 24GiB, allow: [recompute, fused_loss, micro_batch]}
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.parsing import lightning_getattr, lightning_hasattr, lightning_setattr

from lightning_memkit.common.validation import check_int
from lightning_memkit.measure.compiled import runs_compiled
from lightning_memkit.measure.live_peak import LivePeak, unmeasured
from lightning_memkit.measure.storage import format_bytes

__all__ = ["MemoryBudget", "check_budget"]

_OWNER = "MemoryBudget"
DEFAULT_ALLOW = ("recompute", "fused_loss", "micro_batch")
_BETWEEN_STEPS = ("recompute", "fused_loss")  # what a re-plan during the run may change


class MemoryBudget(Callback):
    """Make a ``fit`` hold within ``budget``: plan at ``setup``, apply the plan, check the first steps.

    At ``setup`` (before the model is converted, moved or trained) the module as built is estimated on fake
    tensors (:class:`~lightning_memkit.estimate.module.ModuleRun`: nothing allocated) with the first training
    batch of the data module (or the module's own ``train_dataloader``), with the precision, the precision plugin
    and the ``ActivationCheckpointing`` / ``FusedLinearCrossEntropy`` callbacks the Trainer already has. If it
    does not fit, :func:`~lightning_memkit.estimate.plans.search_plans` finds the plan with the least predicted
    step time whose peak plus ``margin`` fits, changing only the ``allow``-ed axes:

    - ``"recompute"``: activation checkpointing of the repeated blocks, selective or full (an existing
      ``ActivationCheckpointing`` keeps its policy and is made stronger, never weaker);
    - ``"fused_loss"``: ``FusedLinearCrossEntropy`` (a transformers causal LM, peft-wrapped too);
    - ``"micro_batch"``: the batch split into equal micro-batches with ``accumulate_grad_batches``, through
      Lightning's ``batch_size`` attribute convention (the module's or the data module's ``batch_size``, as
      ``BatchSizeFinder`` uses it); the same samples per optimizer step;
    - ``"precision"`` (opt-in: changes the numerics): ``bf16-true``.

    These (without ``"precision"``) train the same model: the losses per optimizer step match the run without the
    budget. One line per change and the predicted peak are printed. If nothing fits, ``setup`` raises
    ``ValueError`` with the smallest predicted peak and its plan, before any step.

    During the first ``check_steps`` optimizer steps the step peak is measured: on CPU with
    :class:`~lightning_memkit.measure.live_peak.LivePeak` (the weights, gradients, optimizer state and batch
    alive at the step's start included), on CUDA ``max_memory_reserved`` plus the CUDA context. Above the budget,
    the plan is searched again once with the estimate raised by the measured excess, changing only what can
    change between steps (recompute, fused loss); if that cannot fit, ``RuntimeError`` names the predicted and
    measured bytes. :meth:`memory_effect` gives the plan, predicted and measured peaks for the report.

    Args:
        budget: bytes (int), a size (``"24GiB"``, ``"80GB"``) or a fraction in ``(0, 1]`` of the training
            device's total memory (float).
        margin: a plan fits when its predicted peak times ``1 + margin`` is within the budget (the estimator's
            accuracy goal, 5%).
        allow: the axes a plan may change (above).
        check_steps: optimizer steps measured at the start of the run (0: none).
        max_estimates: the most estimates one search runs.

    Attributes:
        budget_bytes: the budget in bytes (after ``setup``).
        plan: the chosen :class:`~lightning_memkit.estimate.plans.PlanResult` (``None`` before ``setup``).
        changes: the changes applied, one line each.
        measured_peak_bytes: the highest measured step peak of the checked steps (``None`` before).
    """

    def __init__(self, budget: int | str | float, margin: float = 0.05, allow: Sequence[str] = DEFAULT_ALLOW,
                 check_steps: int = 2, max_estimates: int = 48) -> None:
        from lightning_memkit.estimate.module import AXES

        self.budget = check_budget(budget)
        if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin < 1:
            raise ValueError(f"{_OWNER}(margin=...) must be a number in [0, 1), got {margin!r}")
        if isinstance(allow, str) or not all(isinstance(a, str) for a in allow):
            raise TypeError(f"{_OWNER}(allow=...) must be a list of axis names, got {allow!r}")
        bad = [a for a in allow if a not in AXES]
        if bad:
            raise ValueError(f"{_OWNER}(allow=...): {', '.join(map(repr, bad))} not an axis; allowed: "
                             f"{', '.join(AXES)}")
        self.margin, self.allow = float(margin), tuple(dict.fromkeys(allow))
        self.check_steps = check_int(check_steps, "check_steps", minimum=0, owner=_OWNER)
        self.max_estimates = check_int(max_estimates, "max_estimates", minimum=1, owner=_OWNER)
        self.budget_bytes: int | None = None
        self.plan: Any = None
        self.changes: list[str] = []
        self.measured_peak_bytes: int | None = None
        self.replanned = False
        self._deferred = False
        self._samples: int | None = None
        self._context_bytes = 0
        self._live: LivePeak | None = None
        self._batches_left = 0

    # -- planning ----------------------------------------------------------------------------------
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self.changes, self.plan, self.measured_peak_bytes, self.replanned = [], None, None, False
        self.budget_bytes = self._resolve_budget(trainer)
        batch, self._samples = self._first_batch(trainer, pl_module)
        self._deferred = batch is None
        if batch is not None:
            self._plan(trainer, pl_module, batch, self.allow, late=False)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._deferred:  # dataloaders passed to fit: the first batch exists only now, the loader is built
            self._deferred = False
            batch = next(iter(trainer.train_dataloader))
            self._plan(trainer, pl_module, batch, [a for a in self.allow if a in _BETWEEN_STEPS], late=True)
        self._batches_left = self.check_steps * max(int(trainer.accumulate_grad_batches), 1)
        if self._batches_left and trainer.strategy.root_device.type == "cpu" and runs_compiled(pl_module):
            self._batches_left = 0
            rank_zero_warn(f"{_OWNER}: the model runs compiled code, whose CPU buffers LivePeak cannot see; the first "
                           "steps are not checked (the plan stands on the estimate)")

    def _plan(self, trainer: Trainer, pl_module: LightningModule, batch: Any, allow: Sequence[str], late: bool,
              excess: int = 0) -> None:
        from lightning_memkit.estimate.plans import search_plans

        run = self._run(trainer, pl_module, batch, allow)
        budget = self.budget_bytes - self._context_bytes - excess
        say = _say if trainer.is_global_zero else (lambda _line: None)
        with unmeasured():
            result = search_plans(run, max(budget, 1), margin=self.margin, max_plans=1,
                                  max_estimates=self.max_estimates, progress=lambda line: say(f"{_OWNER}: {line}"))
        if not result.fitting:
            raise self._nothing_fits(run, budget, excess)
        self.plan = result.fitting[0]
        self._apply(trainer, pl_module, run, late)
        say(f"{_OWNER}: predicted peak {format_bytes(self.plan.peak_bytes)} within the budget "
            f"{format_bytes(self.budget_bytes)} ({self.margin:.0%} margin)")

    def _run(self, trainer: Trainer, pl_module: LightningModule, batch: Any, allow: Sequence[str]) -> Any:
        from lightning_memkit.estimate.module import ModuleRun

        ac, fused = _find(trainer, "ActivationCheckpointing"), _find(trainer, "FusedLinearCrossEntropy")
        checkpoint = None if ac is None else ("selective" if ac.selective else "full")
        batch_size = _batch_size(pl_module) if "micro_batch" in allow else None
        if batch_size and (self._samples is None or self._samples % batch_size):
            # equal micro-batches keep the samples of every optimizer step only if no epoch ends in a partial batch
            # (a last window of fewer micro-batches would step with other samples, or scaled otherwise)
            _say(f"{_OWNER}: the micro-batch axis is off: the training set's size "
                 f"({'unknown' if self._samples is None else self._samples}) is not a known multiple of the batch "
                 f"size {batch_size}")
            batch_size = None
        plugin = trainer.precision_plugin if type(trainer.precision_plugin).__name__ == (
            "NoSaveBitsandbytesPrecision") else None
        return ModuleRun(pl_module, batch, batch_size=batch_size, precision=_precision(trainer),
                         checkpoint=checkpoint, policy="auto" if ac is None else ac.policy,
                         fused_loss=fused is not None, accumulate=int(trainer.accumulate_grad_batches),
                         allow=[a for a in allow if a != "micro_batch" or batch_size], plugin=plugin,
                         target=trainer.strategy.root_device.type, keep=(trainer,))

    def _nothing_fits(self, run: Any, budget: int, excess: int) -> ValueError:
        from lightning_memkit.estimate.plans import PlanResult

        strongest = max(run.axes(), key=lambda p: p.strength())
        with unmeasured():
            peak = run.estimate(strongest).peak_bytes
        best = PlanResult(strongest, peak, 0.0, False, run)
        measured = f" after a measured excess of {format_bytes(excess)}" if excess else ""
        return ValueError(
            f"{_OWNER}(budget={self.budget!r}): no plan fits {format_bytes(budget)}{measured} with "
            f"{self.margin:.0%} margin; the smallest predicted peak is {format_bytes(best.peak_bytes)} "
            f"({best.peak_bytes:,} B) with {strongest.describe(run.base)} (allowed: {', '.join(run.allow) or 'none'}). "
            "Raise the budget, allow more axes (e.g. 'precision'), or shorten the batch or the sequences")

    def _apply(self, trainer: Trainer, pl_module: LightningModule, run: Any, late: bool) -> None:
        """Make the Trainer run ``self.plan``; callbacks added late get the hooks that already ran."""
        plan, base = self.plan.plan, run.base
        added = []
        if plan.precision != base.precision:
            from lightning.pytorch.plugins.precision import HalfPrecision

            trainer.strategy.precision_plugin = HalfPrecision(plan.precision)
            self._change(f"precision {plan.precision}")
        if plan.checkpoint != base.checkpoint:
            added += self._recompute(trainer, pl_module, plan.checkpoint, late)
        if plan.fused_loss and not base.fused_loss:
            from lightning_memkit.callbacks.fused_linear_cross_entropy import FusedLinearCrossEntropy

            added.append(FusedLinearCrossEntropy())
            self._change("fused cross-entropy (FusedLinearCrossEntropy)")
        if plan.micro_batch != base.micro_batch:
            steps = base.micro_batch // plan.micro_batch
            lightning_setattr(pl_module, "batch_size", plan.micro_batch)
            trainer.accumulate_grad_batches = int(trainer.accumulate_grad_batches) * steps
            self._change(f"batch size {base.micro_batch} -> {plan.micro_batch}, accumulate_grad_batches "
                         f"x{steps} = {trainer.accumulate_grad_batches} (the same samples per optimizer step)")
        for callback in added:
            trainer.callbacks.append(callback)  # Lightning's hook loops reach callbacks appended during them
            if late:
                callback.setup(trainer, pl_module, "fit")
                callback.on_fit_start(trainer, pl_module)

    def _recompute(self, trainer: Trainer, pl_module: LightningModule, mode: str | None, late: bool) -> list[Any]:
        from lightning_memkit.callbacks.activation_checkpointing import ActivationCheckpointing

        ac = _find(trainer, "ActivationCheckpointing")
        self._change(f"{mode} activation checkpointing (ActivationCheckpointing"
                     f"{'' if ac is None else ', its policy kept'})")
        if ac is None:
            return [ActivationCheckpointing(selective=mode == "selective")]
        if late:
            ac.teardown(trainer, pl_module, "fit")
        ac.selective = mode == "selective"
        if late:
            ac.on_fit_start(trainer, pl_module)
        return []

    def _change(self, line: str) -> None:
        self.changes.append(line)
        _say(f"{_OWNER}: {line}")

    # -- the check during the run ------------------------------------------------------------------
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self._batches_left <= 0:
            return
        device = trainer.strategy.root_device
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            return
        if self._live is None:
            self._live = LivePeak().__enter__()
        self._live.track(_alive(pl_module, trainer, batch))
        self._live.reset_peak()

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._batches_left <= 0:
            return
        self._batches_left -= 1
        device = trainer.strategy.root_device
        if device.type == "cuda":
            measured = torch.cuda.max_memory_reserved(device) + self._context_bytes
        else:
            measured = self._live.peak_bytes
        self.measured_peak_bytes = max(self.measured_peak_bytes or 0, measured)
        if self._batches_left == 0:
            self._close()
        if measured > self.budget_bytes:
            self._over_budget(trainer, pl_module, batch, measured)

    def _over_budget(self, trainer: Trainer, pl_module: LightningModule, batch: Any, measured: int) -> None:
        predicted = self.plan.peak_bytes
        if self.replanned:
            self._close()
            raise RuntimeError(f"{_OWNER}: a step peaked at {format_bytes(measured)} ({measured:,} B), above the "
                               f"budget {format_bytes(self.budget_bytes)}, after re-planning once (predicted "
                               f"{format_bytes(predicted)}, {predicted:,} B); raise the budget or allow more axes")
        self.replanned = True
        _say(f"{_OWNER}: a step peaked at {format_bytes(measured)}, above the budget "
             f"{format_bytes(self.budget_bytes)} (predicted {format_bytes(predicted)}): planning again")
        try:
            self._plan(trainer, pl_module, batch, [a for a in self.allow if a in _BETWEEN_STEPS], late=True,
                       excess=max(measured - predicted, 0))
        except (ValueError, TypeError) as err:
            self._close()
            raise RuntimeError(f"{_OWNER}: a step peaked at {format_bytes(measured)} ({measured:,} B), above the "
                               f"budget {format_bytes(self.budget_bytes)} (predicted {format_bytes(predicted)}, "
                               f"{predicted:,} B), and re-planning between steps cannot fit: {err}") from err
        self._batches_left = max(self._batches_left, max(int(trainer.accumulate_grad_batches), 1))

    def _close(self) -> None:
        live, self._live = self._live, None
        if live is not None:
            live.__exit__(None, None, None)

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._close()

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._close()

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.is_global_zero and self.plan is not None:
            _say(self.memory_effect())

    def memory_effect(self) -> str:
        """One line: the budget, the plan, the predicted and measured peaks."""
        if self.plan is None:
            return f"{_OWNER}: no plan made (the fit did not reach setup)"
        measured = ("not measured" if self.measured_peak_bytes is None
                    else f"measured {format_bytes(self.measured_peak_bytes)} ({self.measured_peak_bytes:,} B)")
        return (f"{_OWNER}: budget {format_bytes(self.budget_bytes)} ({self.budget_bytes:,} B); plan: "
                f"{'; '.join(self.changes) or 'the run as given'}; predicted peak "
                f"{format_bytes(self.plan.peak_bytes)} ({self.plan.peak_bytes:,} B), {measured}"
                f"{' (re-planned once)' if self.replanned else ''}")

    # -- inputs ------------------------------------------------------------------------------------
    def _resolve_budget(self, trainer: Trainer) -> int:
        from lightning_memkit.measure.device import device_total_memory

        device = trainer.strategy.root_device
        if device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            self._context_bytes = max(total - free - torch.cuda.memory_reserved(device), 0)
        if isinstance(self.budget, float):
            total = device_total_memory(device)
            if total is None:
                raise ValueError(f"{_OWNER}(budget={self.budget}): the total memory of {device} is unknown; give "
                                 "the budget in bytes or as a size such as '24GiB'")
            return int(total * self.budget)
        return self.budget

    @staticmethod
    def _first_batch(trainer: Trainer, pl_module: LightningModule) -> tuple[Any, int | None]:
        """The first batch of the data module's (or the module's) training loader and the size of its data set
        (``None`` if unsized); ``(None, None)`` with loaders passed to ``fit`` (planned at ``on_train_start`` then,
        from the Trainer's loader, without the micro-batch axis)."""
        source = trainer.datamodule if trainer.datamodule is not None else pl_module
        if not is_overridden("train_dataloader", source):
            return None, None
        loader = source.train_dataloader()
        try:
            samples = len(loader.dataset)
        except (AttributeError, TypeError):
            samples = None
        return next(iter(loader)), samples


def check_budget(budget: Any) -> int | float:
    """``budget`` as bytes (int) or a fraction of the device's memory (float in ``(0, 1]``); a numeric string with a
    decimal point (``"0.9"``, as YAML or the command line may pass it) is a fraction.

    Example::

        >>> check_budget("24GiB"), check_budget(4096), check_budget("0.9")
        (25769803776, 4096, 0.9)
    """
    if isinstance(budget, bool):
        raise TypeError(f"{_OWNER}(budget=...) must be bytes, a size such as '24GiB' or a fraction, got {budget!r}")
    if isinstance(budget, str) and "." in budget:
        try:
            budget = float(budget)
        except ValueError:
            pass
    if isinstance(budget, float):
        if not 0 < budget <= 1:
            raise ValueError(f"{_OWNER}(budget={budget}): a float is a fraction of the device's memory, in (0, 1]")
        return budget
    if isinstance(budget, (int, str)):
        from lightning_memkit.estimate.plans import parse_bytes

        try:
            return parse_bytes(budget)
        except ValueError as err:
            raise ValueError(f"{_OWNER}(budget={budget!r}): not a positive size; write e.g. 24GiB, 80GB, 512MiB, "
                             "bytes, or a fraction such as 0.9") from err
    raise TypeError(f"{_OWNER}(budget=...) must be bytes, a size such as '24GiB' or a fraction, got "
                    f"{type(budget).__name__}")


def _say(line: str) -> None:
    rank_zero_info(line)


def _find(trainer: Trainer, name: str) -> Any:
    return next((c for c in trainer.callbacks if type(c).__name__ == name), None)


def _precision(trainer: Trainer) -> str:
    precision = str(trainer.precision)
    return {"32": "32-true", "bf16": "bf16-mixed", "16": "16-mixed"}.get(precision, precision)


def _batch_size(pl_module: LightningModule) -> int | None:
    if not lightning_hasattr(pl_module, "batch_size"):
        return None
    size = lightning_getattr(pl_module, "batch_size")
    return size if isinstance(size, int) and not isinstance(size, bool) and size > 1 else None


def _alive(pl_module: LightningModule, trainer: Trainer, batch: Any) -> Iterator[torch.Tensor]:
    """What a step starts with on the device: weights, buffers, gradients, optimizer state, the batch."""
    for p in pl_module.parameters():
        yield p
        if p.grad is not None:
            yield p.grad
    yield from pl_module.buffers()
    for optimizer in trainer.optimizers:
        for state in optimizer.state.values():
            yield from (v for v in state.values() if isinstance(v, torch.Tensor))
    from lightning_memkit.estimate.module import batch_tensors

    yield from batch_tensors(batch)
