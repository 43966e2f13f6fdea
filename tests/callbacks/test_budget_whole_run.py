"""MemoryBudget over the whole run: planned on the longest batch (declared, scanned), the same data (a shuffled run
with a plentiful budget bitwise unchanged), out-of-memory steps recovered with the losses of an uninterrupted run,
the retry limit, and the runs it does not plan refused."""

from __future__ import annotations

import logging
import warnings

import lightning.pytorch as pl
import pytest
from step_faults import OOM, WHERE, InjectOOM, StepLosses

from lightning_memkit.callbacks import MemoryBudget
from lightning_memkit.callbacks.micro_batch_split import StepRetriesExhausted
from lightning_memkit.demo import ByteTextDataModule, HFCausalLM, TinyLM, VariableLengthDataModule
from lightning_memkit.memory import LivePeak

LENGTHS = (32, 256)  # the first batch the shortest: a plan on it would not hold for the second


def _fit_variable(*callbacks, declare: bool = True) -> tuple[int, StepLosses]:
    pl.seed_everything(0, verbose=False)
    losses = StepLosses()
    with LivePeak() as lp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = HFCausalLM(family="llama", hidden_size=64, num_layers=1, vocab_size=256)
        data = VariableLengthDataModule(batch_size=8, lengths=LENGTHS, max_bytes=60_000, declare_longest=declare)
        trainer = pl.Trainer(accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                             callbacks=[losses, *callbacks])
        trainer.fit(model, data)
    return lp.peak_bytes, losses


@pytest.fixture(scope="module")
def variable_as_is() -> tuple[int, list[float]]:
    peak, losses = _fit_variable()
    return peak, losses.steps


@pytest.mark.parametrize("declare", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["declared", "scanned"])
def test_variable_lengths_hold_sixty_percent_with_the_same_losses(declare, variable_as_is) -> None:
    peak, reference = variable_as_is
    budget = MemoryBudget(int(peak * 0.6))
    measured, losses = _fit_variable(budget, declare=declare)
    assert budget.changes and measured <= budget.budget_bytes, (measured, budget.budget_bytes, budget.changes)
    assert not budget.replanned, budget.replans  # the batch planned on was the largest: the prediction held
    assert losses.steps == pytest.approx(reference, abs=1e-4)
    assert ("longest_batch() declares" in budget.planned_on) == declare
    if not declare:
        data = VariableLengthDataModule(batch_size=8, lengths=LENGTHS, max_bytes=60_000)
        top = sorted(data._row_lengths(), reverse=True)[:8]
        assert top[0] == 256 and budget.planned_on == f"the 8 longest of all 16 samples (256 and {top[-1]} elements)"


class Shuffled(ByteTextDataModule):
    def train_dataloader(self):
        loader = super().train_dataloader()
        return type(loader)(loader.dataset, batch_size=self.batch_size, shuffle=True, drop_last=True)


def _fit(model, data, *callbacks, **trainer_args) -> tuple[StepLosses, pl.Trainer]:
    losses = StepLosses()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = pl.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, limit_val_batches=0, callbacks=[losses, *callbacks],
                             **trainer_args)
        trainer.fit(model, data)
    return losses, trainer


def _fit_shuffled(*callbacks) -> list[float]:
    pl.seed_everything(0, verbose=False)
    return _fit(HFCausalLM(family="llama", hidden_size=64, num_layers=1, vocab_size=256),
                Shuffled(batch_size=8, seq_len=32, max_bytes=50_000, samples_per_epoch=64, batch_format="hf"),
                *callbacks, max_steps=3)[0].steps


def test_a_plentiful_budget_changes_nothing_bitwise_on_shuffled_data(caplog) -> None:
    """A run that fits as given is estimated once: nothing else is searched, nothing ranked."""
    caplog.set_level(logging.INFO)
    budget = MemoryBudget("1GiB")
    assert _fit_shuffled(budget) == _fit_shuffled()  # no RNG drawn, no fused loss added to a run that fits
    assert budget.changes == [] and "plan: the run as given" in budget.memory_effect()
    estimates = [r.getMessage() for r in caplog.records if r.getMessage().startswith("MemoryBudget: estimate ")]
    assert len(estimates) == 1 and estimates[0].startswith("MemoryBudget: estimate 1/")
    assert budget.ranked_on == "" and "ranked" not in budget.memory_effect()


def _fit_tiny(*callbacks) -> tuple[StepLosses, pl.Trainer]:
    pl.seed_everything(0, verbose=False)
    return _fit(TinyLM(d_model=64, n_layers=2, n_heads=4, seq_len=32),
                ByteTextDataModule(batch_size=8, seq_len=32, max_bytes=50_000, samples_per_epoch=80), *callbacks,
                max_steps=5, accumulate_grad_batches=2)


@pytest.fixture(scope="module")
def tiny_as_is() -> list[float]:
    return _fit_tiny()[0].steps


@pytest.mark.parametrize("where", [w if w == "forward" else pytest.param(w, marks=pytest.mark.slow) for w in WHERE])
def test_an_out_of_memory_step_is_replanned_and_rerun_with_the_same_losses(where, tiny_as_is) -> None:
    budget = MemoryBudget("1GiB")
    fault = InjectOOM(where, at_step=3, micro=2 if where != "optimizer" else 1)  # the window's second micro-batch
    losses, trainer = _fit_tiny(budget, fault)
    assert fault.raised == 1 and trainer.global_step == 5
    replan = budget.replans[0]
    where_words = "optimizer step" if where == "optimizer" else where
    assert (replan.step, replan.shape, replan.why) == (3, "8x32, 8x32", f"out of memory in the {where_words}")
    assert replan.measured_bytes is None and replan.change != "the plan holds"
    assert losses.steps == pytest.approx(tiny_as_is, abs=1e-4)
    assert f"re-planned at step 3, batch 8x32, 8x32: out of memory in the {where_words}" in budget.memory_effect()


@pytest.mark.slow  # its twin in the fast suite: test_micro_batch_split's past-the-retry-limit test
def test_a_third_error_past_the_retry_limit_stops_with_one_line() -> None:
    budget = MemoryBudget("1GiB", max_retries=2)
    with pytest.raises(StepRetriesExhausted) as err:
        _fit_tiny(budget, InjectOOM("forward", at_step=3, times=3))
    assert str(err.value) == (f"MicroBatchSplit: step 3 ran out of memory in its retry (batch 8x32, 8x32) after 2 "
                              f"recovered steps: {OOM}")
    assert len(budget.replans) == 2


def test_no_retry_when_asked_for_none() -> None:
    with pytest.raises(RuntimeError, match="DefaultCPUAllocator"):
        _fit_tiny(MemoryBudget("1GiB", max_retries=0), InjectOOM("backward", at_step=1))


def _fit_tiny_resumable(dirpath, max_steps, *callbacks, ckpt_path=None) -> tuple[StepLosses, pl.Trainer]:
    """Two optimizer steps per epoch (4 batches, 2 accumulated), a checkpoint after every step."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    pl.seed_everything(0, verbose=False)
    losses = StepLosses()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                             limit_val_batches=0, max_steps=max_steps, accumulate_grad_batches=2,
                             callbacks=[losses, *callbacks,
                                        ModelCheckpoint(dirpath=dirpath, save_last=True, every_n_train_steps=1)])
        trainer.fit(TinyLM(d_model=64, n_layers=2, n_heads=4, seq_len=32),
                    ByteTextDataModule(batch_size=8, seq_len=32, max_bytes=50_000, samples_per_epoch=32),
                    ckpt_path=ckpt_path)
    return losses, trainer


@pytest.mark.slow  # a budgeted fit resumed in the fast suite: test_resume_features
def test_a_resumed_run_keeps_the_plan_it_was_re_planned_to(tmp_path) -> None:
    """A re-plan at step 3 (an out-of-memory error) is in the checkpoint of step 4: the resumed run trains with it
    from its first step, with the losses of the run that never stopped, and does not re-plan."""
    straight = MemoryBudget("1GiB")
    reference, _ = _fit_tiny_resumable(tmp_path / "straight", 6, straight, InjectOOM("forward", at_step=3, micro=2))
    first = MemoryBudget("1GiB")
    before, _ = _fit_tiny_resumable(tmp_path / "run", 4, first, InjectOOM("forward", at_step=3, micro=2))
    assert first.replanned and first.plan.plan == straight.plan.plan
    resumed = MemoryBudget("1GiB")
    after, _ = _fit_tiny_resumable(tmp_path / "run", 6, resumed, ckpt_path="last")
    assert resumed.plan.plan == first.plan.plan and not resumed.replanned
    assert resumed.changes == [first.replans[0].change]
    assert before.steps + after.steps == pytest.approx(reference.steps, abs=1e-6)
