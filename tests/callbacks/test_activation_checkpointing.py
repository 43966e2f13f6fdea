import gc
import itertools
import weakref
from types import SimpleNamespace

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy
from torch import nn

from lightning_memkit.callbacks import ActivationCheckpointing
from lightning_memkit.demo import TinyLM
from lightning_memkit.demo.tiny_lm import Block
from lightning_memkit.memory import LivePeak, checkpoint_modules

SEQ = 32


class Windows(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        x = torch.randint(0, 256, (SEQ + 1,), generator=g)
        return x[:-1], x[1:]


class Recorder(L.Callback):
    """Keeps which blocks are patched during training and what wraps the model."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.patched = ["forward" in vars(b) for b in pl_module.blocks]
        self.wrapper = type(trainer.strategy.model).__name__


def make_model(n_layers=3):
    torch.manual_seed(0)
    return TinyLM(d_model=32, n_layers=n_layers, n_heads=2, seq_len=SEQ)


def loader():
    return torch.utils.data.DataLoader(Windows(), batch_size=4)


def fit(model, callbacks, steps=2, **kw):
    args = dict(
        max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
    )
    args.update(kw)
    trainer = L.Trainer(**args)
    trainer.fit(model, loader())
    return trainer


def test_argument_errors():
    with pytest.raises(ValueError, match=r"ActivationCheckpointing\(budget_bytes=0\): must be an int >= 1 or None"):
        ActivationCheckpointing(policy={Block}, budget_bytes=0)
    with pytest.raises(TypeError, match="offload must be a bool, got str"):
        ActivationCheckpointing(policy={Block}, offload="yes")
    with pytest.raises(ValueError, match="'lightning_memkit.demo.tiny_lm.NoBlock' cannot be imported"):
        ActivationCheckpointing(policy=["lightning_memkit.demo.tiny_lm.NoBlock"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only error")
def test_offload_without_cuda_is_an_error():
    with pytest.raises(ValueError, match="offload=True moves saved activations from a CUDA device .* CUDA is not"):
        ActivationCheckpointing(policy={Block}, offload=True)


def test_training_with_recomputation_matches_training_without(tmp_path):
    plain = make_model()
    fit(plain, [])
    model, rec = make_model(), Recorder()
    callback = ActivationCheckpointing(policy=["lightning_memkit.demo.tiny_lm.Block"])  # class path, as in YAML
    trainer = fit(model, [callback, rec])
    assert callback.checkpointed == ["blocks.0", "blocks.1", "blocks.2"] and rec.patched == [True] * 3
    for (name, a), b in zip(plain.named_parameters(), model.parameters()):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6, msg=name)
    assert all("forward" not in vars(b) for b in model.blocks)  # restored at teardown
    assert "log" not in vars(callback)  # Lightning's callback.log would keep the model alive
    trainer.save_checkpoint(tmp_path / "m.ckpt")
    keys = list(torch.load(tmp_path / "m.ckpt", weights_only=False)["state_dict"])
    assert keys == list(make_model().state_dict())
    ref = weakref.ref(model)
    del model, trainer, rec
    gc.collect()
    assert ref() is None  # the callback (still alive here) does not keep the model
    assert callback.checkpointed == ["blocks.0", "blocks.1", "blocks.2"]


def test_policy_matching_nothing_lists_the_model_classes():
    with pytest.raises(ValueError, match=r"policy=\{Conv2d\} matched no submodule of TinyLM; .*tiny_lm\.Block"):
        fit(make_model(), [ActivationCheckpointing(policy={nn.Conv2d})])


def _measured_peak(model, batch, names):
    """Forward+backward peak of TinyLM's loss with the named blocks recomputed (as the callback measures it)."""
    modules = dict(model.named_modules())
    model.zero_grad(set_to_none=True)
    with checkpoint_modules([(n, modules[n]) for n in names]):
        with LivePeak() as lp:
            model._loss(batch).backward()
    model.zero_grad(set_to_none=True)
    return lp.peak_bytes


def test_budget_picks_the_fewest_blocks_that_fit():
    model = make_model(n_layers=4)
    batch = next(iter(loader()))
    names = [f"blocks.{i}" for i in range(4)]
    best = {k: min(_measured_peak(model, batch, c) for c in itertools.combinations(names, k)) for k in range(5)}
    assert best[4] < 0.5 * best[0]
    budget = best[2] + 1  # two blocks are needed (and enough); one never is
    assert best[1] > budget
    callback = ActivationCheckpointing(policy={Block}, budget_bytes=budget)
    fit(model, [callback], steps=1)
    assert len(callback.checkpointed) == 2 and callback.plan.layers == callback.checkpointed
    assert callback.measured_peak_bytes <= budget
    assert callback.measured_peak_bytes == _measured_peak(model, batch, callback.checkpointed)
    assert callback.plan.baseline_peak == best[0]


def test_budget_below_anything_reachable_states_the_best_peak():
    model = make_model(n_layers=2)
    best = _measured_peak(model, next(iter(loader())), ["blocks.0", "blocks.1"])
    with pytest.raises(ValueError, match=f"budget_bytes=1000 cannot be reached: the best achievable peak is {best} "):
        fit(model, [ActivationCheckpointing(policy={Block}, budget_bytes=1000)], steps=1)
    assert all("forward" not in vars(b) for b in model.blocks)


def test_fsdp_with_its_own_policy_is_refused_not_doubled():
    """FSDP runs the callback (tests/callbacks/test_callbacks_fsdp.py), but not on top of FSDP's own recompute."""
    callback = ActivationCheckpointing(policy={Block})
    callback.setup(SimpleNamespace(strategy=FSDPStrategy()), make_model(), "fit")  # accepted
    trainer = SimpleNamespace(strategy=FSDPStrategy(activation_checkpointing_policy={Block}))
    with pytest.raises(ValueError, match=r"FSDPStrategy\(activation_checkpointing_policy=...\) already recomputes"):
        callback.setup(trainer, make_model(), "fit")


def test_budget_needs_automatic_optimization():
    class Manual(TinyLM):
        def __init__(self):
            super().__init__(d_model=32, n_layers=2, n_heads=2, seq_len=SEQ)
            self.automatic_optimization = False

    trainer = SimpleNamespace(strategy=SimpleNamespace())
    with pytest.raises(ValueError, match="needs automatic optimization"):
        ActivationCheckpointing(policy={Block}, budget_bytes=10**6).setup(trainer, Manual(), "fit")


@pytest.mark.timeout(180)
def test_ddp_gradients_match(monkeypatch):
    """DDP (gloo, one process in this test process): recomputation chosen by budget trains like none."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # else Lightning's DDP setup sets cpu_count threads for the run
    both = ["blocks.0", "blocks.1"]
    budget = _measured_peak(make_model(n_layers=2), next(iter(loader())), both)  # reachable with both blocks only
    models = []
    try:
        for callbacks in ([], [ActivationCheckpointing(policy={Block}, budget_bytes=budget)]):
            model, rec = make_model(n_layers=2), Recorder()
            fit(model, [*callbacks, rec], strategy=DDPStrategy())
            assert rec.wrapper == "DistributedDataParallel" and rec.patched == [bool(callbacks)] * 2
            models.append(model)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert callbacks[0].checkpointed == both and callbacks[0].measured_peak_bytes <= budget
    for other in models[1:]:
        for a, b in zip(models[0].parameters(), other.parameters()):
            torch.testing.assert_close(b, a, rtol=0, atol=1e-6)


@pytest.mark.cuda
def test_offload_on_cuda_lowers_the_device_peak_and_keeps_gradients():
    losses, peaks = [], []
    for offload in (False, True):
        model = make_model()
        callback = ActivationCheckpointing(policy=lambda name, m: name == "blocks.0", offload=offload)

        class Peak(L.Callback):
            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                self.base = torch.cuda.memory_allocated()

            def on_after_backward(self, trainer, pl_module):
                peaks.append(torch.cuda.max_memory_allocated() - self.base)

        fit(model, [callback, Peak()], steps=1, accelerator="cuda")
        losses.append([p.detach().cpu() for p in model.parameters()])
    assert peaks[1] < peaks[0]
    for a, b in zip(*losses):
        torch.testing.assert_close(b, a)
