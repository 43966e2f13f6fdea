"""What the measuring callbacks cost per TinyLM training step, in a real ``Trainer.fit``.

Method: one fit of TinyLM (the ``make demo`` model and batch unless ``--quick``) on
``ByteTextDataModule``. A rotating wrapper is the only callback: step ``i`` is run under variant
``i % 4`` (no callback; ``PeakMemoryMonitor()`` with its default CPU sampling; ``PeakMemoryMonitor
(cpu_sample_every_n_steps=1)``; ``SavedTensorProfiler``), so the variants are interleaved step by step
and share the same machine noise. Only the active variant's callback sees a step's batch hooks; all
of them see the fit-level hooks. The wrapper times each step from ``on_train_batch_start`` to
``on_train_batch_end`` (forward, backward, AdamW step and the callbacks' own work). Every step is
compared with the baseline step just before it; a row's ratio is the median of those ratios over
its kind of step. The first round is warm-up and not counted.

The monitor's default cost per step is amortized over its sampling interval ``n``:
``(every_step_ratio + (n - 1) * unmeasured_ratio) / n``, from two medians; the plain mean of the
ratios over all of its steps (measured and not, in their natural 1-in-n mix) is shown beside it.

    python -m benchmarks.run --only overhead [--quick] [--device cuda]
"""

from __future__ import annotations

import contextlib
import io
import statistics
import tempfile
import time
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

from benchmarks.common import record, sync
from lightning_memkit.callbacks import PeakMemoryMonitor
from lightning_memkit.demo import ByteTextDataModule, TinyLM

THREADS = 1  # one intra-op thread: stable ratios on a shared 2-core machine
BASELINE = "no callback"
_N_VAR = 4  # variants, one step each per round: step i runs variant i % 4
_FIT_HOOKS = ("setup", "teardown", "on_fit_start", "on_fit_end", "on_train_start", "on_train_end",
              "on_train_epoch_start", "on_train_epoch_end", "on_exception")
_STEP_HOOKS = ("on_train_batch_start", "on_train_batch_end", "on_before_backward", "on_after_backward",
               "on_before_optimizer_step", "on_before_zero_grad")


class _Rotate(Callback):
    """Runs step ``i`` under ``variants[i % len(variants)]`` and times it."""

    def __init__(self, variants: list[tuple[str, Callback | None]], device: str):
        self.variants = variants
        self.device = device
        self.times: list[tuple[int, str, float]] = []  # (global step, variant, seconds)
        self._step = 0
        self._t0 = 0.0

    def _active(self) -> Callback | None:
        return self.variants[self._step % len(self.variants)][1]

    def _all(self, hook: str, *args: Any, **kwargs: Any) -> None:
        for _, cb in self.variants:
            if cb is not None:
                getattr(cb, hook)(*args, **kwargs)

    def _one(self, hook: str, *args: Any, **kwargs: Any) -> None:
        cb = self._active()
        if cb is not None:
            getattr(cb, hook)(*args, **kwargs)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._step = trainer.global_step
        sync(self.device)
        self._t0 = time.perf_counter()
        self._one("on_train_batch_start", trainer, pl_module, batch, batch_idx)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._one("on_train_batch_end", trainer, pl_module, outputs, batch, batch_idx)
        sync(self.device)
        name = self.variants[self._step % len(self.variants)][0]
        self.times.append((self._step, name, time.perf_counter() - self._t0))


def _forward(kind: str, hook: str):
    def method(self, *args, **kwargs):
        getattr(self, kind)(hook, *args, **kwargs)

    method.__name__ = hook
    return method


for _hook in _FIT_HOOKS:
    setattr(_Rotate, _hook, _forward("_all", _hook))
for _hook in _STEP_HOOKS[2:]:
    setattr(_Rotate, _hook, _forward("_one", _hook))


def _profiler(every: int, first: int, out_dir: str) -> Callback | None:
    try:
        from lightning_memkit.callbacks import SavedTensorProfiler
    except ImportError:
        return None
    return SavedTensorProfiler(every_n_steps=every, first_step=first, output_dir=out_dir)


def run(device: str = "cpu", quick: bool = False) -> list[dict]:
    before = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    try:
        return [_case(device, quick)]
    finally:
        torch.set_num_threads(before)


def _case(device: str, quick: bool) -> dict:
    torch.manual_seed(0)
    cuda = device.startswith("cuda")
    model_kw, data_kw, rounds = _sizes(quick, cuda)
    sample = PeakMemoryMonitor().cpu_sample_every_n_steps
    times, profiler = _fit(device, model_kw, data_kw, rounds, sample)
    ratios, raw = _ratios(times, cuda, sample, profiler)
    rows, goal, met = _rows(ratios, raw, 1 if cuda else sample, cuda, profiler)
    label = "TinyLM " + ("d_model=64 n_layers=2" if quick else "d_model=128 n_layers=4")
    case = (f"{label}, batch {data_kw[0]}x{data_kw[1]}, Trainer.fit on {device}, {torch.get_num_threads()} "
            f"thread(s), {rounds - 1} rounds of 4 interleaved steps")
    return record("overhead", case, f"{BASELINE} (the step just before, same round)", rows, goal=goal, met=met)


def _sizes(quick: bool, cuda: bool) -> tuple[dict, tuple[int, int], int]:
    """TinyLM keyword arguments, ``(batch size, sequence length)`` and the number of rounds."""
    if quick:
        return {"d_model": 64, "n_layers": 2, "n_heads": 2, "seq_len": 64}, (8, 64), 12
    return {}, ((64, 128) if cuda else (16, 128)), 32


def _fit(device: str, model_kw: dict, data_kw: tuple[int, int], rounds: int,
         sample: int) -> tuple[list[tuple[int, str, float]], Callback | None]:
    """One fit of ``rounds`` rounds of the variants: the step times and the profiler (``None`` if absent)."""
    with tempfile.TemporaryDirectory() as out_dir:
        # the profiler's slot is 3: it profiles steps 3, 3 + 16, ... and skips the others in its slot
        profiler = _profiler(4 * _N_VAR, 3, out_dir)
        variants = [
            (BASELINE, None),
            (f"PeakMemoryMonitor() (1 in {sample} steps measured on CPU)", PeakMemoryMonitor(verbose=False)),
            ("PeakMemoryMonitor(cpu_sample_every_n_steps=1)",
             PeakMemoryMonitor(cpu_sample_every_n_steps=1, verbose=False)),
            ("SavedTensorProfiler", profiler),
        ]
        rotate = _Rotate(variants, device)
        trainer = L.Trainer(
            accelerator="gpu" if device.startswith("cuda") else "cpu", devices=1, max_steps=rounds * _N_VAR,
            logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            limit_val_batches=0, callbacks=[rotate], default_root_dir=out_dir,
        )
        model = TinyLM(**model_kw)
        data = ByteTextDataModule(batch_size=data_kw[0], seq_len=data_kw[1], max_bytes=400_000)
        with contextlib.redirect_stdout(io.StringIO()):  # the profiler prints its table
            trainer.fit(model, data)
    return rotate.times, profiler


def _step_key(step: int, slot: int, cuda: bool, sample: int, profiler: Callback | None) -> str:
    """The kind of a step in a callback's slot (1, 2 or 3)."""
    if slot == 1:  # the monitor's k-th batch is measured when k % sample == 0 (every batch on CUDA)
        return "default measured" if cuda or ((step - 1) // _N_VAR) % sample == 0 else "default unmeasured"
    if slot == 2:
        return "every step"
    return "profiled" if profiler is not None and profiler.should_profile(step) else "not profiled"


def _ratios(times: list[tuple[int, str, float]], cuda: bool, sample: int,
            profiler: Callback | None) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Per kind of step, the ratios to the baseline step of the same round and the raw times (warm-up left out)."""
    by_step = {step: t for step, _, t in times}
    ratios: dict[str, list[float]] = {}
    raw: dict[str, list[float]] = {BASELINE: []}
    for step, t in sorted(by_step.items()):
        slot = step % _N_VAR
        if step < _N_VAR:  # first round: warm-up
            continue
        if slot == 0:
            raw[BASELINE].append(t)
            continue
        key = _step_key(step, slot, cuda, sample, profiler)
        ratios.setdefault(key, []).append(t / by_step[step - slot])
        raw.setdefault(key, []).append(t)
    return ratios, raw


def _rows(ratios: dict[str, list[float]], raw: dict[str, list[float]], n: int, cuda: bool,
          profiler: Callback | None) -> tuple[list[dict], str, bool | None]:
    """The result rows (median times and ratios), the goal text and whether it is met."""
    med = {k: statistics.median(v) for k, v in ratios.items()}
    rows = [{"impl": BASELINE, "steps": len(raw[BASELINE]), "time_s": round(statistics.median(raw[BASELINE]), 4),
             "time_vs_baseline": 1.0}]

    def row(impl: str, key: str) -> None:
        if key in ratios:
            rows.append({"impl": impl, "steps": len(ratios[key]), "time_s": round(statistics.median(raw[key]), 4),
                         "time_vs_baseline": round(med[key], 3)})

    row("PeakMemoryMonitor(cpu_sample_every_n_steps=1): every step measured", "every step")
    row(f"PeakMemoryMonitor(): its measured steps (1 in {n})", "default measured")
    row("PeakMemoryMonitor(): its unmeasured steps", "default unmeasured")
    goal, met = "", None
    if "every step" in med and (cuda or "default unmeasured" in med):
        amortized, direct = _amortized(ratios, med, n, cuda)
        rows.append({"impl": f"PeakMemoryMonitor() amortized: (every-step ratio + {n - 1} x unmeasured) / {n}",
                     "steps": "", "time_s": "", "time_vs_baseline": round(amortized, 3),
                     "mean_ratio_over_its_steps": round(direct, 3)})
        goal = f"PeakMemoryMonitor() with its default sampling <= 1.05x the step time (amortized {amortized:.3f})"
        met = amortized <= 1.05
    if profiler is None:
        rows.append({"impl": "SavedTensorProfiler (not importable: not measured)"})
    else:
        row(f"SavedTensorProfiler(every_n_steps={profiler.every_n_steps}): profiled step", "profiled")
        row("SavedTensorProfiler: other steps", "not profiled")
    return rows, goal, met


def _amortized(ratios: dict[str, list[float]], med: dict[str, float], n: int, cuda: bool) -> tuple[float, float]:
    """The monitor's default cost per step amortized over its sampling interval ``n``, and the plain mean of
    the ratios over all of its steps."""
    unmeasured = med["every step"] if cuda else med["default unmeasured"]
    amortized = (med["every step"] + (n - 1) * unmeasured) / n
    direct = statistics.fmean(ratios.get("default measured", []) + ratios.get("default unmeasured", []))
    return amortized, direct
