import gc
import logging
import weakref

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from lightning_memkit.callbacks import PhaseMemoryRelease
from lightning_memkit.callbacks.phase_memory_release import MemoryRetainedError
from lightning_memkit.demo import ByteTextDataModule, TinyLM
from lightning_memkit.memory import LivePeak


class EvalLM(TinyLM):
    def test_step(self, batch, batch_idx):
        return self.validation_step(batch, batch_idx)

    def predict_step(self, batch, batch_idx):
        return self(batch[0]).argmax(-1)


class LeakyLM(EvalLM):
    def training_step(self, batch, batch_idx):
        self.kept = torch.zeros(1 << 18)  # 1 MiB created during fit and kept on the module
        return super().training_step(batch, batch_idx)


class FailingLM(EvalLM):
    def training_step(self, batch, batch_idx):
        raise ValueError("step failed")


class LossRecorder(L.Callback):
    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(outputs["loss"].item())


def make_model(cls=EvalLM):
    torch.manual_seed(0)
    return cls(d_model=32, n_layers=2, n_heads=2, seq_len=16)


def make_data():
    dm = ByteTextDataModule(batch_size=4, seq_len=16, max_bytes=20_000, samples_per_epoch=8, val_fraction=0.1)
    dm.setup("fit")
    return dm


def make_trainer(callbacks, tmp_path=None, **kw):
    args = dict(
        max_epochs=1, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=1,
        callbacks=callbacks, default_root_dir=tmp_path,
    )
    args.update(kw)
    return L.Trainer(**args)


def nbytes(tensors):
    return sum(t.untyped_storage().nbytes() for t in tensors)


def test_argument_errors():
    with pytest.raises(ValueError, match=r"after='train' has unknown phase\(s\) \['train'\]; allowed: fit, validate"):
        PhaseMemoryRelease(after="train")
    with pytest.raises(ValueError, match=r"after=\(\) has unknown phase\(s\) \(none given\)"):
        PhaseMemoryRelease(after=())
    with pytest.raises(TypeError, match="after must be a phase name or a sequence of them, got int"):
        PhaseMemoryRelease(after=3)
    with pytest.raises(ValueError, match=r"PhaseMemoryRelease\(tolerance_bytes=-1\): must be an int >= 0"):
        PhaseMemoryRelease(tolerance_bytes=-1)
    with pytest.raises(TypeError, match="strict must be a bool, got str"):
        PhaseMemoryRelease(strict="yes")


def test_fit_then_release_returns_to_the_pre_fit_baseline():
    dm = make_data()
    params = nbytes(make_model().parameters())
    retained = {}
    for name, callbacks in (("none", []), ("release", [PhaseMemoryRelease()])):
        model = make_model()
        baseline = nbytes([*model.parameters(), *model.buffers()]) + dm.train_set.data.numel()
        with LivePeak() as lp:
            make_trainer(callbacks).fit(model, dm)
        gc.collect()
        retained[name] = lp.live_bytes
    assert retained["release"] <= 0.01 * baseline
    assert retained["none"] >= 2 * params  # without the release AdamW's two moments stay reachable
    result = callbacks[0].results[0]
    n_tensors = len(list(model.parameters()))
    assert result.stage == "fit" and result.optimizer_state_bytes == 2 * params + 4 * n_tensors  # + step scalars
    assert result.retained_bytes <= retained["release"] + 4 * n_tensors
    assert result.peak_bytes > 2 * params


def test_fit_test_cycles_do_not_accumulate():
    dm = make_data()
    release = PhaseMemoryRelease(after=("fit", "test"))
    model = make_model()
    peaks = {"fit": [], "test": []}
    live = []
    with LivePeak() as lp:
        for _ in range(3):
            for phase in ("fit", "test"):
                lp.reset_peak()
                trainer = make_trainer([release])
                if phase == "fit":
                    trainer.fit(model, dm)
                else:
                    trainer.test(model, dataloaders=dm.val_dataloader(), verbose=False)
                peaks[phase].append(lp.peak_bytes)
            del trainer
            gc.collect()
            live.append(lp.live_bytes)
    for phase, values in peaks.items():
        assert all(v <= 1.02 * values[0] for v in values), (phase, values)
    assert max(live) - min(live) <= 1024, live
    assert [r.stage for r in release.results] == ["fit", "test"] * 3


def test_resume_after_release_continues_like_an_uninterrupted_run(tmp_path):
    dm = make_data()
    whole = LossRecorder()
    make_trainer([whole], max_epochs=2).fit(make_model(), dm)

    first, second = LossRecorder(), LossRecorder()
    ckpt = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    model = make_model()
    make_trainer([ckpt, PhaseMemoryRelease(), first], tmp_path, enable_checkpointing=True).fit(model, dm)
    trainer = make_trainer([PhaseMemoryRelease(), second], tmp_path, max_epochs=2)
    trainer.fit(model, dm, ckpt_path=ckpt.last_model_path)
    assert len(whole.losses) == 4
    assert first.losses + second.losses == whole.losses
    # a checkpoint written after the release would silently lose the optimizer state: refused
    with pytest.raises(RuntimeError, match="would resume with fresh optimizer state"):
        trainer.save_checkpoint(tmp_path / "after.ckpt")
    trainer.save_checkpoint(tmp_path / "weights.ckpt", weights_only=True)
    assert (tmp_path / "weights.ckpt").exists()


def test_leak_is_reported_with_its_holder(caplog):
    with caplog.at_level(logging.WARNING, logger="lightning_memkit.callbacks.phase_memory_release"):
        release = PhaseMemoryRelease(tolerance_bytes=1 << 16)
        make_trainer([release]).fit(make_model(LeakyLM), make_data())
    result = release.results[0]
    assert result.retained_bytes >= 1 << 20
    assert [r.path for r in result.report.rows if r.nbytes == 1 << 20] == ["LeakyLM.kept"]
    assert "LeakyLM.kept" in caplog.text and "still alive after the release" in caplog.text


def test_strict_raises_and_closes_the_measurement():
    with pytest.raises(MemoryRetainedError, match=r"(?s)tolerance_bytes=65536.*LeakyLM\.kept"):
        make_trainer([PhaseMemoryRelease(tolerance_bytes=1 << 16, strict=True)]).fit(make_model(LeakyLM), make_data())
    assert _get_current_dispatch_mode_stack() == []


def test_exception_during_fit_closes_the_measurement():
    release = PhaseMemoryRelease()
    with pytest.raises(ValueError, match="step failed"):
        make_trainer([release]).fit(make_model(FailingLM), make_data())
    assert _get_current_dispatch_mode_stack() == [] and release.results == []


def test_callback_does_not_keep_the_model_alive():
    release = PhaseMemoryRelease(after=("fit", "validate"), measure=False)

    def run():
        model, dm = make_model(), make_data()
        trainer = make_trainer([release])
        trainer.fit(model, dm)
        trainer.validate(model, dm, verbose=False)
        return weakref.ref(model)

    ref = run()
    gc.collect()
    assert ref() is None and [r.stage for r in release.results] == ["fit", "validate"]
    fit = release.results[0]
    assert fit.retained_bytes is None and fit.peak_bytes is None and fit.optimizer_state_bytes > 0  # measure=False


def test_predictions_handed_back_stay_intact():
    dm = make_data()
    trainer = make_trainer([PhaseMemoryRelease(after="predict")])
    preds = trainer.predict(make_model(), dataloaders=dm.val_dataloader())
    assert len(preds) == 1 and preds[0].shape == (4, 16)
    assert trainer.predict_loop._predictions == []


@pytest.mark.cuda
def test_cuda_fit_gives_the_device_back():
    dm = make_data()
    model = make_model()
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    release = PhaseMemoryRelease()
    make_trainer([release], accelerator="cuda").fit(model, dm)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() <= allocated + (1 << 20)
    assert torch.cuda.memory_reserved() - torch.cuda.memory_allocated() < 2 << 20  # cache handed back
    result = release.results[0]
    assert result.device_cache_bytes > 0
    assert result.retained_bytes <= 0.01 * nbytes(model.parameters())


def test_measurement_closes_under_a_dispatch_mode_opened_after_it():
    release = PhaseMemoryRelease()
    release.setup(None, None, "fit")  # opens the phase's LivePeak
    inner = LivePeak().__enter__()  # e.g. another callback's profiler, still open when the phase ends
    release.on_exception(None, None, RuntimeError("interrupted"))
    kept = torch.zeros(10)
    assert inner.live_bytes == 40 and release._live is None
    inner.__exit__(None, None, None)
    assert _get_current_dispatch_mode_stack() == []
    del kept
