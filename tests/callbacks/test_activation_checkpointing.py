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
from torch._dynamo.backends.registry import lookup_backend

from lightning_memkit.callbacks import ActivationCheckpointing, activation_checkpointing
from lightning_memkit.demo import TinyLM
from lightning_memkit.demo.tiny_lm import Block
from lightning_memkit.measure.allocator_peak import AllocatorPeak
from lightning_memkit.memory import LivePeak, checkpoint_modules, is_checkpointed
from lightning_memkit.recompute.plan import RecomputeCostMeter, mixed_peak

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
    with pytest.raises(TypeError, match=r"ActivationCheckpointing\(selective='yes'\): must be a bool, got str"):
        ActivationCheckpointing(policy={Block}, selective="yes")


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
    """Forward+backward peak of TinyLM's loss with the named blocks recomputed (as the callback measures it);
    ``names`` a list (full recompute) or a mapping name -> mode."""
    modules = dict(model.named_modules())
    model.zero_grad(set_to_none=True)
    modes = names if isinstance(names, dict) else dict.fromkeys(names, "full")
    with checkpoint_modules([(n, modules[n]) for n in modes], mode=modes):
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


def test_selective_training_matches_training_without():
    plain = make_model()
    fit(plain, [])
    model, rec = make_model(), Recorder()
    callback = ActivationCheckpointing(policy={Block}, selective=True)
    fit(model, [callback, rec])
    assert callback.modes == dict.fromkeys(["blocks.0", "blocks.1", "blocks.2"], "selective")
    assert rec.patched == [True] * 3
    for (name, a), b in zip(plain.named_parameters(), model.parameters()):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6, msg=name)
    assert "3 layers recomputed (blocks.0 (selective), blocks.1 (selective), blocks.2 (selective))" in (
        callback.memory_effect())


class FixedCosts(RecomputeCostMeter):
    """Measured op times are noisy (and at d_model 32 not matmul-bound): selective 1, full 3 per layer."""

    def __exit__(self, *exc):
        super().__exit__(*exc)
        self.costs = {name: {"selective": 1.0, "full": 3.0} for name in self.costs}


def test_selective_budget_uses_selective_first_and_full_only_where_needed(monkeypatch):
    monkeypatch.setattr(activation_checkpointing, "RecomputeCostMeter", FixedCosts)
    model = make_model(n_layers=4)
    batch = next(iter(loader()))
    names = [f"blocks.{i}" for i in range(4)]
    none, sel, full = (_measured_peak(model, batch, modes) for modes in
                       ({}, dict.fromkeys(names, "selective"), dict.fromkeys(names, "full")))
    assert full < sel < none
    for budget, used in ((sel + (none - sel) // 4, {"selective"}), ((sel + full) // 2, {"full", "selective"})):
        callback = ActivationCheckpointing(policy={Block}, budget_bytes=budget, selective=True)
        fit(model, [callback], steps=1)
        assert set(callback.modes.values()) <= used, callback.modes
        assert callback.plan.modes == callback.modes and callback.checkpointed == list(callback.modes)
        assert callback.measured_peak_bytes <= budget
        assert callback.measured_peak_bytes == _measured_peak(model, batch, callback.modes)
        assert callback.plan.baseline_peak == none
        assert f"{callback.plan.saved_bytes:,} activation bytes recomputed" in callback.memory_effect()
        if used == {"selective"}:  # a budget that selective recompute reaches: no block recomputed in full
            assert f"{callback.checkpointed[0]} (selective)" in callback.memory_effect()
    assert "full" in callback.modes.values()  # below the all-selective peak, full recompute is needed somewhere



def test_selective_budget_charges_a_full_recompute_after_the_later_layers_freed(monkeypatch):
    """The planner's peak model on the real step: an early block's full recompute runs after the later blocks'
    backward freed their activations, so F S S S is predicted exactly (the old charge, the full overhead on top of
    every saving, was above it); no plan is predicted below its measured peak."""
    monkeypatch.setattr(activation_checkpointing, "RecomputeCostMeter", FixedCosts)
    from lightning_memkit.recompute import budget_search

    calls, plan = [], budget_search.plan_recompute
    monkeypatch.setattr(budget_search, "plan_recompute", lambda *a, **k: calls.append((a, k)) or plan(*a, **k))
    model = make_model(n_layers=4)
    batch = next(iter(loader()))
    names = [f"blocks.{i}" for i in range(4)]
    sel = _measured_peak(model, batch, dict.fromkeys(names, "selective"))
    full = _measured_peak(model, batch, dict.fromkeys(names, "full"))
    fit(model, [ActivationCheckpointing(policy={Block}, budget_bytes=(sel + full) // 2, selective=True)], steps=1)
    (savings, baseline), kw = calls[0][0][:2], calls[0][1]
    overhead, acts = kw["recompute_overhead"], kw["activation_bytes"]
    assert list(acts) == names and all(acts[n] > savings[n]["full"] for n in names)  # inputs kept by full recompute
    assert overhead["full"] > 0
    for plan_text in ("F S S S", "F F - S", "F - S -", "S S S F", "F F F F"):
        modes = {n: m for n, m in zip(names, plan_text.split()) if m != "-"}
        modes = {n: {"F": "full", "S": "selective"}[m] for n, m in modes.items()}
        measured = _measured_peak(model, batch, modes)
        predicted = mixed_peak(savings, baseline, modes, overhead, acts)
        assert predicted >= measured, plan_text
        if plan_text.startswith("F") and plan_text != "F F F F":  # later blocks not in full: exact
            assert predicted == measured < mixed_peak(savings, baseline, modes, overhead), plan_text

# -- torch.compile -------------------------------------------------------------------------------


class CompiledStepLM(TinyLM):
    """``training_step`` without ``self.log``: Lightning 2.6 cannot log from a compiled ``training_step``."""

    def training_step(self, batch, batch_idx):
        return self._loss(batch)


class StepRecord(L.Callback):
    """Per step: the loss, which blocks are patched, and the forward+backward peak counted by the allocator."""

    def __init__(self):
        self.losses, self.patched, self.peaks = [], [], []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.counter = AllocatorPeak("cpu").__enter__()

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.counter.__exit__(None, None, None)
        self.peaks.append(self.counter.peak_bytes)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))
        self.patched.append([is_checkpointed(b) for b in pl_module.blocks])


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _compiled_fit(callbacks, backend, steps=3):
    """Fit a compiled CompiledStepLM; returns the StepRecord and the FX graphs dynamo produced."""
    graphs = []

    def recording(gm, example_inputs):
        graphs.append(gm)
        return backend(gm, example_inputs) if callable(backend) else lookup_backend(backend)(gm, example_inputs)

    torch.manual_seed(0)
    model = CompiledStepLM(d_model=32, n_layers=2, n_heads=2, seq_len=SEQ)
    rec = StepRecord()
    fit(torch.compile(model, backend=recording), [*callbacks, rec], steps=steps)
    return rec, graphs


@pytest.fixture(scope="module")
def plain_aot_eager():
    """The compiled fit without the callback (aot_eager, 3 steps): the reference of the aot_eager tests below."""
    torch._dynamo.reset()
    try:
        return _compiled_fit([], "aot_eager")
    finally:
        torch._dynamo.reset()


def _checkpoint_regions(graphs):
    hop = torch.ops.higher_order.tag_activation_checkpoint
    return sum(node.target is hop for gm in graphs for node in gm.graph.nodes)


@pytest.mark.parametrize("backend", [pytest.param("aot_eager", marks=pytest.mark.slow),
                                     pytest.param("inductor", marks=pytest.mark.slow)])
def test_compiled_model_trains_with_selective_and_full_recompute(backend, fresh_dynamo, request):
    """Recompute traced into the compiled graph (one checkpoint region per block), same losses, lower peak."""
    torch.manual_seed(0)
    eager = StepRecord()
    fit(CompiledStepLM(d_model=32, n_layers=2, n_heads=2, seq_len=SEQ), [eager])
    plain, graphs = request.getfixturevalue("plain_aot_eager") if backend == "aot_eager" else _compiled_fit([], backend)
    assert _checkpoint_regions(graphs) == 0
    for selective in (True, False):
        callback = ActivationCheckpointing(policy={Block}, selective=selective)
        rec, graphs = _compiled_fit([callback], backend)
        assert rec.patched == [[True, True]] * 3 and _checkpoint_regions(graphs) == 2
        assert set(callback.modes.values()) == {"selective" if selective else "full"}
        for a, b in zip(rec.losses, eager.losses):
            assert abs(a - b) <= 1e-5
        assert rec.peaks[-1] < plain.peaks[-1]


def test_compiled_budget_is_planned_on_the_compiled_step(plain_aot_eager, fresh_dynamo):
    plain, _ = plain_aot_eager
    budget = plain.peaks[-1] - 1024  # a step after the first (gradients kept from the step before)
    callback = ActivationCheckpointing(policy={Block}, budget_bytes=budget, selective=True)
    rec, graphs = _compiled_fit([callback], "aot_eager", steps=2)
    assert callback.modes and callback.measured_peak_bytes <= budget
    # the planning run measured the compiled step: the first step (gradients allocated anew, as in planning)
    # agrees within a few bytes, and every step stays within the budget
    assert abs(rec.peaks[0] - callback.measured_peak_bytes) <= 1e-3 * budget
    assert max(rec.peaks) <= budget
    assert _checkpoint_regions(graphs[-1:]) == len(callback.modes)  # the last graph compiled is the plan's
