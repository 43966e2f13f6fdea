"""MemoryBudget on resume: the checkpoint's plan, estimated once instead of a search, where it still fits; planned
again where it does not."""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_memkit.callbacks import MemoryBudget
from lightning_memkit.demo import ByteTextDataModule, HFCausalLM
from lightning_memkit.estimate.module import ModuleRun


def _fit(root, budget: MemoryBudget, steps: int, ckpt_path=None) -> pl.Trainer:
    pl.seed_everything(0, verbose=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = pl.Trainer(accelerator="cpu", max_steps=steps, logger=False, default_root_dir=root,
                             enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                             callbacks=[budget, ModelCheckpoint(dirpath=root, save_last=True)])
        trainer.fit(HFCausalLM(family="llama", hidden_size=64, num_layers=1, vocab_size=256),
                    ByteTextDataModule(batch_size=8, seq_len=64, max_bytes=100_000, samples_per_epoch=32,
                                       batch_format="hf"), ckpt_path=ckpt_path)
    return trainer


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    """A fit of 2 steps under a budget that needs a plan, with its last checkpoint."""
    root = tmp_path_factory.mktemp("planned")
    budget = MemoryBudget("4MiB", allow=["recompute", "fused_loss", "micro_batch"])
    _fit(root, budget, 2)
    assert budget.changes, "the budget must need a plan for this test to mean anything"
    return root, budget


def _counting(monkeypatch) -> list[int]:
    calls: list[int] = []
    estimate = ModuleRun.estimate
    monkeypatch.setattr(ModuleRun, "estimate", lambda self, plan: calls.append(1) or estimate(self, plan))
    return calls


def test_a_resume_keeps_the_checkpoints_plan_with_one_estimate(planned, monkeypatch) -> None:
    root, first = planned
    calls = _counting(monkeypatch)
    budget = MemoryBudget("4MiB", allow=["recompute", "fused_loss", "micro_batch"])
    budget.resume_from = str(root / "last.ckpt")
    trainer = _fit(root, budget, 4, ckpt_path=root / "last.ckpt")
    assert trainer.global_step == 4
    assert budget.plan.plan == first.plan.plan and budget.changes == first.changes
    assert len(calls) == 1 and not budget.replanned


def test_a_checkpoints_plan_over_a_smaller_budget_is_planned_again(planned, monkeypatch, caplog) -> None:
    root, first = planned
    calls = _counting(monkeypatch)
    budget = MemoryBudget(int(first.plan.peak_bytes * 0.9), allow=["recompute", "fused_loss", "micro_batch"])
    budget.resume_from = str(root / "last.ckpt")
    with caplog.at_level("INFO"):
        _fit(root, budget, 4, ckpt_path=root / "last.ckpt")
    assert "over the budget now: planning again" in caplog.text
    assert len(calls) > 1 and budget.plan.peak_bytes * 1.05 <= budget.budget_bytes


def test_without_a_checkpoint_path_it_searches(tmp_path, monkeypatch) -> None:
    calls = _counting(monkeypatch)
    budget = MemoryBudget("4MiB", allow=["recompute", "fused_loss", "micro_batch"])
    budget.resume_from = str(tmp_path / "missing.ckpt")  # nothing there: a plain search
    _fit(tmp_path, budget, 1)
    assert len(calls) > 1 and budget.changes
