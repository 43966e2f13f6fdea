"""The memory levers one at a time, then MemoryBudget pulling them: device and host peak, step time, losses.

Models: tiny random Llama and Qwen3-MoE causal LMs built in code (``HFCausalLM``, hidden 256, 4 decoder layers,
vocabulary 4,096; the MoE with 4 experts, 2 per token) on ``ByteTextDataModule``'s ``batch_format="hf"`` batches
of 4 x 1,024 bytes, AdamW, ``Trainer.fit`` on CPU with one intra-op thread (stable ratios on a shared 2-core
machine). ``--quick``: hidden 64, 2 layers, vocabulary 256, batches of 2 x 128, fewer steps.

Per model, one entry of the levers, each usable alone as a callback, against the fit without any (the baseline,
the same model, data and seed, measured in the same run):

- full activation checkpointing (``ActivationCheckpointing()``) and selective (``selective=True``);
- activation offload (``ActivationOffloading()``: what the decoder layers save for backward, in host memory), alone
  and with full checkpointing (only the layers' inputs then);
- the optimizer step in backward (``OptimizerInBackward()``: no buffer of every gradient);
- the optimizer state and step on the host (``OffloadOptimizer()``);
- bitsandbytes' 8-bit AdamW (``Optimizer8bit()``: changes the numerics).

Memory: one ``LivePeak`` opened before the model is built, over the whole ``fit`` (weights, gradients, optimizer
state, activations, the batches and the corpus): ``peak_bytes`` is the device peak (on CPU: every byte not
offloaded), ``host_peak_bytes`` what the levers moved to host memory, counted apart. The measured fit runs 3
optimizer steps; its losses per optimizer step are compared with the baseline's (bitwise, and the largest
difference). Time: separate fits without ``LivePeak``, 6 optimizer steps each, the median step after the first 2
(the warm-up: the optimizer state appears in the first step, and MemoryBudget measures the first two); the ratio
is to the baseline's median, the baseline timed first and last (their mean; both are in the case line), and for
MemoryBudget before and after its fits.

Per model, one entry of ``MemoryBudget`` at 40% of the baseline's measured whole-fit peak, with its default
``allow`` (recompute, offload_activations, fused_loss, micro_batch, optimizer_in_backward, offload_optimizer) and
with the levers it had before (``allow=["recompute", "fused_loss", "micro_batch"]``): the changes it applied
(``budget.changes``, re-plans included) and each re-plan, its predicted step peak and host bytes against its own
measured step peak and the whole-fit peak, its predicted step-time change against the measured ratio (a timed fit
with the same budget, which plans again), the losses. A budget that cannot be met records the ``NoPlanFits``
message (at ``setup``), or the ``RuntimeError`` of a step above the budget that no re-plan between steps fits.

    python -m benchmarks.run --only levers --device cpu [--quick]
"""

from __future__ import annotations

import contextlib
import logging
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import lightning.pytorch as pl
import torch

from benchmarks.common import record
from lightning_memkit.callbacks import (
    ActivationCheckpointing,
    ActivationOffloading,
    MemoryBudget,
    OffloadOptimizer,
    Optimizer8bit,
    OptimizerInBackward,
)
from lightning_memkit.callbacks.memory_budget import DEFAULT_ALLOW, NoPlanFits
from lightning_memkit.demo import ByteTextDataModule, HFCausalLM
from lightning_memkit.memory import LivePeak

THREADS = 1
FAMILIES = ("llama", "qwen3_moe")
FRACTION = 0.4  # the budget, of the baseline's whole-fit peak
BEFORE = ("recompute", "fused_loss", "micro_batch")  # MemoryBudget's levers before the new ones
TOLERANCE = 1e-6  # "same losses": every optimizer step's loss within this of the baseline's
MAX_BYTES = 200_000  # the corpus


@dataclass(frozen=True)
class Shape:
    """The model, the batch and the steps of one run of the benchmark."""

    hidden: int
    layers: int
    vocab: int
    batch: int
    seq: int
    steps: int  # optimizer steps of a measured fit
    timed_steps: int  # optimizer steps of a timed fit
    skip: int  # its first steps, not timed

    def label(self, family: str) -> str:
        return (f"tiny random {family} (hidden {self.hidden}, {self.layers} layers, vocabulary {self.vocab:,}), "
                f"batch {self.batch}x{self.seq:,}, AdamW")


FULL = Shape(hidden=256, layers=4, vocab=4096, batch=4, seq=1024, steps=3, timed_steps=6, skip=2)
QUICK = Shape(hidden=64, layers=2, vocab=256, batch=2, seq=128, steps=2, timed_steps=4, skip=2)
# the parameters, their gradients and AdamW's moments dominate the step: a wide model on short sequences
WIDE = Shape(hidden=512, layers=4, vocab=16384, batch=2, seq=128, steps=3, timed_steps=6, skip=2)
WIDE_QUICK = Shape(hidden=128, layers=2, vocab=4096, batch=2, seq=32, steps=2, timed_steps=4, skip=2)

Callbacks = Callable[[], list[pl.Callback]]  # a fresh set of callbacks for each fit
LEVERS: tuple[tuple[str, Callbacks], ...] = (
    ("none (baseline)", lambda: []),
    ("full checkpointing", lambda: [ActivationCheckpointing()]),
    ("selective checkpointing", lambda: [ActivationCheckpointing(selective=True)]),
    ("activation offload", lambda: [ActivationOffloading()]),
    ("full checkpointing + activation offload", lambda: [ActivationCheckpointing(), ActivationOffloading()]),
    ("optimizer in backward", lambda: [OptimizerInBackward()]),
    ("offload optimizer", lambda: [OffloadOptimizer()]),
    ("8-bit AdamW", lambda: [Optimizer8bit()]),
)
KEEPS_THE_MATH = {name for name, _ in LEVERS} - {"8-bit AdamW"}


class _Steps(pl.Callback):
    """The loss and the wall time of every training batch (one optimizer step here: no gradient accumulation),
    the time from the end of the batch before (data loading and hooks included)."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.seconds: list[float] = []
        self._since = 0.0

    def on_train_start(self, trainer, pl_module) -> None:
        self._since = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        now = time.perf_counter()
        self.losses.append(float(outputs["loss"]))
        self.seconds.append(now - self._since)
        self._since = now


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Lightning's and MemoryBudget's lines and warnings off for the block."""
    before = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(before)


@dataclass
class _Fit:
    """What one fit measured: the whole-fit peaks (``None`` for a timed fit), losses and step times."""

    peak: int | None
    host_peak: int | None
    losses: list[float]
    seconds: list[float]


def _fit(family: str, shape: Shape, callbacks: list[pl.Callback], root: str, measured: bool) -> _Fit:
    """One ``Trainer.fit``: under one ``LivePeak`` opened before the model is built when ``measured`` (its steps),
    else without it (the timed steps)."""
    steps = shape.steps if measured else shape.timed_steps
    record_steps = _Steps()
    pl.seed_everything(0, verbose=False)
    with _quiet(), (LivePeak() if measured else contextlib.nullcontext()) as lp:
        model = HFCausalLM(family=family, hidden_size=shape.hidden, num_layers=shape.layers, vocab_size=shape.vocab)
        data = ByteTextDataModule(batch_size=shape.batch, seq_len=shape.seq, max_bytes=MAX_BYTES,
                                  samples_per_epoch=shape.batch * steps, batch_format="hf")
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                             limit_val_batches=0, default_root_dir=root, callbacks=[record_steps, *callbacks])
        trainer.fit(model, data)
    peak, host = (lp.peak_bytes, lp.host_peak_bytes) if measured else (None, None)
    return _Fit(peak, host, record_steps.losses, record_steps.seconds)


def _step_time(fit: _Fit, shape: Shape) -> float:
    return statistics.median(fit.seconds[shape.skip:])


def _losses(losses: list[float], ref: list[float]) -> tuple[str, float | str]:
    """("yes"/"no" bitwise, the largest absolute difference) of the losses per optimizer step."""
    if len(losses) != len(ref):
        return f"no ({len(losses)} steps)", ""
    return ("yes" if losses == ref else "no"), float(f"{max(abs(a - b) for a, b in zip(losses, ref)):.3g}")


def _cut(peak: int, base: int) -> dict:
    return {"device peak B": peak, "cut B": base - peak, "cut %": round(100 * (1 - peak / base), 1)}


# -- the levers alone --------------------------------------------------------------------------------------
def _levers_case(family: str, shape: Shape, root: str) -> tuple[dict, _Fit, float]:
    """The entry of the levers alone; the baseline's measured fit and its step time timed last."""
    fits = {name: _fit(family, shape, make(), root, measured=True) for name, make in LEVERS}
    base = fits[LEVERS[0][0]]
    first = _step_time(_fit(family, shape, [], root, measured=False), shape)
    times = {name: _step_time(_fit(family, shape, make(), root, measured=False), shape) for name, make in LEVERS[1:]}
    last = _step_time(_fit(family, shape, [], root, measured=False), shape)
    reference = (first + last) / 2
    times[LEVERS[0][0]] = reference
    rows, missed = [], []
    for name, _ in LEVERS:
        fit = fits[name]
        bitwise, delta = _losses(fit.losses, base.losses)
        rows.append({"impl": name, **_cut(fit.peak, base.peak), "host peak B": fit.host_peak,
                     "step ms": round(times[name] * 1e3, 1), "step time vs baseline": round(times[name] / reference, 3),
                     "losses bitwise": bitwise, "max abs loss diff": delta})
        if name == LEVERS[0][0]:
            continue
        if fit.peak >= base.peak:
            missed.append(f"{name}: no lower peak")
        if name in KEEPS_THE_MATH and not (isinstance(delta, float) and delta <= TOLERANCE):
            missed.append(f"{name}: other losses")
    case = (f"{shape.label(family)}, {shape.steps} optimizer steps measured, {shape.timed_steps} timed (median after "
            f"the first {shape.skip}), CPU, {torch.get_num_threads()} thread(s); baseline step {first * 1e3:.1f} ms "
            f"timed first, {last * 1e3:.1f} ms last")
    entry = record("levers", case, "the same fit without any lever (whole-fit LivePeak peak, losses, step time)", rows,
                   goal=f"every lever lowers the whole-fit device peak; all but 8-bit AdamW keep the baseline's losses "
                        f"(within {TOLERANCE:g}) ({'; '.join(missed) or 'every lever'})", met=not missed)
    return entry, base, last


# -- MemoryBudget ------------------------------------------------------------------------------------------
@dataclass
class _Budgeted:
    """MemoryBudget's measured fit and timed fit, or why it did not fit."""

    budget: MemoryBudget
    fit: _Fit | None = None
    timed: _Fit | None = None
    error: str = ""  # "NoPlanFits" or "failed during the run"
    message: str = ""


def _budget_fits(family: str, shape: Shape, budget: int, allow: Sequence[str], root: str) -> _Budgeted:
    """A measured and a timed fit under MemoryBudget(budget, allow) (the timed one plans again)."""
    out = _Budgeted(MemoryBudget(budget, allow=list(allow)))
    try:
        out.fit = _fit(family, shape, [out.budget], root, measured=True)
        out.timed = _fit(family, shape, [MemoryBudget(budget, allow=list(allow))], root, measured=False)
    except NoPlanFits as err:  # at setup: no plan fits
        out.error, out.message = "NoPlanFits", str(err)
    except RuntimeError as err:  # a step above the budget, and no re-plan between steps fits
        if not str(err).startswith("MemoryBudget:"):
            raise
        out.error, out.message = "failed during the run", str(err)
    return out


def _budget_row(label: str, budget: int, o: _Budgeted, base: _Fit, reference: float,
                shape: Shape) -> tuple[dict, bool]:
    """One row of MemoryBudget: its plan, predicted and measured peaks, step time, losses; and whether it fits."""
    mb = o.budget
    changes = "; ".join(mb.changes) or "the run as given"
    row: dict = {"impl": label, "budget B": budget}
    if o.error == "NoPlanFits":
        row.update({"fits": "NOT met (NoPlanFits)", "plan": o.message})
        return row, False
    if o.error:
        row.update({"fits": f"NOT met ({o.error})", "plan": changes, "re-plans": o.message})
        return row, False
    bitwise, delta = _losses(o.fit.losses, base.losses)
    fits = o.fit.peak <= budget
    row.update({
        "fits": "yes" if fits else "NOT met", "plan": changes,
        "predicted step peak B": mb.plan.peak_bytes,
        "measured step peak B": "" if mb.measured_peak_bytes is None else mb.measured_peak_bytes,
        "whole-fit peak B": o.fit.peak, "predicted host B": mb.plan.host_bytes, "host peak B": o.fit.host_peak,
        "step time predicted": f"{mb.plan.overhead:+.0%}",
        "step time vs baseline": round(_step_time(o.timed, shape) / reference, 3),
        "losses bitwise": bitwise, "max abs loss diff": delta,
        "re-plans": "; ".join(f"[{r}]" for r in mb.replans) or "none",
    })
    return row, fits


def _budget_case(family: str, shape: Shape, base: _Fit, first: float, root: str) -> dict:
    """The entry of MemoryBudget; ``first``: the baseline's step time timed just before (it is timed again after)."""
    budget = int(base.peak * FRACTION)
    allows = ((f"MemoryBudget default allow ({', '.join(DEFAULT_ALLOW)})", DEFAULT_ALLOW),
              (f"MemoryBudget allow={list(BEFORE)} (the levers before)", BEFORE))
    outcomes = [_budget_fits(family, shape, budget, allow, root) for _, allow in allows]
    last = _step_time(_fit(family, shape, [], root, measured=False), shape)
    reference = (first + last) / 2
    rows = [{"impl": "none (baseline)", "budget B": "", "fits": "", "plan": "the run as given",
             "whole-fit peak B": base.peak, "step time vs baseline": 1.0}]
    verdicts = []
    for (label, _), outcome in zip(allows, outcomes):
        row, fits = _budget_row(label, budget, outcome, base, reference, shape)
        rows.append(row)
        verdicts.append(fits)
    case = (f"{shape.label(family)}: MemoryBudget at {FRACTION:.0%} of the baseline's whole-fit peak, "
            f"{shape.steps} optimizer steps measured, {shape.timed_steps} timed (median after the first {shape.skip}), "
            f"CPU, {torch.get_num_threads()} thread(s); baseline step {first * 1e3:.1f} ms timed before, "
            f"{last * 1e3:.1f} ms after")
    words = "; ".join(f"{a} {'yes' if ok else 'no'}" for a, ok in zip(("default allow", "levers before"), verdicts))
    return record("levers", case, "the same fit without a budget (whole-fit LivePeak peak, losses, step time)", rows,
                  goal=f"with its default allow, the whole-fit device peak within the budget, {FRACTION:.0%} of the "
                       f"baseline's (within it: {words})", met=verdicts[0])


def run(device: str = "cpu", quick: bool = False) -> list[dict]:
    if device != "cpu":
        raise ValueError(f"device={device!r}: this benchmark counts device and host bytes with LivePeak on CPU and "
                         "simulates the device limit there; run it with --device cpu")
    shape = QUICK if quick else FULL
    before = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    entries = []
    try:
        with tempfile.TemporaryDirectory() as root:
            # discarded fits of every family, lever and a budget: one-time imports and initialisation go to no row
            for family in FAMILIES:
                _fit(family, QUICK, [], root, measured=True)
            for _, make in LEVERS[1:]:
                _fit(FAMILIES[0], QUICK, make(), root, measured=True)
            _fit(FAMILIES[0], QUICK, [MemoryBudget(2**30)], root, measured=True)
            for family, case_shape in [*((f, shape) for f in FAMILIES), (FAMILIES[0], WIDE_QUICK if quick else WIDE)]:
                levers, base, last = _levers_case(family, case_shape, root)
                entries += [levers, _budget_case(family, case_shape, base, last, root)]
    finally:
        torch.set_num_threads(before)
    return entries
