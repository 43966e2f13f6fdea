"""MemoryBudget against the anchors: the time to a configuration that fits a memory budget, and what it costs.

Models: TinyLM (d_model 64, 2 blocks) on ``ByteTextDataModule`` batches, and tiny random Llama and Qwen3-MoE
causal LMs (``HFCausalLM``, hidden 64, 2 decoder layers) on its ``batch_format="hf"`` batches; batch 8 x 64
bytes, AdamW, ``Trainer.fit`` on CPU with one intra-op thread. For each model the run without a budget comes
first: its whole-fit peak (one ``LivePeak`` opened before the model is built, over the whole ``fit``) sets the
budgets, 70%, 55% and 40% of it, measured in the same benchmark run. At each budget three ways to fit:

- ``MemoryBudget(budget)``: plans at ``setup`` on fake tensors and applies the plan (recompute, fused loss,
  micro-batches: its default ``allow``). Time to a fitting configuration: the time spent in its hooks (the
  plan at ``setup``, the checks of the first steps, a re-plan if one happens).
- Lightning's ``BatchSizeFinder(mode="power", init_val=8)`` (3 steps per trial, its default): on an
  out-of-memory error it halves the batch. On CPU the device limit is simulated by a guard on the same
  whole-fit ``LivePeak``: while the finder searches, an allocation that takes the live bytes above the budget
  raises ``RuntimeError("DefaultCPUAllocator: can't allocate memory: ...")``, which Lightning's
  ``is_oom_error`` takes for an out-of-memory error. The live bytes count every tensor made since before the
  model was built (weights, gradients, optimizer state, batches, the corpus): the quantity the budget is
  stated in. As with a real allocator, the bytes still held while Lightning handles the error do not fail
  again; the guard re-arms once the live bytes are back within the budget. Time to a fitting configuration:
  the finder's search (its ``on_fit_start``, checkpoint save and restore included). Its resulting run is the
  rest of that fit: the peak restarts from the bytes alive when the search ends.
- ``torch.compile`` with ``torch._functorch.config.activation_memory_budget`` (the min-cut partitioner; the
  ``aot_eager_decomp_partition`` backend, whose ops ``LivePeak`` counts: inductor's own buffers are invisible to
  it, and its C++ compile would take minutes on 2 cores). The loss function (TinyLM's ``_loss``; the HF
  model's forward with labels) is compiled, forward, loss and backward in one joint graph. The fraction is
  halved from 1.0 (1.0, 0.5, 0.25, 0.125, 0.0625, then 0.0), each compiled afresh and fitted for 3 steps under
  the whole-fit ``LivePeak``, until the measured peak fits. The trials are the same sequence for every
  budget: each is run once per model and its time counted for every budget that reaches it. Time to a fitting
  configuration: the sum of the trial fits (compile included) up to the fitting one.

Per case: the time to a fitting configuration (seconds, and as a ratio to MemoryBudget's); the resulting run's
whole-fit peak against the budget, in bytes; its losses per optimizer step against the unbudgeted run's
(3 steps; the same math when all are within 1e-4); its step time as a ratio to the unbudgeted run's (separate
fits without ``LivePeak``, 8 optimizer steps, the median after the first 2; the unbudgeted run is timed before
and after the three configurations of each budget, its mean the reference), and per sample (times 8 over the
samples an optimizer step trains on); what each chose. A further entry lists every compile trial: the fraction, its
whole-fit peak, its compile-and-fit seconds and whether its losses match. One discarded fit of each kind runs
first, so the one-time imports and initialisation are charged to no case.

Variable lengths (the last entry): the tiny random Llama on ``VariableLengthDataModule`` batches of 8 windows
whose longest is 32, 128, 256 and 512 bytes in turn (padded per batch, ``labels`` -100 on the padding; 6 batches,
one epoch, so the FIRST batch is the SHORTEST, 8 x 32, and the fourth the longest, 8 x 512), AdamW, 6 optimizer
steps on CPU. The unbudgeted run's whole-fit peak sets one budget, 60% of it, measured in the same run. Rows: the
unbudgeted run; ``MemoryBudget(budget)`` planning on the batch the data module declares (``declare_longest=True``:
its ``longest_batch()``, the 8 longest windows padded as a batch of them is) and on the batch it finds by scanning
the data set's sample lengths (``declare_longest=False``), each with the time in its hooks, the plan, the batch it
planned on (``budget.planned_on``) and its re-plans (``budget.replans``); and ``BatchSizeFinder`` as above,
guarded at the same budget, on the same data module (it exposes ``batch_size``; the finder regroups the same
windows into batches of the size it tries). Each of the finder's trials runs only the FIRST 3 batches of the
loader (at batch 8: lengths 32, 128, 256), so it searches on the first batches only: at batch 8 or below its
trials never run a window of the 8 x 512 batch the run meets at step 4 (a trial at 16 regroups the windows, and
its batches hold 512 ones); the row names the largest batch its trials ran and the widest at the size it chose.
``VariableLengthDataModule`` has no ``val_dataloader``, and Lightning's finder re-creates the validation loader
after every successful trial: on it as it is the search stops with that error (recorded in the row), and the
row's fit runs again on the same training data with an empty ``val_dataloader`` added (a benchmark-side
subclass). The goal: both MemoryBudget runs' whole-fit peaks within the budget, their losses per optimizer step
within 1e-4 of the unbudgeted run's. ``quick=True`` runs the entry with 4 steps (each length once).

    python -m benchmarks.run --only budget --device cpu
"""

from __future__ import annotations

import contextlib
import logging
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import BatchSizeFinder

from benchmarks.common import record
from lightning_memkit.callbacks import (
    ActivationCheckpointing,
    FusedLinearCrossEntropy,
    MemoryBudget,
    MicroBatchSplit,
)
from lightning_memkit.demo import ByteTextDataModule, HFCausalLM, TinyLM, VariableLengthDataModule
from lightning_memkit.memory import LivePeak

THREADS = 1
BATCH, SEQ = 8, 64
STEPS = 3  # optimizer steps of a measured fit (BatchSizeFinder's steps_per_trial is 3 too)
TIMED_STEPS, SKIP = 8, 2  # timed fits: the median step time of the steps after the first SKIP
MODELS = ("tiny_lm", "llama", "qwen3_moe")
FRACTIONS = (0.7, 0.55, 0.4)
COMPILE_FRACTIONS = (1.0, 0.5, 0.25, 0.125, 0.0625, 0.0)
TOLERANCE = 1e-4
METHODS = ("MemoryBudget", "BatchSizeFinder", "compile budget")
VAR_KIND = "llama"  # the variable-length entry's model
VAR_LENGTHS = (32, 128, 256, 512)  # the longest window of each batch in turn: the first batch the shortest
VAR_STEPS, VAR_QUICK_STEPS = 6, 4  # optimizer steps = batches of its one epoch
VAR_FRACTION = 0.6
VAR_MAX_BYTES = 60_000


# -- one fit -------------------------------------------------------------------------------------------
def _model(kind: str) -> pl.LightningModule:
    if kind == "tiny_lm":
        return TinyLM(d_model=64, n_layers=2, n_heads=4, seq_len=SEQ)
    return HFCausalLM(family=kind, hidden_size=64, num_layers=2, vocab_size=256)


def _label(kind: str) -> str:
    return "TinyLM (d_model 64, 2 blocks)" if kind == "tiny_lm" else f"tiny random {kind} (hidden 64, 2 layers)"


class _StepLosses(pl.Callback):
    """The loss of each optimizer step (Lightning's micro-batch losses are divided by the accumulation)."""

    def __init__(self) -> None:
        self.batches: list[float] = []
        self.accumulate = 1

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.accumulate = int(trainer.accumulate_grad_batches)
        self.batches.append(float(outputs["loss"]))

    @property
    def steps(self) -> list[float]:
        k = self.accumulate
        return [sum(self.batches[i:i + k]) for i in range(0, len(self.batches), k)]


class _StepTimes(pl.Callback):
    """Wall time of each optimizer step, from the end of the one before (data loading and hooks included)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._last = 0.0
        self._step = 0

    def on_train_start(self, trainer, pl_module) -> None:
        self._last, self._step = time.perf_counter(), trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step > self._step:
            now = time.perf_counter()
            self.times.append(now - self._last)
            self._last, self._step = now, trainer.global_step


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    loggers = [logging.getLogger(n) for n in ("lightning", "lightning.pytorch", "lightning.fabric")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


@dataclass
class _Fit:
    """How to run one configuration: the batch, the accumulation, callbacks (made per fit) and a model change."""

    batch: int = BATCH
    accumulate: int = 1
    callbacks: Callable[[LivePeak | None], list[pl.Callback]] = field(default=lambda _lp: [])
    prepare: Callable[[pl.LightningModule], None] | None = None


DataFor = Callable[[int], pl.LightningDataModule]  # the data module of a fit, from its batch size


def _run_fit(kind: str, how: _Fit, steps: int, root: str, lp: LivePeak | None,
             data_for: DataFor | None = None) -> tuple[list[pl.Callback], float]:
    pl.seed_everything(0, verbose=False)
    model = _model(kind)
    if how.prepare is not None:
        how.prepare(model)
    if data_for is not None:
        data = data_for(how.batch)
    else:
        data = ByteTextDataModule(batch_size=how.batch, seq_len=SEQ, max_bytes=100_000, samples_per_epoch=BATCH * steps,
                                  batch_format="pairs" if kind == "tiny_lm" else "hf")
    callbacks = how.callbacks(lp)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, accumulate_grad_batches=how.accumulate,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                         default_root_dir=root, callbacks=callbacks)
    t0 = time.perf_counter()
    trainer.fit(model, data)
    return callbacks, time.perf_counter() - t0


def _measured(kind: str, how: _Fit, root: str, data_for: DataFor | None = None,
              steps: int = STEPS) -> tuple[int, list[float], list[pl.Callback], float]:
    """(whole-fit peak, losses per optimizer step, the callbacks, fit seconds): one LivePeak over the whole fit."""
    losses = _StepLosses()
    inner = how.callbacks
    how = _Fit(how.batch, how.accumulate, lambda lp: [losses, *inner(lp)], how.prepare)
    torch._dynamo.reset()
    with _quiet(), LivePeak() as lp:
        callbacks, seconds = _run_fit(kind, how, steps, root, lp, data_for)
    return lp.peak_bytes, losses.steps, callbacks[1:], seconds


def _timed(kind: str, how: _Fit, root: str) -> float:
    """The median optimizer-step time of a fit without LivePeak."""
    times = _StepTimes()
    inner = how.callbacks
    how = _Fit(how.batch, how.accumulate, lambda lp: [times, *inner(lp)], how.prepare)
    torch._dynamo.reset()
    with _quiet():
        _run_fit(kind, how, TIMED_STEPS, root, None)
    return statistics.median(times.times[SKIP:])


# -- the three ways to fit -----------------------------------------------------------------------------
class _TimedBudget(MemoryBudget):
    """MemoryBudget with the seconds spent in its planning and checking hooks added up."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.seconds = 0.0

    @contextlib.contextmanager
    def _clock(self) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds += time.perf_counter() - t0

    def setup(self, trainer, pl_module, stage) -> None:
        with self._clock():
            super().setup(trainer, pl_module, stage)

    def on_train_start(self, trainer, pl_module) -> None:
        with self._clock():
            super().on_train_start(trainer, pl_module)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        with self._clock():
            super().on_train_batch_start(trainer, pl_module, batch, batch_idx)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        with self._clock():
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)


class _OutOfMemoryGuard:
    """``LivePeak.on_change``: while armed, an allocation that takes the live bytes above ``budget`` raises the
    CPU allocator's out-of-memory error. After raising it stays quiet until the live bytes are within the budget
    again (the bytes the failed step still holds while the error is handled, as a real allocator's)."""

    def __init__(self, lp: LivePeak, budget: int) -> None:
        self.lp, self.budget = lp, budget
        self.armed, self.tripped, self.raised, self._last = False, False, 0, 0

    def __call__(self, device: str, live: int) -> None:
        total = self.lp.live_bytes
        if self.tripped:
            self.tripped = total > self.budget
            self._last = total
            return
        grew, self._last = total > self._last, total
        if self.armed and grew and total > self.budget:
            self.tripped, self.raised = True, self.raised + 1
            raise RuntimeError(f"DefaultCPUAllocator: can't allocate memory: {total:,} live bytes would exceed the "
                               f"simulated device limit of {self.budget:,} bytes")


class _GuardedFinder(BatchSizeFinder):
    """BatchSizeFinder searching under the guard; the whole-fit peak restarts when its search ends."""

    def __init__(self, guard: _OutOfMemoryGuard, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.guard, self.seconds = guard, 0.0

    def on_fit_start(self, trainer, pl_module) -> None:
        t0 = time.perf_counter()
        self.guard.armed = True
        try:
            super().on_fit_start(trainer, pl_module)
        finally:
            self.guard.armed = False
            self.seconds = time.perf_counter() - t0
            self.guard.lp.reset_peak()


def _finder(budget: int) -> Callable[[LivePeak | None], list[pl.Callback]]:
    def make(lp: LivePeak | None) -> list[pl.Callback]:
        guard = _OutOfMemoryGuard(lp, budget)
        lp.on_change = guard
        return [_GuardedFinder(guard, mode="power", init_val=BATCH)]
    return make


def _compiled(fraction: float) -> Callable[[pl.LightningModule], None]:
    """Compile the model's loss (forward, loss, backward in one joint graph) under ``activation_memory_budget``."""
    from torch._dynamo.backends.debugging import aot_eager_decomp_partition

    def backend(gm, example_inputs):
        with torch._functorch.config.patch(activation_memory_budget=fraction):
            return aot_eager_decomp_partition(gm, example_inputs)

    def prepare(model: pl.LightningModule) -> None:
        if isinstance(model, TinyLM):
            model._loss = torch.compile(model._loss, backend=backend)
        else:
            model.model.compile(backend=backend)

    return prepare


def _plan_fit(plan: Any) -> _Fit:
    """MemoryBudget's chosen plan applied with the same callbacks, without the planner (for the timed fit)."""
    def make(_lp: LivePeak | None) -> list[pl.Callback]:
        out: list[pl.Callback] = []
        if plan.checkpoint:
            out.append(ActivationCheckpointing(selective=plan.checkpoint == "selective"))
        if plan.fused_loss:
            out.append(FusedLinearCrossEntropy())
        if plan.micro_batch < BATCH:  # the split inside the step, as MemoryBudget runs it
            out.append(MicroBatchSplit(max_rows=plan.micro_batch))
        return out
    return _Fit(callbacks=make)


# -- one model -----------------------------------------------------------------------------------------
@dataclass
class _Outcome:
    """One method at one budget."""

    seconds: float
    peak: int | None = None
    losses: list[float] | None = None
    samples: int | None = None
    chose: str = ""
    timed: _Fit | None = None  # the configuration to time (None: nothing fits)


def _planned_fit(kind: str, budget: int, root: str, data_for: DataFor | None = None, steps: int = STEPS,
                failures: tuple[type[Exception], ...] = (ValueError,)) -> Any:
    """A measured fit under ``MemoryBudget(budget)``: ``(the callback, whole-fit peak, losses)``, or the
    ``_Outcome`` of a failure among ``failures`` (``ValueError``: no plan fits, raised at setup before any step;
    ``RuntimeError``: a re-plan during the run found nothing that fits, or the retries ran out)."""
    holder: list[_TimedBudget] = []

    def make(_lp: LivePeak | None) -> list[pl.Callback]:
        holder.append(_TimedBudget(budget))
        return holder[-1:]

    try:
        peak, losses, _, _ = _measured(kind, _Fit(callbacks=make), root, data_for, steps)
    except failures as err:
        words = "no plan fits" if isinstance(err, ValueError) else "failed during the run"
        return _Outcome(holder[-1].seconds, chose=f"{words}: {err}")
    return holder[-1], peak, losses


def _plan_words(mb: _TimedBudget) -> tuple[str, str]:
    """The plan in words, and its step peak predicted and measured."""
    plan = mb.plan
    words = plan.plan.describe(plan.run.base) if plan.run is not None else "; ".join(mb.changes)
    measured = "not measured" if mb.measured_peak_bytes is None else f"measured {mb.measured_peak_bytes:,} B"
    return words, f"step peak predicted {plan.peak_bytes:,} B, {measured}"


def _memory_budget(kind: str, budget: int, root: str) -> _Outcome:
    fitted = _planned_fit(kind, budget, root)
    if isinstance(fitted, _Outcome):
        return fitted
    mb, peak, losses = fitted
    words, peaks = _plan_words(mb)
    chose = (f"{words} ({peaks}; step time {mb.plan.overhead:+.0%} predicted"
             f"{'; re-planned once' if mb.replanned else ''})")
    return _Outcome(mb.seconds, peak, losses, BATCH, chose, _plan_fit(mb.plan.plan))


def _batch_size_finder(kind: str, budget: int, root: str) -> _Outcome:
    t0 = time.perf_counter()
    try:
        peak, losses, callbacks, _ = _measured(kind, _Fit(callbacks=_finder(budget)), root)
    except RuntimeError as err:  # an out-of-memory error outside the search's trials (the restore, the run)
        return _Outcome(time.perf_counter() - t0, chose=f"failed: {err}")
    finder = callbacks[0]
    size = finder.optimal_batch_size
    chose = f"batch size {size} (from {BATCH}; {finder.guard.raised} out-of-memory errors in the search)"
    return _Outcome(finder.seconds, peak, losses, size, chose, _Fit(batch=size))


class _CompileSearch:
    """The halving sequence of fractions, each trial run once per model and shared by its budgets."""

    def __init__(self, kind: str, root: str, fractions: tuple[float, ...]) -> None:
        self.kind, self.root, self.fractions = kind, root, fractions
        self.trials: list[tuple[float, int, list[float], float]] = []  # (fraction, peak, losses, seconds)

    def _trial(self, i: int) -> tuple[float, int, list[float], float]:
        while len(self.trials) <= i:
            fraction = self.fractions[len(self.trials)]
            peak, losses, _, seconds = _measured(self.kind, _Fit(prepare=_compiled(fraction)), self.root)
            self.trials.append((fraction, peak, losses, seconds))
        return self.trials[i]

    def fit(self, budget: int) -> _Outcome:
        spent = 0.0
        for i in range(len(self.fractions)):
            fraction, peak, losses, seconds = self._trial(i)
            spent += seconds
            if peak <= budget:
                return _Outcome(spent, peak, losses, BATCH, f"activation_memory_budget={fraction} ({i + 1} compiles)",
                                _Fit(prepare=_compiled(fraction)))
        fraction, peak, losses, _ = min(self.trials, key=lambda t: t[1])
        return _Outcome(spent, peak, losses, BATCH, f"none of {len(self.trials)} fractions fits; the smallest peak at "
                        f"activation_memory_budget={fraction}")


def _same(losses: list[float] | None, ref: list[float]) -> tuple[float | str, str]:
    if losses is None:
        return "", ""
    if len(losses) != len(ref):
        return "", f"no ({len(losses)} steps)"
    delta = max(abs(a - b) for a, b in zip(losses, ref))
    return float(f"{delta:.3g}"), "yes" if delta <= TOLERANCE else "no"


def _method_row(method: str, o: _Outcome, fraction: float, budget: int, ref_s: float, ratio: float | None,
                base_losses: list[float]) -> dict:
    """One method's row at one budget: its time to fit, peak, step time and losses against the unbudgeted run's."""
    fits = "" if o.peak is None else ("yes" if o.peak <= budget else "NO")
    delta, same = _same(o.losses, base_losses)
    per_sample = None if ratio is None or not o.samples else ratio * BATCH / o.samples
    return {
        "impl": f"{method} @ {fraction:.0%}", "budget B": budget, "time to fit s": round(o.seconds, 2),
        "vs MemoryBudget": round(o.seconds / ref_s, 3) if ref_s > 0 else "",
        "peak B": "" if o.peak is None else o.peak, "fits": fits or "no plan",
        "step time vs unbudgeted": "" if ratio is None else round(ratio, 3),
        "samples/step": "" if o.samples is None else o.samples,
        "time/sample vs unbudgeted": "" if per_sample is None else round(per_sample, 3),
        "max abs loss diff": delta, "same losses": same,
        "chose": o.chose,
    }


def _budget_met(mb: _Outcome, budget: int, base_losses: list[float]) -> bool:
    """Whether MemoryBudget's run fits the budget with the unbudgeted run's losses."""
    return mb.peak is not None and mb.peak <= budget and _same(mb.losses, base_losses)[1] == "yes"


def _trial_rows(kind: str, trials: list[tuple[float, int, list[float], float]], base_peak: int,
                base_losses: list[float]) -> list[dict]:
    """The rows of a model's compile trials: each fraction's peak, compile-and-fit time and losses."""
    return [{"impl": f"{kind}: activation_memory_budget={fraction}", "peak B": peak,
             "peak vs unbudgeted": round(peak / base_peak, 3), "compile and fit s": round(seconds, 2),
             "max abs loss diff": _same(losses, base_losses)[0], "same losses": _same(losses, base_losses)[1]}
            for fraction, peak, losses, seconds in trials]


def _case(kind: str, quick: bool, root: str) -> tuple[dict, list[dict]]:
    """The entry of one model, and the rows of its compile trials."""
    fractions = FRACTIONS[1:2] if quick else FRACTIONS
    base_peak, base_losses, _, _ = _measured(kind, _Fit(), root)
    search = _CompileSearch(kind, root, COMPILE_FRACTIONS[:3] if quick else COMPILE_FRACTIONS)
    rows = [{"impl": "unbudgeted", "budget B": "", "time to fit s": "", "vs MemoryBudget": "", "peak B": base_peak,
             "fits": "", "step time vs unbudgeted": 1.0, "samples/step": BATCH, "time/sample vs unbudgeted": 1.0,
             "max abs loss diff": 0.0,
             "same losses": "yes", "chose": "the run as given"}]
    base_times, all_met, verdicts = [], True, []
    for fraction in fractions:
        budget = int(base_peak * fraction)
        outcomes = {"MemoryBudget": _memory_budget(kind, budget, root),
                    "BatchSizeFinder": _batch_size_finder(kind, budget, root),
                    "compile budget": search.fit(budget)}
        before = _timed(kind, _Fit(), root)
        step = {m: _timed(kind, o.timed, root) for m, o in outcomes.items() if o.timed is not None}
        after = _timed(kind, _Fit(), root)
        reference = (before + after) / 2
        base_times += [before, after]
        ref_s = outcomes["MemoryBudget"].seconds
        for method in METHODS:
            ratio = step[method] / reference if method in step else None
            rows.append(_method_row(method, outcomes[method], fraction, budget, ref_s, ratio, base_losses))
        ok = _budget_met(outcomes["MemoryBudget"], budget, base_losses)
        all_met &= ok
        verdicts.append(f"{fraction:.0%} {'yes' if ok else 'NO'}")
    case = (f"{_label(kind)}, batch {BATCH}x{SEQ}, AdamW, {STEPS} optimizer steps, CPU, {torch.get_num_threads()} "
            f"thread(s): budgets {', '.join(f'{f:.0%}' for f in fractions)} of the unbudgeted whole-fit peak; "
            f"unbudgeted step {statistics.median(base_times) * 1e3:.1f} ms (median of its timed fits)")
    trials = _trial_rows(kind, search.trials, base_peak, base_losses)
    entry = record("budget", case, "the same fit without a budget (whole-fit LivePeak peak, losses, step time)", rows,
                   goal="MemoryBudget: whole-fit peak within the budget, the same losses within 1e-4 ("
                        + "; ".join(verdicts) + ")", met=bool(all_met))
    return entry, trials


# -- variable lengths ----------------------------------------------------------------------------------
class _EmptyValidation(VariableLengthDataModule):
    """The same training data with an empty validation loader: Lightning's BatchSizeFinder re-creates the validation
    loader after every successful trial, which a data module without ``val_dataloader`` fails."""

    def val_dataloader(self) -> list:
        return []


def _variable_data(declare: bool, steps: int, cls: type = VariableLengthDataModule) -> DataFor:
    """``VariableLengthDataModule``: ``steps`` batches of one epoch, the longest windows ``VAR_LENGTHS`` in turn."""
    return lambda batch: cls(batch_size=batch, lengths=VAR_LENGTHS, batches=steps, max_bytes=VAR_MAX_BYTES,
                             declare_longest=declare)


def _variable_budget(declare: bool, budget: int, root: str, steps: int) -> _Outcome:
    fitted = _planned_fit(VAR_KIND, budget, root, _variable_data(declare, steps), steps, (ValueError, RuntimeError))
    if isinstance(fitted, _Outcome):
        return fitted
    mb, peak, losses = fitted
    replans = ("no re-plan (budget.replans empty)" if not mb.replans else
               f"re-planned {len(mb.replans)} time(s): " + "; ".join(f"[{r}]" for r in mb.replans))
    words, peaks = _plan_words(mb)
    chose = f"{words} (planned on {mb.planned_on}; {peaks}; {replans})"
    return _Outcome(mb.seconds, peak, losses, BATCH, chose)


def _variable_finder(budget: int, root: str, steps: int) -> _Outcome:
    """BatchSizeFinder under the guard on the variable-length data; the largest batch its trials ran is noted. On
    ``VariableLengthDataModule`` as it is the search stops after its first successful trial (no ``val_dataloader``);
    that error is recorded and the fit run again on the same data with an empty validation loader."""
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    holder: list[pl.Callback] = []
    searched: list[tuple[int, int]] = []  # (rows, width) of each forward while the finder searches

    def make(lp: LivePeak | None) -> list[pl.Callback]:
        holder[:] = _finder(budget)(lp)
        return list(holder)

    def note(_module: torch.nn.Module, _args: Any, kwargs: dict[str, Any]) -> None:
        if holder and holder[0].guard.armed:
            searched.append(tuple(kwargs["input_ids"].shape))

    def prepare(model: pl.LightningModule) -> None:
        model.model.register_forward_pre_hook(note, with_kwargs=True)

    how, plain = _Fit(callbacks=make, prepare=prepare), ""
    t0 = time.perf_counter()
    try:
        try:
            peak, losses, callbacks, _ = _measured(VAR_KIND, how, root, _variable_data(True, steps), steps)
        except MisconfigurationException as err:
            plain = (f"on VariableLengthDataModule as it is the search stopped after {len(searched)} trial steps: "
                     f"{type(err).__name__}: {err}; run again with an empty val_dataloader added: ")
            searched.clear()
            t0 = time.perf_counter()
            peak, losses, callbacks, _ = _measured(VAR_KIND, how, root, _variable_data(True, steps, _EmptyValidation),
                                                   steps)
    except RuntimeError as err:  # an out-of-memory error outside the search's trials (the restore, the run)
        return _Outcome(time.perf_counter() - t0, chose=f"{plain}failed: {err}")
    finder = callbacks[0]
    size = finder.optimal_batch_size
    largest = max(searched, key=lambda s: s[0] * s[1]) if searched else None
    widest = max((w for rows, w in searched if rows == size), default=None)
    ran = "no trial step ran" if largest is None else f"the largest batch its trials ran {largest[0]}x{largest[1]}"
    if widest is not None:
        ran += f", the widest at the batch size it chose {size}x{widest}"
    chose = (f"{plain}batch size {size} (from {BATCH}; {finder.guard.raised} out-of-memory errors in the search; "
             f"each trial runs the first {finder._steps_per_trial} batches of the loader: {ran}; the data module "
             "exposes batch_size, so the finder regroups the same windows into batches of the size it tries)")
    return _Outcome(finder.seconds, peak, losses, size, chose)


def _variable_case(quick: bool, root: str) -> dict:
    """The entry of the variable-length data: unbudgeted, MemoryBudget declared and scanned, BatchSizeFinder."""
    steps = VAR_QUICK_STEPS if quick else VAR_STEPS
    base_peak, base_losses, _, _ = _measured(VAR_KIND, _Fit(), root, _variable_data(True, steps), steps)
    budget = int(base_peak * VAR_FRACTION)
    outcomes = {"MemoryBudget declared": _variable_budget(True, budget, root, steps),
                "MemoryBudget scanned": _variable_budget(False, budget, root, steps),
                "BatchSizeFinder": _variable_finder(budget, root, steps)}
    rows = [{"impl": "unbudgeted", "budget B": "", "time to fit s": "", "peak B": base_peak, "fits": "",
             "samples/step": BATCH, "max abs loss diff": 0.0, "same losses": "yes", "chose": "the run as given"}]
    verdicts = []
    for method, o in outcomes.items():
        fits = "no plan" if o.peak is None else ("yes" if o.peak <= budget else "NO")
        delta, same = _same(o.losses, base_losses)
        rows.append({"impl": f"{method} @ {VAR_FRACTION:.0%}", "budget B": budget,
                     "time to fit s": round(o.seconds, 2), "peak B": "" if o.peak is None else o.peak, "fits": fits,
                     "samples/step": "" if o.samples is None else o.samples, "max abs loss diff": delta,
                     "same losses": same, "chose": o.chose})
        if method.startswith("MemoryBudget"):
            verdicts.append(fits == "yes" and same == "yes")
    lengths = ", ".join(map(str, VAR_LENGTHS))
    case = (f"variable lengths: {_label(VAR_KIND)}, VariableLengthDataModule batch {BATCH}, longest window {lengths} "
            f"in turn (the first batch the shortest, {BATCH}x{VAR_LENGTHS[0]}; the longest {BATCH}x{VAR_LENGTHS[-1]}), "
            f"AdamW, {steps} optimizer steps, CPU, {torch.get_num_threads()} thread(s): budget {VAR_FRACTION:.0%} "
            "of the unbudgeted whole-fit peak")
    return record("budget", case, "the same fit without a budget (whole-fit LivePeak peak, losses)", rows,
                  goal=f"MemoryBudget: whole-fit peak within {VAR_FRACTION:.0%} of the unbudgeted peak with the same "
                       "losses (declared; scanned)", met=all(verdicts))


def _warm_up(root: str) -> None:
    """One discarded fit of each kind (plain, planned, guarded, compiled): the one-time imports and initialisation
    are not charged to the first case."""
    _measured("tiny_lm", _Fit(), root)
    with contextlib.suppress(ValueError):
        _measured("tiny_lm", _Fit(callbacks=lambda _lp: [MemoryBudget(4_000_000)]), root)
    _measured("tiny_lm", _Fit(callbacks=_finder(4_000_000)), root)
    _measured("tiny_lm", _Fit(prepare=_compiled(0.5)), root)


def run(device: str = "cpu", quick: bool = False) -> list[dict]:
    if device != "cpu":
        raise ValueError(f"device={device!r}: this benchmark simulates the device limit with LivePeak on CPU; "
                         "run it with --device cpu")
    before = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    try:
        with tempfile.TemporaryDirectory() as root, torch._dynamo.config.patch(recompile_limit=64):
            _warm_up(root)
            cases = [_case(kind, quick, root) for kind in (MODELS[:1] if quick else MODELS)]
            variable = _variable_case(quick, root)
    finally:
        torch.set_num_threads(before)
    trials = record("budget", f"torch.compile activation_memory_budget trials (aot_eager_decomp_partition, {STEPS} "
                    "optimizer steps each, whole-fit LivePeak peak; the fractions the search reached)",
                    "the same fit without a budget, eager", [row for _, rows in cases for row in rows])
    return [entry for entry, _ in cases] + [trials, variable]
