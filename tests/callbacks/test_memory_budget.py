"""MemoryBudget: a plan that fits the budget over the whole fit, the same losses, a clear error when nothing fits,
and a wrong estimate caught on the first step."""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch
from step_faults import StepLosses, short_estimates

from lightning_memkit.callbacks import ActivationCheckpointing, MemoryBudget
from lightning_memkit.demo import ByteTextDataModule, HFCausalLM, TinyLM
from lightning_memkit.memory import LivePeak

STEPS = 2


def _model(kind: str) -> pl.LightningModule:
    if kind == "tiny_lm":
        return TinyLM(d_model=64, n_layers=2, n_heads=4, seq_len=64)
    return HFCausalLM(family=kind, hidden_size=64, num_layers=1, vocab_size=256)


def _fit(kind: str, *callbacks: pl.Callback) -> tuple[int, StepLosses, pl.LightningModule]:
    """The whole fit under one LivePeak opened before the model is built."""
    pl.seed_everything(0, verbose=False)
    losses = StepLosses()
    with LivePeak() as lp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = _model(kind)
        data = ByteTextDataModule(batch_size=8, seq_len=64, max_bytes=100_000, samples_per_epoch=8 * STEPS,
                                  batch_format="pairs" if kind == "tiny_lm" else "hf")
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=STEPS, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                             limit_val_batches=0, callbacks=[losses, *callbacks])
        trainer.fit(model, data)
    return lp.peak_bytes, losses, model


@pytest.fixture(scope="module")
def as_is() -> dict[str, tuple[int, list[float]]]:
    """Each model's whole-fit peak and step losses without a budget (shared by the tests of this module)."""
    out = {}
    for kind in ("tiny_lm", "llama", "qwen3_moe"):
        peak, losses, _ = _fit(kind)
        out[kind] = peak, losses.steps
    return out


@pytest.mark.parametrize("kind, fraction", [pytest.param("tiny_lm", 0.55, marks=pytest.mark.slow), ("llama", 0.6),
                                            pytest.param("qwen3_moe", 0.6, marks=pytest.mark.slow)])
def test_the_fit_stays_within_the_budget_with_the_same_losses(kind: str, fraction: float, as_is) -> None:
    peak, losses = as_is[kind]
    budget = MemoryBudget(int(peak * fraction))
    measured, got, _ = _fit(kind, budget)
    assert budget.changes, "the run as given does not fit: something must change"
    assert measured <= budget.budget_bytes, (measured, budget.budget_bytes, budget.changes)
    assert budget.measured_peak_bytes <= budget.budget_bytes and not budget.replanned
    assert got.steps == pytest.approx(losses, abs=1e-4)  # recompute, fused loss, equal micro-batches: same math


def test_the_plans_are_ranked_on_the_balance_given(monkeypatch) -> None:
    """``machine=`` wins over ``MEMKIT_MACHINE`` (and the probe); the report names the balance."""
    monkeypatch.setenv("MEMKIT_MACHINE", "h100")
    given = {"device": "a given device", "gemm_flops": {"float32": 1e9}, "memory_bytes_per_s": 1e10,
             "link_bytes_per_s": 1e9}
    budget = MemoryBudget("5MiB", allow=["micro_batch"], machine=given)
    _fit("tiny_lm", budget)
    assert budget.machine.device == budget.ranked_on == "a given device" and budget.changes
    assert "; plans ranked by step time on a given device" in budget.memory_effect()


def test_nothing_fits_raises_before_any_step() -> None:
    seen = []

    class Count(pl.Callback):
        def on_train_batch_start(self, *args) -> None:
            seen.append(1)

    with pytest.raises(ValueError, match=r"MemoryBudget\(budget=4096\): no plan fits .* smallest predicted peak is "
                                         r".* with .*activation checkpointing"):
        _fit("tiny_lm", Count(), MemoryBudget(4096))
    assert seen == []


def test_a_wrong_estimate_is_caught_on_the_first_steps_and_stops(monkeypatch, as_is) -> None:
    peak = as_is["tiny_lm"][0]
    short_estimates(monkeypatch, int(peak * 0.15))
    budget = MemoryBudget(int(peak * 0.9), allow=["fused_loss"])  # TinyLM has no HF head: nothing can change
    with pytest.raises(RuntimeError, match=r"MemoryBudget: a step peaked at .* above the budget .*batch 8x64, 8x64, "
                                           r"[\d,]+ B measured, [\d,]+ B predicted\), and re-planning between steps "
                                           r"cannot fit.*with the run as given \(allowed: fused_loss\)"):
        _fit("tiny_lm", budget)
    assert budget.measured_peak_bytes > budget.budget_bytes and not budget.replanned


def test_a_wrong_estimate_is_replanned_with_micro_batches_between_steps(monkeypatch, as_is) -> None:
    peak, losses = as_is["tiny_lm"]
    short_estimates(monkeypatch, int(peak * 0.15))
    budget = MemoryBudget(int(peak * 0.9), allow=["micro_batch"])
    _, got, _ = _fit("tiny_lm", budget)
    assert budget.replanned and "micro-batches of at most" in budget.replans[0].change
    replan = budget.replans[0]
    assert replan.measured_bytes > budget.budget_bytes and replan.shape == "8x64, 8x64"
    assert f"{replan.measured_bytes:,} B" in budget.memory_effect()
    assert got.steps == pytest.approx(losses, abs=1e-4)


def test_a_wrong_estimate_is_caught_on_the_first_step_and_replanned(monkeypatch, as_is) -> None:
    peak = as_is["tiny_lm"][0]
    short_estimates(monkeypatch, int(peak * 0.15))
    budget = MemoryBudget(int(peak * 0.9), allow=["recompute"])
    measured, _, _ = _fit("tiny_lm", budget)
    assert budget.replanned and any("activation checkpointing" in c for c in budget.changes)
    assert "re-planned at step" in budget.memory_effect()
    assert budget.measured_peak_bytes > budget.budget_bytes  # the first steps, before the re-plan


def test_an_existing_policy_is_kept_and_made_stronger(as_is) -> None:
    from lightning_memkit.demo.tiny_lm import Block

    ac = ActivationCheckpointing(policy=[Block], selective=True)
    budget = MemoryBudget(int(as_is["tiny_lm"][0] * 0.55), allow=["recompute"])
    try:
        _fit("tiny_lm", ac, budget)
    except ValueError as err:  # full recompute of the blocks may not reach 55%: the error names it
        assert "no plan fits" in str(err)
        return
    assert ac.policy == [Block]
    assert all(isinstance(m, type) for m in ac.policy)


@pytest.mark.parametrize("kwargs, error, match", [
    ({"budget": 0}, ValueError, "not a positive size"),
    ({"budget": "3 parsecs"}, ValueError, "not a positive size"),
    ({"budget": 1.5}, ValueError, r"a fraction of the device's memory, in \(0, 1\]"),
    ({"budget": True}, TypeError, "must be bytes, a size"),
    ({"budget": None}, TypeError, "must be bytes, a size"),
    ({"budget": "1GiB", "margin": 1.0}, ValueError, r"margin=...\) must be a number in \[0, 1\)"),
    ({"budget": "1GiB", "allow": ["quantization"]}, ValueError, "'quantization' not an axis; allowed: recompute"),
    ({"budget": "1GiB", "allow": "recompute"}, TypeError, "must be a list of axis names"),
    ({"budget": "1GiB", "max_retries": -1}, ValueError, "max_retries"),
    ({"budget": "1GiB", "scan_seconds": -1}, ValueError, "scan_seconds"),
    ({"budget": "1GiB", "machine": "a100"}, ValueError, r"MemoryBudget\(machine=...\) must be a preset \(h100\)"),
    ({"budget": "1GiB", "machine": {"gemm_flops": {}}}, ValueError, "machine=...\\) must be .*missing"),
])
def test_bad_arguments_are_named(kwargs, error, match) -> None:
    with pytest.raises(error, match=match):
        MemoryBudget(**kwargs)


def test_sizes_and_fractions() -> None:
    assert MemoryBudget("24GiB").budget == 24 * 2**30
    assert MemoryBudget(4096).budget == 4096 and MemoryBudget(0.5).budget == 0.5


def test_the_live_check_counts_what_the_step_starts_with() -> None:
    w = torch.zeros(1024)
    with LivePeak() as lp:
        assert lp.track([w, w[:10], torch.empty(0)]) == 4096
        assert lp.track([w]) == 0
        del w
        assert lp.live_bytes == 0 and lp.peak_bytes == 4096


def test_an_estimate_inside_a_live_peak_adds_nothing() -> None:
    from lightning_memkit.estimate.trace import fake_tensors

    with LivePeak() as lp:
        with fake_tensors():
            kept = torch.empty(1 << 20)  # a fake MiB, alive after the estimate
            with LivePeak() as inner:
                torch.empty(256)
        assert inner.peak_bytes == 1024  # inside the fake mode: fake storages are what it counts
        assert lp.live_bytes == lp.peak_bytes == 0 and kept.untyped_storage().nbytes() == 4 << 20


def test_the_fake_copy_allocates_nothing_real() -> None:
    from torch._subclasses.fake_tensor import FakeTensor

    from lightning_memkit.estimate.module import fake_copy
    from lightning_memkit.estimate.trace import fake_tensors

    model = _model("llama")
    with LivePeak() as lp, fake_tensors():
        copy = fake_copy(model)
    params = dict(copy.named_parameters())
    assert lp.peak_bytes == 0 and set(params) == {n for n, _ in model.named_parameters()}
    assert all(isinstance(p, torch.nn.Parameter) and isinstance(p, FakeTensor) and p.requires_grad == q.requires_grad
               and p.shape == q.shape and p.dtype == q.dtype for p, q in zip(params.values(), model.parameters()))


@pytest.mark.parametrize("budget", ["1e30", 2**80, "machine+1"])
def test_a_budget_over_the_machines_memory_is_refused_before_any_work(budget) -> None:
    from lightning_memkit.measure.device import device_total_memory

    total = device_total_memory("cpu")
    given = total + 1 if budget == "machine+1" else budget
    callback = MemoryBudget(given)
    with pytest.raises(ValueError) as err:
        _fit("llama", callback)
    line = str(err.value)
    assert line.startswith(f"MemoryBudget(budget={given!r}): ") and "\n" not in line
    assert line.endswith(f"is more than this machine's memory, {total / 2**30:.2f} GiB ({total:,} B); give at most "
                         "that, or a fraction of it such as 0.9")
    assert callback.plan is None and callback.budget_bytes is None  # nothing planned
