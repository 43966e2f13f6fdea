"""MicroBatchSplit: the same losses as the batch in one piece (padded batches, uneven splits, accumulation), the loader
and the validation batches untouched, the module's hooks given back, and out-of-memory steps recovered with the
losses of an uninterrupted run."""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch
from step_faults import OOM, WHERE, InjectOOM, StepLosses

from lightning_memkit.callbacks import MicroBatchSplit
from lightning_memkit.callbacks.micro_batch_split import StepRetriesExhausted
from lightning_memkit.demo import ByteTextDataModule, HFCausalLM, TinyLM, VariableLengthDataModule

STEPS = 4


class ValRows(pl.Callback):
    def __init__(self) -> None:
        self.rows: list[int] = []

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        self.rows.append(len(batch[0]))


def _fit(kind: str, *callbacks, accumulate: int = 1, val: bool = False, steps: int = STEPS):
    pl.seed_everything(0, verbose=False)
    losses = StepLosses()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if kind == "tiny_lm":
            model = TinyLM(d_model=32, n_layers=1, n_heads=2, seq_len=32)
            data = ByteTextDataModule(batch_size=8, seq_len=32, max_bytes=50_000, samples_per_epoch=24)
        else:
            peft = {"r": 4, "target_modules": ["q_proj", "v_proj"]} if kind == "peft" else None
            model = HFCausalLM(family="llama", hidden_size=32, num_layers=1, vocab_size=256, peft_lora=peft)
            data = VariableLengthDataModule(batch_size=7, lengths=(9, 24, 16), max_bytes=50_000)
        trainer = pl.Trainer(accelerator="cpu", max_steps=steps, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                             limit_val_batches=1 if val else 0, val_check_interval=1 if val else None,
                             accumulate_grad_batches=accumulate, callbacks=[losses, *callbacks])
        trainer.fit(model, data)
    return losses, model, trainer


@pytest.fixture(scope="module")
def whole() -> dict:
    return {(kind, acc): _fit(kind, accumulate=acc)[0].steps for kind in ("tiny_lm", "llama") for acc in (1, 2)}


@pytest.mark.parametrize("kind", ["tiny_lm", "llama", "peft"])
@pytest.mark.parametrize("accumulate", [1, 2])
def test_the_same_losses_as_the_whole_batch(kind, accumulate, whole) -> None:
    split = MicroBatchSplit(max_rows=3)
    losses, model, trainer = _fit(kind, split, accumulate=accumulate)
    reference = whole[("llama" if kind == "peft" else kind, accumulate)] if kind != "peft" else None
    if reference is None:
        reference = _fit("peft", accumulate=accumulate)[0].steps
    assert losses.steps == pytest.approx(reference, abs=1e-5)  # 7 padded rows as 3 + 2 + 2: token-weighted
    assert trainer.accumulate_grad_batches == accumulate and trainer.global_step == STEPS
    assert not {"training_step", "backward", "optimizer_step", "optimizer_zero_grad"} & set(vars(model))


def test_validation_batches_and_the_loader_keep_their_size() -> None:
    rows = ValRows()
    _fit("tiny_lm", MicroBatchSplit(max_rows=2), rows, val=True, steps=2)
    assert rows.rows and set(rows.rows) == {8}


@pytest.mark.parametrize("kwargs, error, match", [
    ({"max_rows": 0}, ValueError, r"MicroBatchSplit\(max_rows=0\)"),
    ({"max_rows": 2.5}, TypeError, r"MicroBatchSplit\(max_rows=2.5\)"),
    ({"weight": "mean"}, ValueError, r"MicroBatchSplit\(weight='mean'\).*auto"),
    ({"max_retries": -1}, ValueError, r"MicroBatchSplit\(max_retries=-1\)"),
])
def test_bad_arguments_are_named(kwargs, error, match) -> None:
    with pytest.raises(error, match=match):
        MicroBatchSplit(**kwargs)


def test_manual_optimization_is_refused() -> None:
    class Manual(TinyLM):
        def __init__(self) -> None:
            super().__init__(d_model=32, n_layers=1, n_heads=2, seq_len=32)
            self.automatic_optimization = False

    trainer = pl.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[MicroBatchSplit(2)])
    with pytest.raises(ValueError, match="automatic optimization; Manual sets automatic_optimization=False"):
        trainer.fit(Manual(), ByteTextDataModule(batch_size=4, seq_len=32, max_bytes=50_000, samples_per_epoch=8))


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("accumulate", [1, 2])
def test_an_out_of_memory_step_is_recovered_with_the_same_losses(where, accumulate, whole) -> None:
    split = MicroBatchSplit(max_retries=2)
    fault = InjectOOM(where, at_step=2, micro=2 if accumulate == 2 and where != "optimizer" else 1)
    losses, _, trainer = _fit("tiny_lm", split, fault, accumulate=accumulate)
    assert fault.raised == 1 and trainer.global_step == STEPS
    assert split.recoveries == [f"step 2, {where if where != 'optimizer' else 'optimizer step'}, batch 8x32, "
                                f"8x32: micro-batches of 4 rows"]
    assert losses.steps == pytest.approx(whole[("tiny_lm", accumulate)], abs=1e-5)


def test_past_the_retry_limit_one_line_stops_the_run() -> None:
    split = MicroBatchSplit(max_retries=2)
    with pytest.raises(StepRetriesExhausted) as err:
        _fit("tiny_lm", split, InjectOOM("forward", times=3))
    assert str(err.value) == (f"MicroBatchSplit: step 2 ran out of memory in its retry (batch 8x32, 8x32) after 2 "
                              f"recovered steps: {OOM}")
    assert len(split.recoveries) == 2


def test_an_update_begun_is_not_retried() -> None:
    class HalfUpdate(pl.Callback):
        def on_train_start(self, trainer, pl_module) -> None:
            optimizer = trainer.optimizers[0]

            def step(closure=None):
                if trainer.global_step == 1:
                    closure()  # as torch.optim's step: the closure (forward, backward) first
                    with torch.no_grad():
                        next(pl_module.parameters()).add_(1.0)  # part of the update done, then the error
                    raise RuntimeError(OOM)
                return type(optimizer).step(optimizer, closure)

            optimizer.step = step

    with pytest.raises(StepRetriesExhausted, match="after the optimizer had changed a parameter or its state"):
        _fit("tiny_lm", MicroBatchSplit(max_retries=2), HalfUpdate())


def test_a_failed_optimizer_step_is_retried_only_when_it_changed_nothing():
    from lightning_memkit.callbacks.micro_batch_split import _untouched, _versions
    from lightning_memkit.memory import LivePeak

    layer = torch.nn.Linear(4, 4)
    layer(torch.randn(2, 4)).sum().backward()
    fresh = torch.optim.AdamW(layer.parameters(), foreach=False)
    seen = _versions(fresh)
    fresh.state[layer.weight]["exp_avg"] = torch.zeros_like(layer.weight)  # a first step's state, half made
    assert _untouched(fresh, seen) and len(fresh.state) == 0  # dropped: the retry makes it again

    fresh.step()
    seen = _versions(fresh)
    with torch.no_grad():
        layer.bias.add_(1.0)  # part of an update applied
    assert not _untouched(fresh, seen)
    seen = _versions(fresh)
    fresh.state[layer.weight]["exp_avg"].mul_(0.5)  # state changed
    assert not _untouched(fresh, seen)

    batched = torch.optim.AdamW(layer.parameters(), foreach=True)
    with LivePeak():  # foreach kernels do not bump the counters under a dispatch mode: never taken as untouched
        assert not _untouched(batched, _versions(batched))
    assert _untouched(batched, _versions(batched))


def test_recovery_across_processes_only_under_ddp():
    import types

    from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy

    from lightning_memkit.callbacks.micro_batch_split import _recoverable_on

    assert _recoverable_on(types.SimpleNamespace(world_size=1, strategy=FSDPStrategy()))
    assert _recoverable_on(types.SimpleNamespace(world_size=2, strategy=DDPStrategy()))
    assert not _recoverable_on(types.SimpleNamespace(world_size=2, strategy=FSDPStrategy()))


def _fit_family(family: str, *callbacks, peft: bool = False) -> list[float]:
    pl.seed_everything(0, verbose=False)
    losses = StepLosses()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lora = {"r": 4, "target_modules": ["q_proj", "v_proj"]} if peft else None
        model = HFCausalLM(family=family, hidden_size=32, num_layers=1, vocab_size=256, peft_lora=lora)
        data = VariableLengthDataModule(batch_size=7, lengths=(9, 24, 16), batches=6, max_bytes=50_000)
        trainer = pl.Trainer(accelerator="cpu", max_steps=3, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                             accumulate_grad_batches=2, callbacks=[losses, *callbacks])
        trainer.fit(model, data)
    return losses.steps


@pytest.mark.parametrize("family, where, peft", [
    ("qwen3_moe", "forward", False),
    pytest.param("gpt_oss", "backward", False, marks=pytest.mark.slow),  # a backward fault: test_budget_whole_run
    pytest.param("qwen3_moe", "forward", True, marks=pytest.mark.slow)], ids=["qwen3_moe", "gpt_oss", "peft"])
def test_moe_and_peft_models_recover_an_out_of_memory_step_with_the_same_losses(family, where, peft,
                                                                               pinned_machine) -> None:
    """MoE families (and a peft-wrapped one): the budget's recovery re-plans (micro-batches, fused loss) and runs
    the window again; the router and the experts see the same tokens, so the losses are the uninterrupted run's.
    Which plan the recovery ranks first decides the float32 rounding the losses carry (1e-4 after Adam's steps): the
    balance is pinned."""
    from lightning_memkit.callbacks import MemoryBudget

    fault, budget = InjectOOM(where, at_step=1, micro=2), MemoryBudget("1GiB")
    losses = _fit_family(family, budget, fault, peft=peft)
    assert fault.raised == 1 and budget.replans[0].why == f"out of memory in the {where}"
    assert losses == pytest.approx(_fit_family(family, peft=peft), abs=1e-4)
