"""Tell it the memory you have: plan the cheapest features that fit the longest batch, apply them, watch every step,
re-plan between steps and recover an out-of-memory step.

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

import contextlib
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.model_helpers import is_overridden

from lightning_memkit.common.batches import (
    batch_elements,
    batch_rows,
    batch_shape,
    batch_tensors,
    longest_batch,
    rng_untouched,
)
from lightning_memkit.common.class_paths import import_object
from lightning_memkit.common.preflight import run_preflights
from lightning_memkit.common.validation import check_int, check_number
from lightning_memkit.estimate.levers import LEVERS, Plan, TrainerEdit, find_callback, lever
from lightning_memkit.measure.compiled import runs_compiled
from lightning_memkit.measure.live_peak import LivePeak, unmeasured
from lightning_memkit.measure.storage import format_bytes

__all__ = ["MemoryBudget", "NoPlanFits", "Replan", "check_budget"]

_OWNER = "MemoryBudget"
DEFAULT_ALLOW = ("recompute", "offload_activations", "fused_loss", "micro_batch", "optimizer_in_backward",
                 "offload_optimizer")
_WARMUP_STEPS = 2  # optimizer steps measured on CPU whatever their batch (the optimizer state appears in the first)


@dataclass
class Replan:
    """One re-plan during the run: its step, batch, why, the current plan's predicted and the measured bytes (``None``
    after an out-of-memory error) and what changed."""

    step: int
    shape: str
    why: str
    predicted_bytes: int
    measured_bytes: int | None
    change: str

    def __str__(self) -> str:
        measured = "" if self.measured_bytes is None else (
            f", measured {format_bytes(self.measured_bytes)} ({self.measured_bytes:,} B)")
        return (f"step {self.step}, batch {self.shape}: {self.why}; predicted {format_bytes(self.predicted_bytes)} "
                f"({self.predicted_bytes:,} B){measured}; {self.change}")


class NoPlanFits(ValueError):
    """No plan the budget may choose fits: raised at ``setup``, or by a re-plan during the run."""


class MemoryBudget(Callback):
    """Make a ``fit`` hold within ``budget`` for the whole run: plan on the longest batch at ``setup``, apply the
    plan, watch every step, re-plan between steps, recover out-of-memory steps.

    **Plan.** At ``setup`` (before the model is converted, moved or trained) the module as built is estimated on
    fake tensors (:class:`~lightning_memkit.estimate.module.ModuleRun`: nothing allocated) with the largest batch
    the run will see: the one its data module (or the module) declares with a ``longest_batch()`` method; else the
    ``batch_size`` longest samples of a sized training set, collated by the loader (a scan of at most
    ``scan_seconds``; padded batches at their padded length); else the first batch (one line says so). Nothing
    of this draws from the global random states. The precision, the precision plugin and the
    ``ActivationCheckpointing`` / ``FusedLinearCrossEntropy`` / ``MicroBatchSplit`` callbacks the Trainer already
    has are part of the run as given. If the run as given fits, nothing changes; else
    :func:`~lightning_memkit.estimate.plans.search_plans` finds the plan with the least predicted step time whose
    peak plus ``margin`` fits, changing only the ``allow``-ed axes:

    - ``"recompute"``: activation checkpointing of the repeated blocks, selective or full (an existing
      ``ActivationCheckpointing`` keeps its policy and is made stronger, never weaker);
    - ``"fused_loss"``: ``FusedLinearCrossEntropy`` (a transformers causal LM, peft-wrapped too);
    - ``"micro_batch"``: each batch split inside the training step into micro-batches of at most so many rows, their
      gradients accumulated (:class:`~lightning_memkit.callbacks.MicroBatchSplit`): the loader, the validation
      batches and ``accumulate_grad_batches`` are unchanged;
    - ``"precision"`` (opt-in: changes the numerics): ``bf16-true``.

    These (without ``"precision"``) train the same model on the same samples: the losses per optimizer step match
    the run without the budget. One line per change and the predicted peak are printed. If nothing fits,
    ``setup`` raises :class:`NoPlanFits` (a ``ValueError``) with the smallest predicted peak and its plan.

    **Pipelines.** Under ``memkit_pipeline`` the plan is per rank: the strategy predicts every rank's peak (its
    measured split, the schedule's in-flight microbatches) for the run as given, the fused loss, then twice the
    microbatches, and the first whose busiest rank fits runs (:mod:`~lightning_memkit.callbacks.budget_pipeline`).

    **Watch.** On CUDA every step's peak is read (``max_memory_reserved`` after a reset, plus the memory outside
    torch's allocator at ``setup``); on CPU a step is measured with
    :class:`~lightning_memkit.measure.live_peak.LivePeak` during the first two optimizer steps (while the optimizer
    state appears) and whenever its batch is larger than every batch measured so far. A step above the predicted
    peak by more than ``margin`` re-plans between steps, from the model's
    current state, with the bytes the estimate missed counted, changing what can change between steps
    (recompute, fused loss, micro-batches); if nothing fits, ``RuntimeError``. **Recover.** An out-of-memory
    error in a step re-plans to a plan that predicts at most three quarters of the failing one and runs the
    accumulation window again (:class:`~lightning_memkit.callbacks.MicroBatchSplit`), at most ``max_retries``
    times a fit. :meth:`memory_effect` gives the plan, the peaks and every re-plan.

    Args:
        budget: bytes (int), a size (``"24GiB"``, ``"80GB"``) or a fraction in ``(0, 1]`` of the training
            device's total memory (float).
        margin: a plan fits when its predicted peak times ``1 + margin`` is within the budget (the estimator's
            accuracy goal, 5%).
        allow: the axes a plan may change (above).
        max_estimates: the most estimates one search runs.
        max_retries: out-of-memory steps recovered per fit (0: an out-of-memory error stops the run).
        scan_seconds: the longest the scan of the training set's sample lengths may take.
        machine: the device balance the plans are ranked with: a preset (``"h100"``), a JSON object of
            :class:`~lightning_memkit.measure.machine.MachineBalance`'s fields or the path of a file holding one
            (``None``: ``MEMKIT_MACHINE`` when set, else the training device's probe). Pinned, the same run and
            budget choose the same plan on any machine.

    Attributes:
        budget_bytes: the budget in bytes (after ``setup``).
        plan: the chosen :class:`~lightning_memkit.estimate.plans.PlanResult` (``None`` before ``setup``).
        planned_on: the batch the plan was made for, in words.
        ranked_on: the device balance the plans were ranked with (its name; empty where nothing was ranked: the run
            as given fits, or ``memkit_pipeline``).
        changes: the changes applied, one line each.
        replans: every :class:`Replan` during the run.
        measured_peak_bytes: the highest measured step peak (``None`` before a step was measured).
    """

    def __init__(self, budget: int | str | float, margin: float = 0.05, allow: Sequence[str] = DEFAULT_ALLOW,
                 max_estimates: int = 48, max_retries: int = 2, scan_seconds: float = 30.0,
                 machine: Any = None) -> None:
        from lightning_memkit.estimate.module import AXES
        from lightning_memkit.measure.machine import machine_balance

        self.budget = check_budget(budget)
        self._given = budget  # as written (the refusals name it)
        if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin < 1:
            raise ValueError(f"{_OWNER}(margin=...) must be a number in [0, 1), got {margin!r}")
        if isinstance(allow, str) or not all(isinstance(a, str) for a in allow):
            raise TypeError(f"{_OWNER}(allow=...) must be a list of axis names, got {allow!r}")
        bad = [a for a in allow if a not in AXES]
        if bad:
            raise ValueError(f"{_OWNER}(allow=...): {', '.join(map(repr, bad))} not an axis; allowed: "
                             f"{', '.join(AXES)}")
        self.margin, self.allow = float(margin), tuple(dict.fromkeys(allow))
        self.max_estimates = check_int(max_estimates, "max_estimates", minimum=1, owner=_OWNER)
        self.max_retries = check_int(max_retries, "max_retries", minimum=0, owner=_OWNER)
        self.scan_seconds = check_number(scan_seconds, "scan_seconds", minimum=0, owner=_OWNER)
        self.machine = None if machine is None else machine_balance(machine, "machine", _OWNER)
        self.budget_bytes: int | None = None
        self.plan: Any = None
        self.planned_on = ""
        self.ranked_on = ""  # the balance the last search ranked its plans with (its name; "": none ranked)
        self.changes: list[str] = []
        self.replans: list[Replan] = []
        self.measured_peak_bytes: int | None = None
        self._missed = 0  # bytes the estimate missed, as measured (counted by every later plan)
        self._context_bytes = 0
        self._split: Any = None
        self._live: LivePeak | None = None
        self._largest = -1  # elements of the largest batch measured (CPU)
        self._watching = False
        self._cpu_watch = True
        self._pipeline = False  # the Trainer runs memkit_pipeline: planned per rank, not re-planned
        self._sharded = False  # the Trainer shards the module (memkit_fsdp2): planned at setup only
        self._batch: Any = None  # the batch planned on
        self._restored: dict | None = None  # the plan of the checkpoint resumed from, applied at on_train_start
        self._recovered: dict | None = None  # the plan an out-of-memory recovery made in this step (to agree on)
        #: the checkpoint this fit resumes from, when known before ``setup`` (``memkit fit --ckpt_path`` sets it): its
        #: plan is estimated once and kept where it fits, instead of a search
        self.resume_from: str | None = None
        #: the tokens per row chosen for a data module that leaves its length open (``max_length="auto"``)
        self.max_length: int | None = None
        self._open_data: Any = None  # that data module
        self._length_resumed = False  # its length set back to the checkpoint's after setup: planned again

    @property
    def replanned(self) -> bool:
        """Whether the plan changed during the run."""
        return bool(self.replans)

    # -- planning ----------------------------------------------------------------------------------
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        run_preflights(trainer, pl_module)  # the callbacks' refusals (this one's, ExportAdapters') before planning
        self.changes, self.plan, self.measured_peak_bytes, self.replans = [], None, None, []
        self._missed, self._largest = 0, -1
        self.budget_bytes = self._resolve_budget(trainer)
        self._pipeline = _is_pipeline(trainer)
        self._sharded = lever("sharding").read_trainer(trainer) is not None
        if self._sharded:
            _say(f"{_OWNER}: under {type(trainer.strategy).__name__} the plan is made once, here, for one rank of "
                 f"{trainer.world_size}: re-planning between steps and out-of-memory recovery are off (a sharded "
                 "module cannot be copied for an estimate)")
        if self._pipeline:
            self._plan_pipeline(trainer)
            return
        self._split = self._own_split(trainer)
        self._choose_length(trainer, pl_module)
        with rng_untouched(trainer.strategy.root_device):
            batch = self._planning_batch(trainer, pl_module)
        if batch is not None and not self._plan_of_checkpoint(trainer, pl_module, batch):
            self._plan(trainer, pl_module, batch, self.allow, late=False)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._pipeline:  # on CPU every rank holds the whole model: its live bytes are not the rank's
            self._cpu_watch = False
            return
        if self.plan is None or self._length_resumed:  # loaders passed to fit, or the checkpoint's length
            with rng_untouched(trainer.strategy.root_device):
                batch = (trainer.datamodule.longest_batch() if self._length_resumed
                         else self._from_loader(trainer.train_dataloader))
            self._length_resumed = False
            with self._features_off(trainer, pl_module):
                self._plan(trainer, pl_module, batch, _between_steps(self.allow), late=True)
        self._resume_plan(trainer, pl_module)
        self._cpu_watch = not runs_compiled(pl_module)
        if not self._cpu_watch and trainer.strategy.root_device.type == "cpu":
            rank_zero_warn(f"{_OWNER}: the model runs compiled code, whose CPU buffers LivePeak cannot see; steps are "
                           "not measured (the plan stands on the estimate; out-of-memory steps are still recovered)")

    def _choose_length(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """A data module whose length is open (``max_length="auto"``): cut to the longest its budget fits
        (:mod:`~lightning_memkit.callbacks.budget_length`), the checkpoint's length on a resume."""
        from lightning_memkit.callbacks.budget_length import choose_length

        def saved() -> int | None:  # the checkpoint is read only where the data module's length is open
            return _saved_state(self.resume_from or trainer.ckpt_path, self.state_key).get("max_length")

        def run(batch: Any) -> Any:
            return self._run(trainer, pl_module, batch, self.allow, quiet=True)

        with unmeasured(), rng_untouched(trainer.strategy.root_device):
            found = choose_length(trainer, pl_module, run, self.budget_bytes - self._context_bytes, self.margin, saved,
                                  _say, _OWNER)
        self.max_length, self._open_data = found, trainer.datamodule if found else None

    def _own_split(self, trainer: Trainer) -> Any:
        """The Trainer's ``MicroBatchSplit`` (one is added if it has none), set to recover with this budget."""
        from lightning_memkit.callbacks.micro_batch_split import MicroBatchSplit

        split = find_callback(trainer, lever("micro_batch").callback)
        if split is None:
            split = MicroBatchSplit()
            trainer.callbacks.append(split)  # Lightning's hook loops reach callbacks appended during them
        split.max_retries = self.max_retries
        split.on_out_of_memory = lambda event: self._on_out_of_memory(trainer, event)
        return split

    def _planning_batch(self, trainer: Trainer, pl_module: LightningModule) -> Any:
        """The largest batch the run will see (module doc); ``None`` with loaders passed to ``fit`` (planned at
        ``on_train_start`` then)."""
        source = trainer.datamodule if trainer.datamodule is not None else pl_module
        declared = getattr(source, "longest_batch", None)
        if callable(declared):
            self.planned_on = f"the batch {type(source).__name__}.longest_batch() declares"
            _say(f"{_OWNER}: planning on {self.planned_on}")
            return declared()
        if not is_overridden("train_dataloader", source):
            return None
        return self._from_loader(source.train_dataloader())

    def _from_loader(self, loader: Any) -> Any:
        found = longest_batch(loader, self.scan_seconds, progress=lambda line: _say(f"{_OWNER}: {line}"))
        if found is not None:
            batch, self.planned_on = found
        else:
            batch = next(iter(loader))
            self.planned_on = ("the first batch (the training set is not a sized, indexable data set loaded in batches "
                               "of a fixed size whose samples, or collated samples, have a length, so its longest "
                               "batch is not known); every step is watched")
        _say(f"{_OWNER}: planning on {self.planned_on}")
        return batch

    def _plan(self, trainer: Trainer, pl_module: LightningModule, batch: Any, allow: Sequence[str],
              late: bool) -> None:
        self._batch = batch
        run = self._run(trainer, pl_module, batch, allow)
        budget = self.budget_bytes - self._context_bytes
        src = _planning_rank(trainer, batch)
        result = self._search(trainer, run, budget, loud=True) if trainer.global_rank == src else None
        chosen = self._agreed(trainer, run, result, src)
        if chosen is None:
            raise self._nothing_fits(run, max(budget, 1))
        self.plan = chosen
        self._apply(trainer, pl_module, run, late)
        if trainer.global_rank == src:
            _say(f"{_OWNER}: predicted peak {format_bytes(self.plan.peak_bytes)} within the budget "
                 f"{format_bytes(self.budget_bytes)} ({self.margin:.0%} margin)"
                 + (f", planned by rank {src} for all {trainer.world_size} ranks" if trainer.world_size > 1 else ""))

    def _agreed(self, trainer: Trainer, run: Any, result: Any, src: int) -> Any:
        """The plan of rank ``src``'s ``result`` (a run that fits as given: unchanged; ``None``: nothing fits), the
        same on every rank: sent by ``src`` in one broadcast, estimated by each other rank on its own batch."""

        mine = None
        if result is not None:
            mine = result.base if result.base.fits else (result.fitting[0] if result.fitting else None)
        if trainer.world_size == 1:
            return mine
        sent = None if result is None else (None if mine is None else mine.plan.to_dict(), self.ranked_on)
        chosen, self.ranked_on = trainer.strategy.broadcast(sent, src=src)
        if chosen is None:  # nothing fits on the planning rank: nothing fits anywhere
            return None
        if mine is not None:
            return mine
        return _estimated(run, Plan.from_dict(chosen))

    # -- resuming ----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The plan the run trains with (re-plans included) and the bytes the estimate missed, for a resume."""
        length = {"max_length": self.max_length} if self.max_length else {}
        if self.plan is None or self._pipeline:
            return length
        return {"plan": self.plan.plan.to_dict(), "missed_bytes": int(self._missed), **length}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        length = state_dict.get("max_length")
        if self._open_data is not None and length and length != self.max_length:  # cut as the run was: its data
            self._open_data.set_max_length(int(length))  # (the loader's position), planned again at train start
            self.max_length, self._length_resumed = int(length), True
            _say(f"{_OWNER}: max_length='auto': {int(length):,} tokens per row, as the checkpoint's run chose")
        self._restored = state_dict.get("plan")
        self._missed = max(self._missed, int(state_dict.get("missed_bytes", 0)))

    def _plan_of_checkpoint(self, trainer: Trainer, pl_module: LightningModule, batch: Any) -> bool:
        """A resume whose checkpoint is known at ``setup`` (:attr:`resume_from`, which ``memkit fit --ckpt_path``
        sets, or ``trainer.ckpt_path``): the checkpoint's plan, estimated once, when it still fits (no search).
        Under several processes the planning rank decides for all."""
        saved = _saved_state(self.resume_from or trainer.ckpt_path, self.state_key)
        if not saved.get("plan"):
            return False
        plan, self._missed = Plan.from_dict(saved["plan"]), int(saved.get("missed_bytes", 0))
        src = _planning_rank(trainer, batch)
        run = self._run(trainer, pl_module, batch, self.allow)
        result = _estimated(run, plan)
        limit = self.budget_bytes - self._context_bytes - self._missed
        fits = result.peak_bytes * (1 + self.margin) <= limit
        if trainer.world_size > 1:
            fits = trainer.strategy.broadcast(fits, src=src)
        if not fits:
            _say(f"{_OWNER}: the checkpoint's plan ({plan.describe(run.base)}) predicts "
                 f"{format_bytes(result.peak_bytes)}, over the budget now: planning again")
            return False
        self._batch, self._restored, self.plan = batch, None, result
        self._apply(trainer, pl_module, run, late=False)
        _say(f"{_OWNER}: resumed with the checkpoint's plan, estimated once: predicted peak "
             f"{format_bytes(result.peak_bytes)} within the budget {format_bytes(self.budget_bytes)}")
        return True

    def _resume_plan(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Resume with the plan of the checkpoint where a re-plan made it stronger than the one planned at setup,
        instead of running into the same steps' memory again."""
        from lightning_memkit.estimate.plans import PlanResult

        restored, self._restored = self._restored, None
        if restored is None or self.plan is None or self._batch is None:
            return
        plan = Plan.from_dict(restored)
        if plan == self.plan.plan:
            return
        if not self.plan.plan.at_most(plan):
            rank_zero_warn(f"{_OWNER}: the checkpoint was trained with a weaker plan ({plan}) than the one planned "
                           "now; the plan planned now is kept")
            return
        allow = _between_steps(self.allow)
        before = len(self.changes)
        with self._features_off(trainer, pl_module), unmeasured():
            run = self._run(trainer, pl_module, self._batch, allow)
            peak = run.estimate(plan).peak_bytes
            self.plan = PlanResult(plan, peak, 0.0, peak <= self.budget_bytes, run)
            self._apply(trainer, pl_module, run, late=True)
        _say(f"{_OWNER}: resumed with the checkpoint's plan: {'; '.join(self.changes[before:])}")

    def _plan_pipeline(self, trainer: Trainer) -> None:
        """Per rank under memkit_pipeline: its microbatches and fused loss such that the busiest rank's predicted
        peak fits (:mod:`~lightning_memkit.callbacks.budget_pipeline`); the split is the strategy's."""
        from lightning_memkit.callbacks.budget_pipeline import plan_pipeline

        limit = int((self.budget_bytes - self._context_bytes) / (1 + self.margin))
        say = _say if trainer.is_global_zero else (lambda _line: None)
        self.planned_on = "one batch of the training loader, each layer measured on one microbatch (memkit_pipeline)"
        plan, changes, best = plan_pipeline(trainer, limit, self.allow, say)
        if plan is None:
            raise NoPlanFits(
                f"{_OWNER}(budget={self.budget!r}): no memkit_pipeline plan fits {format_bytes(limit)} per rank with "
                f"{self.margin:.0%} margin; the smallest busiest-rank peak is {format_bytes(best.busiest_bytes)} "
                f"({best.busiest_bytes:,} B) with {best.describe()} (allowed: {', '.join(self.allow) or 'none'}). "
                "Raise the budget, add ranks, or shorten the batch or the sequences")
        trainer.strategy.use_plan(plan.partition, plan.fused_loss)
        self.plan = plan
        for line in changes:
            self._change(line)
        say(f"{_OWNER}: predicted peak of the busiest rank {format_bytes(plan.busiest_bytes)} within the budget "
            f"{format_bytes(self.budget_bytes)} per rank ({self.margin:.0%} margin)")

    def _search(self, trainer: Trainer, run: Any, budget: int, loud: bool | None = None) -> Any:
        from lightning_memkit.estimate.plans import search_plans

        say = _say if (trainer.is_global_zero if loud is None else loud) else (lambda _line: None)
        with unmeasured():
            result = search_plans(run, max(budget, 1), margin=self.margin, max_plans=1, machine=self.machine,
                                  keep_base=True,
                                  max_estimates=self.max_estimates, progress=lambda line: say(f"{_OWNER}: {line}"))
        self.ranked_on = result.machine or self.ranked_on  # a search that ranked nothing keeps the last one's
        return result

    def _run(self, trainer: Trainer, pl_module: LightningModule, batch: Any, allow: Sequence[str],
             quiet: bool = False) -> Any:
        from lightning_memkit.estimate.module import ModuleRun

        say = (lambda _line: None) if quiet else _say
        ac = find_callback(trainer, lever("recompute").callback)
        if "micro_batch" in allow and (why := _no_split(pl_module, batch)):
            say(f"{_OWNER}: the micro-batch axis is off: {why}")
            allow = [a for a in allow if a != "micro_batch"]
        plugin = trainer.precision_plugin
        plugin = plugin if isinstance(plugin, import_object(lever("quantization").plugin)) else None
        current = {x.name: x.read_trainer(trainer) for x in LEVERS}  # the plan the Trainer runs now
        run = ModuleRun(pl_module, batch, levers=current, policy="auto" if ac is None else ac.policy,
                         accumulate=int(trainer.accumulate_grad_batches), allow=allow, plugin=plugin,
                         target=trainer.strategy.root_device.type, keep=(trainer,), devices=trainer.world_size,
                         refusals=_refusals(trainer, pl_module, allow))
        for name, why in run.off_levers().items():
            say(f"{_OWNER}: the {name} lever is off: {why}")
        return run

    def _nothing_fits(self, run: Any, budget: int) -> NoPlanFits:
        strongest = _strongest(run)
        with unmeasured():
            peak = run.estimate(strongest).peak_bytes
        missed = f" after {format_bytes(self._missed)} the estimate missed" if self._missed else ""
        return NoPlanFits(
            f"{_OWNER}(budget={self.budget!r}): no plan fits {format_bytes(budget)}{missed} with "
            f"{self.margin:.0%} margin; the smallest predicted peak is {format_bytes(peak)} ({peak:,} B) with "
            f"{strongest.describe(run.base)} (allowed: {', '.join(run.allow) or 'none'}). "
            "Raise the budget, allow more axes (e.g. 'precision'), or shorten the batch or the sequences")

    def _apply(self, trainer: Trainer, pl_module: LightningModule, run: Any, late: bool) -> None:
        """Make the Trainer run ``self.plan``, lever by lever; callbacks added late get the hooks that already ran."""
        plan, base = self.plan.plan, run.base
        edit = TrainerEdit(trainer, run, self._split, lambda line: _say(f"{_OWNER}: {line}"), plan)
        for x in LEVERS:
            if plan[x.name] != base[x.name]:
                x.apply(plan[x.name], base[x.name], edit)
        self.changes += edit.changes
        for callback in edit.added:
            trainer.callbacks.append(callback)  # Lightning's hook loops reach callbacks appended during them
            if late:
                callback.setup(trainer, pl_module, "fit")

    def _change(self, line: str) -> None:
        self.changes.append(line)
        _say(f"{_OWNER}: {line}")

    # -- re-planning between steps -----------------------------------------------------------------
    @contextlib.contextmanager
    def _features_off(self, trainer: Trainer, pl_module: LightningModule) -> Iterator[None]:
        """The module as built for the block (the features' wrappers and hooks off, to copy it on fake tensors),
        then every feature on the Trainer applied again, as set now."""
        features = [c for c in trainer.callbacks if isinstance(c, _module_wrappers())]
        with self._split.suspended():
            for callback in features:
                callback.teardown(trainer, pl_module, "fit")
            try:
                yield
            finally:
                for callback in [c for c in trainer.callbacks if isinstance(c, _module_wrappers())]:
                    callback.on_fit_start(trainer, pl_module)

    def _replan(self, trainer: Trainer, pl_module: LightningModule, batch: Any, measured: int | None,
                why: str) -> str | None:
        """Plan again on ``batch`` from the current plan (what can change between steps); ``measured``: the step's
        measured peak (the bytes the estimate missed are counted from it), ``None`` after an out-of-memory error (a
        plan predicting at most three quarters of the current one, the strongest if none does). Returns what
        changed, or ``None`` when nothing stronger is left."""
        allow = _between_steps(self.allow)
        with self._features_off(trainer, pl_module), unmeasured():
            run = self._run(trainer, pl_module, batch, allow)
            now = run.estimate(run.base).peak_bytes
            if measured is not None:
                self._missed = max(measured - now, self._missed)
                budget = self.budget_bytes - self._context_bytes - self._missed
            else:
                budget = min(self.budget_bytes - self._context_bytes - self._missed, int(now * 0.75))
            result = self._search(trainer, run, budget)
            chosen = result.fitting[0] if result.fitting else None
            if chosen is None and measured is None:
                chosen = self._strongest_below(run, now)
            if chosen is None:
                if measured is None:
                    return None
                raise self._nothing_fits(run, budget)
            before = len(self.changes)
            self.plan = chosen
            self._apply(trainer, pl_module, run, late=True)
        change = "; ".join(self.changes[before:]) or "the plan holds"
        self.replans.append(Replan(int(trainer.global_step), batch_shape(batch), why, now, measured, change))
        _say(f"{_OWNER}: re-planned: {self.replans[-1]}")
        return change

    @staticmethod
    def _strongest_below(run: Any, now: int) -> Any:
        from lightning_memkit.estimate.plans import PlanResult

        strongest = _strongest(run)
        if strongest == run.base:
            return None
        peak = run.estimate(strongest).peak_bytes
        return PlanResult(strongest, peak, 0.0, False, run) if peak < now else None

    def _on_out_of_memory(self, trainer: Trainer, event: Any) -> str | None:
        if self._sharded:
            _say(f"{_OWNER}: out of memory in the {event.where} under a sharded strategy: not recovered (the plan "
                 "is fixed for the run); lower the budget or the batch and restart")
            return None
        pl_module = trainer.lightning_module
        change = self._replan(trainer, pl_module, event.batch, None, f"out of memory in the {event.where}")
        if change is not None:
            self._recovered = self.plan.plan.to_dict()  # every rank applies it after this step (_agree)
        return change

    # -- watching every step -----------------------------------------------------------------------
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        device = trainer.strategy.root_device
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            self._watching = True
            return
        size = batch_elements(batch)
        if not self._cpu_watch or (size <= self._largest and trainer.global_step >= _WARMUP_STEPS):
            return
        self._largest, self._watching = max(size, self._largest), True
        if self._live is None:
            self._live = LivePeak().__enter__()
        self._live.track(_alive(pl_module, trainer, batch))
        self._live.reset_peak()

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        over = self._measure(trainer.strategy.root_device)
        if trainer.world_size > 1 and not self._pipeline:
            self._agree(trainer, pl_module, batch, over)
        elif over is not None:
            self._over(trainer, pl_module, batch, over)

    def _measure(self, device: torch.device) -> int | None:
        """The step's measured peak when it is above the plan's prediction (margin) or the budget, else ``None``."""
        if not self._watching:
            return None
        self._watching = False
        if device.type == "cuda":
            measured = torch.cuda.max_memory_reserved(device) + self._context_bytes
        else:
            measured = self._live.peak_bytes
            self._close()
        self.measured_peak_bytes = max(self.measured_peak_bytes or 0, measured)
        if measured > (self.plan.peak_bytes + self._missed) * (1 + self.margin) or measured > self.budget_bytes:
            return measured
        return None

    # -- one plan on every rank --------------------------------------------------------------------
    def _agree(self, trainer: Trainer, pl_module: LightningModule, batch: Any, over: int | None) -> None:
        """After every step under several processes, one ``all_gather`` of what each rank needs: a plan an
        out-of-memory recovery made during the step (the strongest is applied on every rank), or a step measured
        above its prediction (the rank that measured the most re-plans on its batch and broadcasts the plan)."""
        recovered, self._recovered = self._recovered, None
        reports = _all_gather_object((over, recovered))
        plans = [(Plan.from_dict(p), r) for r, (_, p) in enumerate(reports) if p is not None]
        if plans:
            plan, rank = max(plans, key=lambda pr: (sum(pr[0].strength()), pr[0].strength(), -pr[1]))
            if plan != self.plan.plan:
                self._adopt(trainer, pl_module, batch, plan, f"rank {rank} recovered from an out-of-memory error")
            return
        overs = [(m, -r) for r, (m, _) in enumerate(reports) if m is not None]
        if not overs:
            return
        measured, src = max(overs)
        src = -src  # the lowest rank of those that measured the most
        if trainer.global_rank == src:
            try:
                self._over(trainer, pl_module, batch, measured)
            except Exception:
                trainer.strategy.broadcast(None, src=src)  # every rank stops, none waits
                raise
            trainer.strategy.broadcast((self.plan.plan.to_dict(), self._missed), src=src)
            return
        sent = trainer.strategy.broadcast(None, src=src)
        if sent is None:
            raise RuntimeError(f"{_OWNER}: rank {src} could not re-plan (its own line says why); every rank stops")
        plan, self._missed = Plan.from_dict(sent[0]), max(self._missed, sent[1])
        if plan != self.plan.plan:
            self._adopt(trainer, pl_module, batch, plan, f"rank {src} re-planned")

    def _adopt(self, trainer: Trainer, pl_module: LightningModule, batch: Any, plan: Plan, why: str) -> None:
        """Apply another rank's ``plan`` between steps (estimated on this rank's ``batch`` for its prediction)."""
        before, now = len(self.changes), self.plan.peak_bytes
        with self._features_off(trainer, pl_module), unmeasured():
            run = self._run(trainer, pl_module, batch, _between_steps(self.allow))
            self.plan = _estimated(run, plan)
            self._apply(trainer, pl_module, run, late=True)
        change = "; ".join(self.changes[before:]) or "the plan holds"
        self.replans.append(Replan(int(trainer.global_step), batch_shape(batch), why, now, None, change))
        _say(f"{_OWNER}: rank {trainer.global_rank} applies the plan of {why}: {change}")

    def _over(self, trainer: Trainer, pl_module: LightningModule, batch: Any, measured: int) -> None:
        predicted = self.plan.peak_bytes
        why = (f"a step peaked at {format_bytes(measured)}, above the predicted {format_bytes(predicted)} by more "
               f"than the {self.margin:.0%} margin" if measured <= self.budget_bytes else
               f"a step peaked at {format_bytes(measured)}, above the budget {format_bytes(self.budget_bytes)}")
        if self._pipeline or self._sharded:
            fixed = "memkit_pipeline's split is" if self._pipeline else "a sharded run's plan is"
            warnings.warn(f"{_OWNER}: rank {trainer.global_rank}: {why}; {fixed} fixed for the run, so it is not "
                          "re-planned", stacklevel=2)
            return
        _say(f"{_OWNER}: {why}: planning again")
        try:
            self._replan(trainer, pl_module, batch, measured, why)
        except NoPlanFits as err:
            raise RuntimeError(f"{_OWNER}: {why} (batch {batch_shape(batch)}, {measured:,} B measured, "
                               f"{predicted:,} B predicted), and re-planning between steps cannot fit: {err}") from err

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
        """The budget, the batch planned on, the plan, the predicted and measured peaks, and every re-plan and
        recovered out-of-memory step."""
        if self.plan is None:
            return f"{_OWNER}: no plan made (the fit did not reach setup)"
        measured = ("not measured" if self.measured_peak_bytes is None
                    else f"measured {format_bytes(self.measured_peak_bytes)} ({self.measured_peak_bytes:,} B)")
        line = (f"{_OWNER}: budget {format_bytes(self.budget_bytes)} ({self.budget_bytes:,} B); planned on "
                f"{self.planned_on}; plan: {'; '.join(self.changes) or 'the run as given'}; predicted peak "
                f"{format_bytes(self.plan.peak_bytes)} ({self.plan.peak_bytes:,} B), {measured}")
        if self.ranked_on:
            line += f"; plans ranked by step time on {self.ranked_on}"
        if self._pipeline:
            line += f"; memkit_pipeline: {self.plan.describe()}"
        lines = [line] + [f"  re-planned at {r}" for r in self.replans]
        return "\n".join(lines)

    # -- inputs ------------------------------------------------------------------------------------
    def preflight(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Refuse, in one line naming both, a budget larger than the training device's memory (CUDA: the device's
        total; CPU: the machine's), before any data is read or anything planned (``memkit fit`` runs it before the
        fit)."""
        from lightning_memkit.measure.device import device_total_memory

        if isinstance(self.budget, float):
            return
        device = trainer.strategy.root_device
        total = device_total_memory(device)
        if total is not None and self.budget > total:
            where = "this machine's memory" if device.type == "cpu" else f"the memory of {device}"
            raise ValueError(f"{_OWNER}(budget={self._given!r}): {format_bytes(self.budget)} is more than {where}, "
                             f"{format_bytes(total)} ({total:,} B); give at most that, or a fraction of it such as 0.9")

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


def _estimated(run: Any, plan: Plan) -> Any:
    """``plan`` (chosen as fitting: by this rank's search, another rank's, or a checkpoint) estimated on ``run``."""
    from lightning_memkit.estimate.plans import PlanResult

    with unmeasured():
        est = run.estimate(plan)
    return PlanResult(plan, est.peak_bytes, 0.0, True, run, getattr(est, "host_bytes", 0))


def _saved_state(path: Any, key: str) -> dict[str, Any]:
    """This callback's state in the checkpoint at ``path`` (``{}`` without a path, a readable file or a state)."""
    if not path:
        return {}
    try:  # mapped, not read: only the callbacks' states are touched
        checkpoint = torch.load(path, map_location="cpu", mmap=True, weights_only=False)
    except (OSError, RuntimeError, ValueError, EOFError):  # not a checkpoint file: Lightning reports it on restore
        return {}
    if not isinstance(checkpoint, dict):
        return {}
    return checkpoint.get("callbacks", {}).get(key) or {}


def _all_gather_object(obj: Any) -> list[Any]:
    """Every rank's ``obj`` (one ``all_gather_object`` of the default process group)."""
    out: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, obj)
    return out


def _planning_rank(trainer: Trainer, batch: Any) -> int:
    """The rank whose planning batch has the most elements (the lowest of equals): it plans for every rank. One
    ``all_gather`` under several processes; 0 alone."""
    if trainer.world_size == 1:
        return 0
    mine = torch.tensor([batch_elements(batch)], dtype=torch.int64, device=trainer.strategy.root_device)
    return int(torch.argmax(trainer.strategy.all_gather(mine).flatten().cpu()))


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
        from lightning_memkit.common.sizes import parse_bytes

        try:
            return parse_bytes(budget)
        except ValueError:
            raise ValueError(f"{_OWNER}(budget={budget!r}): not a positive size; write e.g. 24GiB, 80GB, 512MiB, "
                             "bytes, or a fraction such as 0.9") from None
    raise TypeError(f"{_OWNER}(budget=...) must be bytes, a size such as '24GiB' or a fraction, got "
                    f"{type(budget).__name__}")


def _say(line: str) -> None:
    rank_zero_info(line)


def _refusals(trainer: Trainer, pl_module: LightningModule, allow: Sequence[str]) -> dict[str, str]:
    """Why the Trainer refuses each allowed lever whose callback says so (its ``refusals``: gradient clipping,
    accumulation, the strategy...), one line each."""
    out = {}
    for x in LEVERS:
        if x.name not in allow or not x.callback:
            continue
        callback = import_object(x.callback)
        reasons = getattr(callback, "trainer_refusals", None)
        why = reasons(trainer, pl_module) if reasons is not None else None
        if why:
            out[x.name] = why
    return out


def _between_steps(allow: Sequence[str]) -> list[str]:
    """The levers of ``allow`` a re-plan during the run may change."""
    return [a for a in allow if lever(a).between_steps]


def _module_wrappers() -> tuple[type, ...]:
    """The callbacks of the levers that wrap the module (off while it is copied for an estimate)."""
    return tuple(import_object(x.callback) for x in LEVERS if x.wraps_module)


def _strongest(run: Any) -> Any:
    """The plan of ``run`` strongest on every axis."""
    return max(run.axes(), key=lambda p: p.strength())


def _no_split(pl_module: LightningModule, batch: Any) -> str:
    """Why the batch cannot be split into micro-batches inside the step ("" when it can)."""
    if not pl_module.automatic_optimization:
        return f"{type(pl_module).__name__} uses manual optimization (the split runs inside automatic optimization)"
    rows = batch_rows(batch)
    if rows is None:
        return f"the batch's tensors ({batch_shape(batch)}) have no common leading size to split"
    if rows < 2:
        return f"the batch has {rows} row"
    return ""


def _is_pipeline(trainer: Trainer) -> bool:
    """Whether the Trainer runs memkit_pipeline (planned per rank through the strategy's own predictions)."""
    return callable(getattr(trainer.strategy, "predict_partition", None))


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
    yield from batch_tensors(batch)
