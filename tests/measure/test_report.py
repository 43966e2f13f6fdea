"""Static memory table, the per-feature memory lines and progress of long work, against independent counts."""

import logging
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from torch import nn

from lightning_memkit.callbacks import (
    ActivationCheckpointing,
    AllocatorWarmupGuard,
    FusedLinearCrossEntropy,
    MXFP4CheckpointLoader,
    PhaseMemoryRelease,
    StageBoundaryRelease,
)
from lightning_memkit.callbacks.activation_checkpointing import plan_message
from lightning_memkit.common import progress as progress_module
from lightning_memkit.common.progress import WorkProgress, progress_enabled
from lightning_memkit.measure.report import memory_effects, static_memory_table
from lightning_memkit.memory import plan_checkpointing, release_optimizer_state, stage_boundary


def nbytes(t):
    return t.numel() * t.element_size()


# -- static table ----------------------------------------------------------------------------------------------
class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 8)
        self.body = nn.Linear(8, 8)
        self.head = nn.Linear(8, 50, bias=False)
        self.head.weight = self.emb.weight  # tied
        self.norm = nn.BatchNorm1d(8)  # buffers: running mean/var, num_batches_tracked
        self.scale = nn.Parameter(torch.ones(8, dtype=torch.float64))  # the module's own parameter


def test_tied_parameters_count_once_and_rows_add_up():
    model = Tied()
    table = static_memory_table(model)
    rows = {r.name: r for r in table.rows}
    assert list(rows) == ["emb", "body", "head", "norm", "(root)"]
    assert rows["emb"].param_bytes == 50 * 8 * 4 and rows["head"].param_bytes == 0  # held by emb
    assert rows["(root)"].param_bytes == 8 * 8 and rows["(root)"].dtypes == ["float64"]
    assert rows["norm"].buffer_bytes == 2 * 8 * 4 + 8  # float running stats + int64 counter
    unique = {id(p): p for p in model.parameters()}.values()  # nn.Module.parameters() dedups ties too
    assert table.total.param_bytes == sum(nbytes(p) for p in unique)
    assert table.total.trainable == sum(p.numel() for p in unique) and table.total.frozen == 0
    assert table.optimizer_source == "none" and table.total.optimizer_bytes == 0
    assert "no optimizer" in table.notes[0]


def test_optimizer_state_expected_before_the_step_equals_allocated_after_it():
    model = nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 4))
    model[2].requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    before = static_memory_table(model, opt)
    assert before.optimizer_source == "expected" and before.grad_source == "expected"
    model(torch.randn(2, 32)).sum().backward()
    opt.step()
    after = static_memory_table(model, [opt])
    assert after.optimizer_source == "allocated" and after.grad_source == "allocated"
    assert before.total.optimizer_bytes == after.total.optimizer_bytes == release_optimizer_state(opt)
    assert after.total.grad_bytes == nbytes(model[0].weight) + nbytes(model[0].bias)
    assert after.rows[2].optimizer_bytes == 0 and after.rows[2].frozen == 16 * 4 + 4


def test_sgd_momentum_expected_state_and_unknown_optimizer():
    model = nn.Linear(10, 10)
    sgd = static_memory_table(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    assert sgd.total.optimizer_bytes == 110 * 4  # one momentum buffer per element

    class Custom(torch.optim.SGD):
        pass

    table = static_memory_table(model, Custom(model.parameters(), lr=0.1))
    assert table.total.optimizer_bytes is None and table.total.total_bytes is None
    assert "Custom" in table.notes[0] and "n/a" in str(table)


def test_bitsandbytes_weights_count_their_packed_storage():
    from lightning_memkit.plugins import NoSaveBitsandbytesPrecision

    for mode, dtype in (("nf4", "float32"), ("nf4-dq", "bfloat16"), ("int8", "float16")):
        plugin = NoSaveBitsandbytesPrecision(mode, dtype, lora_rank=2)
        model = plugin.convert_module(nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 64)))
        table = static_memory_table(model)
        for i in (0, 2):
            w = model[i].weight
            qs = getattr(w, "quant_state", None)
            if qs is not None:  # packed bytes, absmax, code, and the nested state of double quantization
                extra = [qs.absmax, qs.code] + ([qs.offset, qs.state2.absmax, qs.state2.code] if qs.nested else [])
            else:
                extra = [w.SCB]
            expected = w.untyped_storage().nbytes() + sum(t.untyped_storage().nbytes() for t in extra)
            # bias, LoRA (the layer's uint8 parameters hold the quant state's bytes, counted above)
            expected += sum(nbytes(p) for p in model[i].parameters() if p is not w and p.is_floating_point())
            assert table.rows[i].param_bytes == expected, mode
            assert table.rows[i].frozen == 64 * 32 + model[i].bias.numel()  # logical weight elements, bias
        # the effect line: dense bytes in dtype minus packed bytes with quant state
        dense = sum(64 * 32 * plugin.dtype.itemsize for _ in (0, 2))
        packed = sum(table.rows[i].param_bytes - sum(nbytes(p) for p in model[i].parameters()
                                                     if p.is_floating_point()) for i in (0, 2))
        line = plugin.memory_effect()
        assert f"{dense:,} bytes dense" in line and f"{packed:,} bytes packed" in line
        assert f"{dense - packed:,} bytes saved" in line


def test_bad_arguments():
    with pytest.raises(TypeError, match=r"static_memory_table\(module=...\) must be a torch.nn.Module, got str"):
        static_memory_table("model")
    with pytest.raises(TypeError, match=r"static_memory_table\(optimizer=...\) must be None, a torch.optim.Optimizer"):
        static_memory_table(nn.Linear(2, 2), optimizer="adamw")


# -- feature lines -------------------------------------------------------------------------------------------------
def test_stage_boundary_release_line_counts_the_released_bytes():
    callback = StageBoundaryRelease()
    a = torch.randn(64, 8, requires_grad=True)
    callback.on_train_batch_start(None, None, None, 0)
    h = a * 2
    y = torch.zeros(4, 8).index_add(0, torch.arange(64) % 4, h)
    stage_boundary(h, consumers=y)
    y.sum().backward()
    callback.on_train_batch_end(None, None, None, None, 0)
    assert callback.memory_effect() == (
        f"StageBoundaryRelease: {64 * 8 * 4:,} bytes freed early (1 tensors released before their layer's backward, "
        "over all steps)"
    )
    assert StageBoundaryRelease(enabled=False).memory_effect() == "StageBoundaryRelease: disabled (enabled=False)"


class AdamLinear(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(16, 8)

    def training_step(self, batch, batch_idx):
        return self.net(batch).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters())

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.randn(4, 16), batch_size=2)


def _trainer(callbacks, **kw):
    args = dict(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                enable_model_summary=False, callbacks=callbacks)
    args.update(kw)
    return L.Trainer(**args)


def test_phase_release_line_matches_the_static_table():
    release = PhaseMemoryRelease(measure=False)
    model = AdamLinear()
    trainer = _trainer([release])
    assert "nothing released yet" in release.memory_effect()
    trainer.fit(model)
    fresh = AdamLinear()
    expected = static_memory_table(fresh, torch.optim.AdamW(fresh.parameters()))
    result = release.results[-1]
    assert result.optimizer_state_bytes == expected.total.optimizer_bytes  # 2 x 544 bytes + 2 steps
    assert result.grad_bytes == expected.total.grad_bytes == (16 * 8 + 8) * 4
    freed = expected.total.optimizer_bytes + expected.total.grad_bytes
    assert memory_effects(trainer) == [
        f"PhaseMemoryRelease: after fit: {freed:,} bytes freed (optimizer state {expected.total.optimizer_bytes:,}, "
        f"gradients {expected.total.grad_bytes:,}), device cache 0 bytes returned"
    ]


def test_activation_checkpointing_lines():
    plan = plan_checkpointing({"a": 30, "b": 50}, baseline_peak=200, budget_bytes=160)
    assert "budget 160 bytes NOT reached with this plan: step peak measured 170 bytes" in plan_message(plan, 170)
    fine = plan_message(plan, 140)
    assert "within the budget of 160 bytes" in fine and "NOT" not in fine and "prediction" not in fine
    over = plan_checkpointing({"a": 30, "b": 50}, baseline_peak=200, budget_bytes=160)
    over.predicted_peak = 180  # the model overestimates; the measured peak is what counts
    assert "the prediction 180 bytes is above the budget, the measured peak decides" in plan_message(over, 150)
    assert ActivationCheckpointing().memory_effect() == "ActivationCheckpointing: no layer recomputed"


def test_activation_checkpointing_budget_line_from_the_plan():
    from lightning_memkit.demo import TinyLM

    torch.manual_seed(0)
    model = TinyLM(d_model=32, n_layers=2, n_heads=2, seq_len=32)
    data = torch.utils.data.TensorDataset(torch.randint(0, 256, (4, 32)), torch.randint(0, 256, (4, 32)))
    probe = ActivationCheckpointing(budget_bytes=10**9)
    _trainer([probe]).fit(model, torch.utils.data.DataLoader(data, batch_size=4))
    callback = ActivationCheckpointing(budget_bytes=probe.plan.baseline_peak - 1)
    trainer = _trainer([callback])
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=4))
    plan = callback.plan
    saved = sum(plan.savings[n] for n in callback.checkpointed)
    assert saved > 0 and callback.checkpointed
    line = memory_effects(trainer)[0]
    assert f"{saved:,} activation bytes recomputed in backward instead of kept" in line
    assert f"step peak {plan.baseline_peak:,} -> {callback.measured_peak_bytes:,} bytes measured" in line


def test_fused_loss_line_counts_the_logits_not_materialized():
    from lightning_memkit.demo.hf_models import tiny_hf_causal_lm

    class HFModule(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = tiny_hf_causal_lm("llama", seed=0, num_layers=1, hidden_size=32, vocab_size=128)

        def training_step(self, batch, batch_idx):
            return self.model(input_ids=batch, labels=batch).loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    callback = FusedLinearCrossEntropy()
    tokens = torch.randint(0, 128, (6, 3, 10))  # 3 batches of 3 x 10 tokens
    trainer = _trainer([callback], max_steps=2)
    assert callback.memory_effect().startswith("FusedLinearCrossEntropy: no forward call")
    trainer.fit(HFModule(), torch.utils.data.DataLoader(tokens.view(-1, 10), batch_size=3))
    per_call = 3 * 10 * 128 * 4  # tokens x vocab x fp32
    counts = (callback.fused_calls, callback.max_logits_bytes, callback.logits_bytes_avoided)
    assert counts == (2, per_call, 2 * per_call)
    assert f"{per_call:,} bytes per call at most" in memory_effects(trainer)[0]


def test_allocator_warmup_line_states_the_decision():
    guard = AllocatorWarmupGuard(mode="off")
    assert guard.memory_effect() == "AllocatorWarmupGuard: not active (no setup ran)"
    guard.setup(SimpleNamespace(is_global_zero=False), None, "fit")
    try:
        assert guard.memory_effect() == f"AllocatorWarmupGuard: {guard.decision.reason}; 0 warmup calls during setup"
        assert "skipped" in guard.decision.reason
    finally:
        guard.teardown(None, None, "fit")


def test_mxfp4_loader_line_reports_the_measured_load_peak(tmp_path, caplog):
    from safetensors.torch import save_file

    class Target(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 4)

        def training_step(self, batch, batch_idx):
            return self.a(batch).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    save_file({"a.weight": torch.randn(4, 4), "a.bias": torch.randn(4)}, str(tmp_path / "m.safetensors"))
    loader = MXFP4CheckpointLoader(str(tmp_path / "m.safetensors"), progress=True)
    assert loader.memory_effect() == "MXFP4CheckpointLoader: nothing loaded (no stage has started)"
    caplog.set_level(logging.INFO, logger="lightning_memkit")
    trainer = _trainer([loader], enable_progress_bar=True)
    trainer.fit(Target(), torch.utils.data.DataLoader(torch.randn(2, 4), batch_size=2))
    memory = loader.result.memory
    line = memory_effects(trainer)[0]
    assert line.startswith(f"MXFP4CheckpointLoader: 2 tensors loaded from {tmp_path / 'm.safetensors'} (0 dequantized")
    assert f"tensor storage {memory.tensor_peak_bytes:,} bytes" in line
    # progress: one line per tensor, explicit progress=True needs no terminal
    assert "loading m.safetensors: 1/2 a.bias" in caplog.text and "loading m.safetensors: 2/2 a.weight" in caplog.text


def test_pipeline_line_shows_the_partition():
    from lightning_memkit.pipeline import evaluate_partition
    from lightning_memkit.strategies import MemkitPipelineStrategy

    strategy = MemkitPipelineStrategy(partition=[2, 1])
    assert strategy.memory_effect() == "memkit_pipeline: not set up (no partition)"
    strategy.partition = evaluate_partition([100, 200, 300], [2, 1], schedule="gpipe", microbatches=2)
    line = strategy.memory_effect()
    stages = ", ".join(f"{b:,}" for b in strategy.partition.stage_peak_bytes)
    assert "2 stages of [2, 1] layers" in line and f"predicted peak per stage [bytes]: {stages};" in line


def test_memory_effects_collects_only_memkit_objects():
    class Foreign:
        def memory_effect(self):
            return "not ours"

    trainer = SimpleNamespace(callbacks=[Foreign(), StageBoundaryRelease(enabled=False)],
                              precision_plugin=None, strategy=None)
    assert memory_effects(trainer) == ["StageBoundaryRelease: disabled (enabled=False)"]


# -- progress ----------------------------------------------------------------------------------------------------
def test_work_progress_logs_one_line_per_item_and_can_be_silenced(caplog):
    caplog.set_level(logging.INFO, logger="lightning_memkit")
    progress = WorkProgress("measuring", total=2)
    progress.step("a")
    progress.step("b")
    unknown = WorkProgress("probing")
    unknown.step()
    quiet = WorkProgress("quiet", total=1, enabled=False)
    quiet.step("x")
    assert [r.getMessage() for r in caplog.records] == ["measuring: 1/2 a", "measuring: 2/2 b", "probing: 1/?"]
    assert quiet.done == 1
    with pytest.raises(ValueError, match=r"WorkProgress\(total=-1\): must be an int >= 0"):
        WorkProgress("x", total=-1)
    with pytest.raises(TypeError, match=r"WorkProgress\(enabled=1\): must be a bool"):
        WorkProgress("x", enabled=1)


def test_progress_enabled_conditions(monkeypatch):
    trainer = SimpleNamespace(is_global_zero=True, progress_bar_callback=object())
    monkeypatch.setattr(progress_module, "_stderr_is_terminal", lambda: True)
    assert progress_enabled(trainer)
    assert not progress_enabled(SimpleNamespace(is_global_zero=False, progress_bar_callback=object()))
    assert not progress_enabled(SimpleNamespace(is_global_zero=True, progress_bar_callback=None))
    monkeypatch.setattr(progress_module, "_stderr_is_terminal", lambda: False)
    assert not progress_enabled(trainer) and progress_enabled(trainer, require_terminal=False)


@pytest.mark.parametrize("progress_bar", [True, False])
def test_checkpointing_planning_runs_report_progress(progress_bar, monkeypatch, caplog):
    from lightning_memkit.demo import TinyLM

    monkeypatch.setattr(progress_module, "_stderr_is_terminal", lambda: True)
    caplog.set_level(logging.INFO, logger="lightning_memkit")
    torch.manual_seed(0)
    model = TinyLM(d_model=32, n_layers=2, n_heads=2, seq_len=16)
    data = torch.utils.data.TensorDataset(torch.randint(0, 256, (4, 16)), torch.randint(0, 256, (4, 16)))
    _trainer([ActivationCheckpointing(budget_bytes=10**9)], enable_progress_bar=progress_bar).fit(
        model, torch.utils.data.DataLoader(data, batch_size=4))
    lines = [r.getMessage() for r in caplog.records if r.name == "lightning_memkit.common.progress"]
    if progress_bar:
        assert lines == ["ActivationCheckpointing planning run: 1/? (0 of 2 layers recomputed)",
                         "ActivationCheckpointing planning run: 2/? (2 of 2 layers recomputed)"]
    else:
        assert lines == []


# -- LivePeak: blocks left out of the peak, the timeline sampler ---------------------------------------------------
def test_unmeasured_block_keeps_the_outer_peak_and_counts_what_it_keeps():
    from lightning_memkit.measure.live_peak import unmeasured
    from lightning_memkit.memory import LivePeak

    samples = []
    with LivePeak() as lp:
        lp.on_change = lambda device, live: samples.append(live)
        a = torch.empty(1000, dtype=torch.uint8)
        with unmeasured():
            probe = torch.empty(50_000, dtype=torch.uint8)  # a planning run's temporary
            del probe
            kept = torch.empty(300, dtype=torch.uint8)  # created in the block and kept
        assert lp.on_change is not None  # restored
        b = torch.empty(200, dtype=torch.uint8)
        del a, b, kept
    assert lp.peak_bytes == 1500 and lp.by_device["cpu"].peak == 1500
    assert samples == [1000, 1500, 500, 300, 0]  # the block's own changes are not sampled
    assert 50_000 not in samples and max(samples) == 1500


@pytest.mark.parametrize("fused", [False, True])
def test_pipeline_measurement_pass_reports_each_layer(fused, monkeypatch, caplog):
    from lightning_memkit.demo import TinyLM
    from lightning_memkit.strategies import MemkitPipelineStrategy

    monkeypatch.setattr(progress_module, "_stderr_is_terminal", lambda: True)
    caplog.set_level(logging.INFO, logger="lightning_memkit")
    strategy = MemkitPipelineStrategy(partition="memory", microbatches=2, fused_loss=fused)
    strategy.parallel_devices = [torch.device("cpu")]  # one process: what the launcher would set
    strategy.connect(TinyLM(d_model=32, n_layers=2, n_heads=2, seq_len=16))
    strategy._plan = strategy._build_plan()
    batch = (torch.randint(0, 256, (4, 16)), torch.randint(0, 256, (4, 16)))
    monkeypatch.setattr(strategy, "_sample_batch", lambda trainer: batch)
    kwargs = dict(schedule="gpipe", microbatches=2, stages_per_rank=1)
    for rank_zero, bar in ((True, object()), (True, None), (False, object())):
        caplog.clear()
        trainer = SimpleNamespace(is_global_zero=rank_zero, progress_bar_callback=bar)
        strategy._memory_partition(trainer, strategy._plan.layers, 2, None, kwargs)
        lines = [r.getMessage() for r in caplog.records if r.name == "lightning_memkit.common.progress"]
        if rank_zero and bar is not None:
            head = "Linear (with the fused loss)" if fused else "Linear"
            assert lines == [f"memkit_pipeline measuring layer: {i}/5 {name}" for i, name in
                             enumerate(["TokenPositionEmbedding", "Block", "Block", "LayerNorm", head], 1)]
        else:
            assert lines == []
