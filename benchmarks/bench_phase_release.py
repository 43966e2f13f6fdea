"""PhaseMemoryRelease: what a finished fit still holds with and without the release, and what it costs.

Case 1 (after fit): TinyLM is fit for a few steps on ``ByteTextDataModule`` inside an outer ``LivePeak``;
the bytes created during the fit and still alive afterwards are compared with the model's own
parameter bytes (the pre-fit baseline the user keeps), with no callback and with
``PhaseMemoryRelease()``. ``LivePeak`` counts every device, so on CUDA this includes what Lightning's
teardown moved back to the CPU.

Case 2 (cycles): three fit -> test cycles on the same model with ``PhaseMemoryRelease(after=("fit", "test"))``,
new ``Trainer`` per phase (K-fold / sweep style). For each phase the peak of live bytes (counted from before
the first fit, so anything left over from earlier phases shows) and the live bytes after each cycle.

Case 3 (cost): wall time of the same fit with no callback, ``PhaseMemoryRelease(measure=False)`` (release
only) and ``PhaseMemoryRelease()`` (release plus the LivePeak held over the whole phase), interleaved;
ratio = median of the per-round ratios. The release's fixed cost (a full ``gc.collect``, the device cache)
is paid once per phase, so the ratio shrinks as fits get longer; ``extra_s_per_fit`` is the absolute cost.

    python -m benchmarks.run --only phase_release [--quick] [--device cuda]
"""

from __future__ import annotations

import contextlib
import gc
import io
import logging
import statistics

import lightning as L
import torch

from benchmarks.common import record, time_once
from lightning_memkit.callbacks import PhaseMemoryRelease
from lightning_memkit.demo import ByteTextDataModule, TinyLM
from lightning_memkit.memory import LivePeak

THREADS = 1  # one intra-op thread: stable ratios on a shared 2-core machine


class _EvalLM(TinyLM):
    def test_step(self, batch, batch_idx):
        return self.validation_step(batch, batch_idx)


def _shapes(quick: bool) -> dict:
    if quick:
        return dict(model=dict(d_model=64, n_layers=2, n_heads=2, seq_len=64), batch=8, seq=64, samples=32)
    return dict(model=dict(d_model=128, n_layers=4, n_heads=4, seq_len=128), batch=16, seq=128, samples=160)


def _model(shapes: dict) -> _EvalLM:
    torch.manual_seed(0)
    return _EvalLM(**shapes["model"])


def _data(shapes: dict) -> ByteTextDataModule:
    dm = ByteTextDataModule(batch_size=shapes["batch"], seq_len=shapes["seq"], max_bytes=400_000,
                            samples_per_epoch=shapes["samples"])
    dm.setup("fit")
    return dm


def _trainer(device: str, callbacks: list) -> L.Trainer:
    return L.Trainer(max_epochs=1, accelerator="cuda" if device.startswith("cuda") else "cpu", devices=1,
                     logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     num_sanity_val_steps=0, limit_val_batches=2, callbacks=callbacks)


@contextlib.contextmanager
def _quiet():
    loggers = [logging.getLogger(n) for n in ("lightning.pytorch", "lightning.fabric")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.WARNING)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _param_bytes(model: torch.nn.Module) -> int:
    return sum(t.untyped_storage().nbytes() for t in [*model.parameters(), *model.buffers()])


def _after_fit_case(device: str, quick: bool) -> dict:
    shapes = _shapes(quick)
    dm = _data(shapes)
    rows, ok = [], True
    for name, make in (("no callback", lambda: []), ("PhaseMemoryRelease()", lambda: [PhaseMemoryRelease()])):
        model = _model(shapes)
        baseline = _param_bytes(model)
        with _quiet(), LivePeak() as lp:
            _trainer(device, make()).fit(model, dm)
        gc.collect()
        rows.append({"impl": name, "model_bytes": baseline, "alive_after_fit_bytes": lp.live_bytes,
                     "alive_vs_model": round(lp.live_bytes / baseline, 4), "fit_peak_bytes": lp.peak_bytes})
        if name != "no callback":
            ok = lp.live_bytes <= 0.01 * baseline
    steps = shapes["samples"] // shapes["batch"]
    case = f"TinyLM {shapes['model']} batch {shapes['batch']}, {steps} steps + 2 val batches on {device}"
    return record("phase_release", case, "no callback", rows,
                  goal="after fit + release, bytes left from the fit <= 1% of the model's own bytes", met=ok)


def _cycles_case(device: str, quick: bool) -> dict:
    shapes = _shapes(quick)
    dm = _data(shapes)
    model = _model(shapes)
    release = PhaseMemoryRelease(after=("fit", "test"))
    rows = []
    with _quiet(), LivePeak() as lp:
        for cycle in range(3):
            row = {"impl": f"cycle {cycle + 1}"}
            for phase in ("fit", "test"):
                lp.reset_peak()
                trainer = _trainer(device, [release])
                if phase == "fit":
                    trainer.fit(model, dm)
                else:
                    trainer.test(model, dataloaders=dm.val_dataloader(), verbose=False)
                row[f"{phase}_peak_bytes"] = lp.peak_bytes
                del trainer
            gc.collect()
            row["alive_after_cycle_bytes"] = lp.live_bytes
            rows.append(row)
    first = rows[0]
    for row in rows:
        row["fit_peak_vs_first"] = round(row["fit_peak_bytes"] / first["fit_peak_bytes"], 4)
        row["test_peak_vs_first"] = round(row["test_peak_bytes"] / first["test_peak_bytes"], 4)
    met = all(r["fit_peak_vs_first"] <= 1.02 and r["test_peak_vs_first"] <= 1.02 for r in rows)
    case = f"TinyLM {shapes['model']}: 3 x (fit, test) on {device}, PhaseMemoryRelease(after=('fit', 'test'))"
    return record("phase_release", case, "the first cycle", rows,
                  goal="no accumulation: every phase's peak <= 1.02x the first cycle's", met=met)


def _cost_case(device: str, quick: bool) -> dict:
    shapes = _shapes(quick)
    dm = _data(shapes)
    variants = [("no callback", lambda: []), ("PhaseMemoryRelease(measure=False)",
                                              lambda: [PhaseMemoryRelease(measure=False)]),
                ("PhaseMemoryRelease()", lambda: [PhaseMemoryRelease()])]
    times: dict[str, list[float]] = {name: [] for name, _ in variants}
    rounds = 2 if quick else 3
    with _quiet():
        _trainer(device, []).fit(_model(shapes), dm)  # warm-up
        for r in range(rounds):
            order = variants if r % 2 == 0 else variants[::-1]
            for name, make in order:
                model, callbacks = _model(shapes), make()
                fit = _trainer(device, callbacks).fit
                times[name].append(time_once(lambda fit=fit, model=model: fit(model, dm), device))
    base = times["no callback"]
    rows = [{"impl": name, "fit_time_s": round(statistics.median(t), 3),
             "extra_s_per_fit": round(statistics.median(a - b for a, b in zip(t, base)), 3),
             "time_vs_baseline": round(statistics.median(a / b for a, b in zip(t, base)), 3)}
            for name, t in times.items()]
    case = f"wall time of the fit of case 1 on {device}, {torch.get_num_threads()} thread(s), {rounds} rounds"
    return record("phase_release", case, "no callback", rows)


def run(device: str = "cpu", quick: bool = False) -> list[dict]:
    before = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    try:
        return [_after_fit_case(device, quick), _cycles_case(device, quick), _cost_case(device, quick)]
    finally:
        torch.set_num_threads(before)
