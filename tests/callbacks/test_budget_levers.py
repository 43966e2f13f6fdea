"""MemoryBudget pulls the new levers where they fit: activation offload, the optimizer step in backward, the
optimizer state on the host (allowed by default: the same losses), each alone; a lever the Trainer refuses is
said in one line and left out."""

from __future__ import annotations

import logging
import warnings

import lightning.pytorch as pl
import pytest
from step_faults import StepLosses

from lightning_memkit.callbacks import MemoryBudget
from lightning_memkit.demo import ByteTextDataModule, HFCausalLM, TinyLM
from lightning_memkit.memory import LivePeak

STEPS = 3
SHAPES = {  # activations dominate / parameters dominate the step
    "activations": dict(d_model=64, n_layers=2, seq_len=64, batch_size=8),
    "parameters": dict(d_model=192, n_layers=2, seq_len=8, batch_size=2),
}


def _fit(shape: str, *callbacks: pl.Callback, family: str | None = None, **trainer: object):
    """The whole fit under one LivePeak opened before the model is built: peak, step losses."""
    s = SHAPES[shape]
    pl.seed_everything(0, verbose=False)
    losses = StepLosses()
    with LivePeak() as lp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if family is None:
            model = TinyLM(d_model=s["d_model"], n_layers=s["n_layers"], n_heads=4, seq_len=s["seq_len"])
        else:
            model = HFCausalLM(family=family, hidden_size=s["d_model"], num_layers=s["n_layers"], vocab_size=256)
        data = ByteTextDataModule(batch_size=s["batch_size"], seq_len=s["seq_len"], max_bytes=100_000,
                                  samples_per_epoch=s["batch_size"] * STEPS,
                                  batch_format="pairs" if family is None else "hf")
        pl.Trainer(accelerator="cpu", devices=1, max_steps=STEPS, logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                   callbacks=[losses, *callbacks], **trainer).fit(model, data)
    return lp.peak_bytes, lp.host_peak_bytes, losses.steps


MODELS = {"tiny": ("activations", None), "llama": ("activations", "llama"), "wide": ("parameters", None)}


@pytest.fixture(scope="module")
def as_is() -> dict:
    return {key: _fit(shape, family=family) for key, (shape, family) in MODELS.items()}


CASES = [  # lever, model, budget as a fraction of the run as given, the words of the change, bitwise
    ("offload_activations", "tiny", 0.75, "activation offload to host memory (ActivationOffloading)", True),
    ("offload_activations", "llama", 0.75, "activation offload to host memory (ActivationOffloading)", True),
    ("optimizer_in_backward", "wide", 0.9, "optimizer step in backward (OptimizerInBackward)", False),
    ("offload_optimizer", "tiny", 0.9, "optimizer state on the host (OffloadOptimizer)", False),
]


@pytest.mark.parametrize("lever, key, fraction, words, bitwise", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_each_lever_alone_fits_with_the_losses_of_the_run_without_it(lever, key, fraction, words, bitwise, as_is):
    peak, _, losses = as_is[key]
    budget = MemoryBudget(int(peak * fraction), allow=[lever])
    shape, family = MODELS[key]
    measured, host, got = _fit(shape, budget, family=family)
    assert budget.changes == [words]
    assert measured <= budget.budget_bytes < peak
    assert abs(measured / budget.plan.peak_bytes - 1) <= 0.05  # the estimate of the lever's step
    if lever != "optimizer_in_backward":
        assert host > 0  # what left the device is counted as host memory
    if bitwise:
        assert got == losses
    else:
        assert got == pytest.approx(losses, abs=1e-6)


def test_a_lever_the_trainer_refuses_is_said_in_one_line_and_left_out(caplog):
    """The step in backward cannot take accumulated or clipped gradients: with only that lever allowed the budget
    says so and, nothing else being allowed, no plan fits."""
    caplog.set_level(logging.INFO)
    with pytest.raises(ValueError, match="no plan fits"):
        _fit("parameters", MemoryBudget(10_000, allow=["optimizer_in_backward"]), accumulate_grad_batches=2)
    said = [r.getMessage() for r in caplog.records if "lever is off" in r.getMessage()]
    assert said == ["MemoryBudget: the optimizer_in_backward lever is off: accumulate_grad_batches=2: each backward "
                    "steps the parameters at once"]
    caplog.clear()
    with pytest.raises(ValueError, match="no plan fits"):
        _fit("parameters", MemoryBudget(10_000, allow=["optimizer_in_backward"]), gradient_clip_val=1.0)
    said = [r.getMessage() for r in caplog.records if "lever is off" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("MemoryBudget: the optimizer_in_backward lever is off: gradient "
                                                 "clipping (gradient_clip_val=1.0)")


@pytest.mark.parametrize("key", ["tiny", "llama"])
def test_the_host_offload_is_planned_under_accumulation_and_its_estimate_holds(key):
    """With accumulate_grad_batches=2 the gradients accumulate on the device and leave it at the step: the plan's
    estimate is the fit's peak within 1% and the losses are those of the run without it."""
    shape, family = MODELS[key]
    peak, _, losses = _fit(shape, family=family, accumulate_grad_batches=2)
    budget = MemoryBudget(int(peak * 0.95), allow=["offload_optimizer"])
    measured, host, got = _fit(shape, budget, family=family, accumulate_grad_batches=2)
    assert budget.changes == ["optimizer state on the host (OffloadOptimizer)"]
    assert measured <= budget.budget_bytes and host > 0
    assert abs(measured / budget.plan.peak_bytes - 1) <= 0.01
    assert got == pytest.approx(losses, abs=1e-6)
