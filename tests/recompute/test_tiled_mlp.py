"""Tiled MLP against the untiled one: the same loss, the same gradients to float32 rounding, and a measured peak at
least one MLP intermediate (per layer, less a tile) lower, for dense, mixture-of-experts, Gemma and peft-wrapped
models, with recomputation and under QLoRA; the callback over a fit."""

from __future__ import annotations

import pytest
import torch

from lightning_memkit.memory import LivePeak
from lightning_memkit.recompute.tiled_mlp import mlp_targets, tiled_mlps

pytest.importorskip("transformers")
TILE = 64


def build(case: str):
    from lightning_memkit.demo.hf_models import tiny_hf_causal_lm

    family = {"peft": "llama"}.get(case, case)
    model = tiny_hf_causal_lm(family, seed=0, hidden_size=64, num_layers=2)
    if case == "peft":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "up_proj", "down_proj"]))
    return model


def step(model, tokens: int, tile: int | None) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
    """One forward and backward of one sequence of ``tokens``: the loss, the gradients and the measured peak."""
    ids = torch.randint(0, 256, (1, tokens), generator=torch.Generator().manual_seed(0))
    model.zero_grad(set_to_none=True)
    with LivePeak() as live, tiled_mlps(model, tile) if tile else _nothing():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, live.peak_bytes


def _nothing():
    import contextlib

    return contextlib.nullcontext()


def intermediate_rows_bytes(model, tokens: int) -> int:
    """The bytes of one MLP intermediate of every layer beyond a tile: ``(tokens - tile) x intermediate`` float32
    values per layer (a dense MLP), ``top_k`` times as many rows over the experts (a mixture of experts)."""
    config = model.config
    layers = len(mlp_targets(model))
    if getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None):
        width = config.moe_intermediate_size if hasattr(config, "moe_intermediate_size") else config.intermediate_size
        rows = (tokens - TILE) * config.num_experts_per_tok
        return layers * rows * width * 4
    return layers * (tokens - TILE) * config.intermediate_size * 4


def assert_same(plain, tiled) -> None:
    assert torch.equal(plain[0], tiled[0])  # each token's MLP output is computed by the same ops
    assert sorted(plain[1]) == sorted(tiled[1])
    for name, grad in plain[1].items():  # the tiles' weight gradients are summed in another order
        torch.testing.assert_close(tiled[1][name], grad, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("case", ["llama", "qwen3_moe", "gemma3_text", "peft"])
def test_a_tiled_mlp_trains_as_the_untiled_one_with_less_memory(case):
    model = build(case)
    tokens = 1024
    plain, tiled = step(model, tokens, None), step(model, tokens, TILE)
    assert_same(plain, tiled)
    assert plain[2] - tiled[2] >= intermediate_rows_bytes(model, tokens)
    assert "forward" not in next(m for _, m, _ in mlp_targets(model)).__dict__  # restored


@pytest.mark.slow
@pytest.mark.parametrize("case", ["llama", "qwen3_moe"])
def test_at_8k_tokens(case):
    model = build(case)
    plain, tiled = step(model, 8192, None), step(model, 8192, TILE)
    assert_same(plain, tiled)
    assert plain[2] - tiled[2] >= intermediate_rows_bytes(model, 8192)


def test_the_targets_are_dense_mlps_or_a_moe_blocks_experts_and_shared_experts():
    from lightning_memkit.demo.hf_models import tiny_hf_causal_lm

    kinds = {f: [(n.split(".mlp")[-1], k) for n, _, k in mlp_targets(tiny_hf_causal_lm(f, seed=0))][-2:]
             for f in ("llama", "qwen3_moe", "qwen2_moe")}
    assert kinds["llama"] == [("", "dense"), ("", "dense")]
    assert kinds["qwen3_moe"] == [(".experts", "experts"), (".experts", "experts")]
    assert kinds["qwen2_moe"] == [(".experts", "experts"), (".shared_expert", "dense")]


def test_it_composes_with_recomputation_and_qlora():
    """Inside a recomputed decoder layer (transformers' gradient checkpointing) and on nf4 layers with LoRA adapters:
    the untiled run's loss and gradients."""
    from lightning_memkit.plugins import NoSaveBitsandbytesPrecision

    model = build("llama")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    assert_same(step(model, 512, None), step(model, 512, TILE))
    torch.manual_seed(0)
    quantized = NoSaveBitsandbytesPrecision("nf4", torch.float32, lora_rank=4).convert_module(build("llama"))
    assert_same(step(quantized, 512, None), step(quantized, 512, TILE))


def test_a_recomputed_layer_keeps_no_more_for_backward_tiled():
    """Between forward and backward, a recomputed model's tiled MLPs keep nothing beyond what its checkpoints keep:
    the tiles' inputs are autograd's saved tensors (which the layer's checkpoint drops), not references of their
    own (one such reference per layer once kept a (tokens x hidden) tensor alive through a whole step)."""
    model = build("llama")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    ids = torch.randint(0, 256, (1, 512), generator=torch.Generator().manual_seed(0))
    kept = []
    for tile in (None, TILE):
        with LivePeak() as live, tiled_mlps(model, tile) if tile else _nothing():
            loss = model(input_ids=ids, labels=ids).loss
            kept.append(live.live_bytes)
            loss.backward()
    assert kept[1] == kept[0]


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_an_estimate_runs_a_few_tiles_for_all(family):
    """On fake tensors one tile stands for the alike ones (in backward the last full tile runs apart, its
    gradients added to the first's): the MLPs run as often at 32 tiles as at 8."""
    from benchmarks.bench_estimate import Case, loss_fn, make_batch, model_factory
    from lightning_memkit.estimate.levers.tiled_mlp import tiled_mlps_inside
    from lightning_memkit.memory import estimate_training_memory

    def calls(tokens: int) -> int:
        case, seen = Case(family, ("tiled",), seq=tokens, rows=1), []

        def build():
            model = model_factory(case)()
            for _, target, _ in mlp_targets(model):
                target.register_forward_pre_hook(lambda *_: seen.append(1))  # the experts: once per tile
                for linear in target.modules():
                    if isinstance(linear, torch.nn.Linear):
                        linear.register_forward_pre_hook(lambda *_: seen.append(1))
            return model

        estimate_training_memory(build, lambda: make_batch(case), loss_fn=loss_fn(case), patches=[tiled_mlps_inside])
        return len(seen)

    assert calls(32 * 64) == calls(8 * 64)


TILED_CASES = [("llama", ("checkpoint", "fused", "tiled")), ("llama", ("qlora", "checkpoint", "tiled")),
               ("qwen3_moe", ("checkpoint", "fused", "tiled")), ("qwen3_moe", ("qlora", "checkpoint", "tiled"))]


@pytest.mark.parametrize(("family", "features"),
                         [TILED_CASES[0], *(pytest.param(*c, marks=pytest.mark.slow) for c in TILED_CASES[1:])],
                         ids=lambda v: "+".join(v) if isinstance(v, tuple) else v)
def test_a_tiled_estimate_predicts_the_measured_peak(family, features):
    """The estimate of a tiled step (16 tiles, a few of them traced) is the peak a real Trainer step measures."""
    from benchmarks.bench_estimate import Case, compare

    result = compare(Case(family, features, seq=1024, rows=1))
    assert abs(result["predicted"] - result["measured"]) <= 8, result


def test_an_mlp_with_dropout_draws_the_same_masks_in_its_recompute():
    """Each tile is computed again in backward with the random state forward had: with dropout in the MLP (training
    mode) the tiled gradients are the untiled ones, and the generator ends where the untiled run leaves it."""
    from torch import nn

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.drop, self.down = nn.Linear(16, 64), nn.Dropout(0.5), nn.Linear(64, 16)

        def forward(self, x):
            return self.down(self.drop(torch.relu(self.up(x))))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = MLP()

        def forward(self, x):
            return x + self.mlp(x)

    torch.manual_seed(0)
    net = nn.Sequential()
    net.layers = nn.ModuleList([Block(), Block()])
    net.forward = lambda x: net.layers[1](net.layers[0](x))
    x = torch.randn(2, 100, 16)

    def run(tile):
        net.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        with tiled_mlps(net, tile) if tile else _nothing():
            loss = net(x).pow(2).mean()
            loss.backward()
        return loss.detach(), {n: p.grad for n, p in net.named_parameters()}, torch.rand(1)

    (plain, grads, after), (tiled, tiled_grads, tiled_after) = run(None), run(32)
    assert torch.equal(plain, tiled) and torch.equal(after, tiled_after)
    for name, grad in grads.items():
        torch.testing.assert_close(tiled_grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)


def test_bad_tiles_and_models_without_an_mlp_are_refused():
    from lightning_memkit.callbacks import TiledMLP

    with pytest.raises(ValueError, match=r"^TiledMLP\(tile_tokens=0\)"):
        TiledMLP(tile_tokens=0)
    with pytest.raises(ValueError, match=r"^tiled_mlps: Linear has no decoder layer or repeated block"):
        with tiled_mlps(torch.nn.Linear(2, 2), 8):
            pass


def fit(callbacks: list, family: str = "llama") -> tuple[list[float], object]:
    """Three steps of a tiny transformers model with ``callbacks``: the losses and the module."""
    import lightning.pytorch as pl

    from lightning_memkit.demo import ByteTextDataModule, HFCausalLM

    losses: list[float] = []

    class Record(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(outputs["loss"].item())

    module = HFCausalLM(family, hidden_size=64, num_layers=2, seed=0)
    pl.seed_everything(0)
    pl.Trainer(accelerator="cpu", max_steps=3, logger=False, enable_checkpointing=False, enable_progress_bar=False,
               enable_model_summary=False, callbacks=[Record(), *callbacks]).fit(
        module, ByteTextDataModule(batch_size=2, seq_len=64, batch_format="hf"))
    return losses, module


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_it_composes_with_recomputation_activation_offload_and_the_fused_loss_in_a_fit(family):
    from lightning_memkit.callbacks import (
        ActivationCheckpointing,
        ActivationOffloading,
        FusedLinearCrossEntropy,
        TiledMLP,
    )

    def others():
        return [ActivationCheckpointing(), ActivationOffloading(), FusedLinearCrossEntropy()]

    plain, tiled = fit(others(), family)[0], fit([*others(), TiledMLP(tile_tokens=16)], family)[0]
    assert tiled == pytest.approx(plain, rel=1e-6, abs=1e-6)


def test_the_callback_tiles_a_fit_and_undoes_it_after():
    from lightning_memkit.callbacks import TiledMLP

    tiling = TiledMLP(tile_tokens=16)
    plain, (tiled, module) = fit([])[0], fit([tiling])
    assert tiled == pytest.approx(plain, rel=1e-6, abs=1e-6)
    assert tiling.tokens == 16 and tiling.tiled == ["model.model.layers.0.mlp", "model.model.layers.1.mlp"]
    assert all("forward" not in m.__dict__ for _, m, _ in mlp_targets(module))  # undone at teardown
    assert TiledMLP().tile_tokens == "auto"


def test_the_lever_estimates_the_tiled_step_and_writes_the_callback(tmp_path):
    """``tiled_mlp`` (opt-in): its choices are tiles of 4 and 1 times the hidden size shorter than the sequence;
    the fake step of a tiled plan peaks at least one MLP intermediate per layer (beyond the tile) below the untiled
    one, lower the smaller the tile, and costs more FLOPs (each tile recomputed in backward); its YAML names the
    callback with the tile; ``memkit estimate`` leaves it out unless allowed."""
    from lightning_memkit.demo.hf_models import tiny_hf_config
    from lightning_memkit.estimate.hf_run import HFRun
    from lightning_memkit.estimate.levers.base import Written
    from lightning_memkit.estimate.levers.tiled_mlp import TILED_MLP

    path = tmp_path / "config.json"
    config = tiny_hf_config("llama", hidden_size=64, num_layers=2, vocab_size=256)
    path.write_text(config.to_json_string())
    run = HFRun(path, seq_len=1024, batch_size=1, precision="32-true", allow=("tiled_mlp",), device="cpu")
    assert TILED_MLP.options(run.base["tiled_mlp"], run) == [False, 256, 64]
    plain = run.estimate(run.base)
    peaks = [run.estimate(run.base.replace(tiled_mlp=t)).peak_bytes for t in (256, 64)]
    assert plain.peak_bytes - peaks[1] >= 2 * (1024 - 64) * config.intermediate_size * 4
    assert plain.peak_bytes > peaks[0] >= peaks[1]
    assert run.estimate(run.base.replace(tiled_mlp=64)).step_flops > plain.step_flops
    out = Written()
    TILED_MLP.write_hf(run.base.replace(tiled_mlp=64), run, out)
    assert out.callbacks == [{"class_path": "lightning_memkit.callbacks.TiledMLP", "init_args": {"tile_tokens": 64}}]
    assert TILED_MLP.opt_in and not HFRun(path, seq_len=64, batch_size=1).allows("tiled_mlp")


@pytest.mark.slow
def test_the_planner_takes_the_largest_tile_the_budget_allows(tmp_path):
    """A wide MLP (intermediate 32 x hidden), every layer recomputed as given: the smaller the tile, the lower the
    peak. At a budget between the peaks of 256- and 64-token tiles the search's plan tiles by 64; at one above the
    256-token tile's peak, by 256 (the larger tile: less work)."""
    from lightning_memkit.demo.hf_models import tiny_hf_config
    from lightning_memkit.estimate.hf_run import HFRun
    from lightning_memkit.estimate.plans import search_plans

    path = tmp_path / "config.json"
    path.write_text(tiny_hf_config("llama", hidden_size=64, num_layers=2, vocab_size=256,
                                   intermediate_size=2048).to_json_string())
    run = HFRun(path, seq_len=2048, batch_size=1, precision="32-true", activation_checkpointing=True,
                allow=("tiled_mlp",), device="cpu")
    peak = {t: run.estimate(run.base.replace(tiled_mlp=t)).peak_bytes for t in (256, 64)}
    assert peak[256] > peak[64]
    for budget, tile in ((int((peak[256] + peak[64]) / 2 * 1.05), 64), (int(peak[256] * 1.06), 256)):
        plan = search_plans(run, budget, max_plans=1).fitting[0].plan
        assert plan["tiled_mlp"] == tile, plan


def test_the_tiled_mlp_is_planned_with_sharding(tmp_path):
    """Tiles run inside FSDP2's units (checked against gloo ranks in tests/sharding/test_fsdp2_estimate.py): a run
    on 2 devices tries sharded plans with tiled MLPs."""
    from lightning_memkit.demo.hf_models import tiny_hf_config
    from lightning_memkit.estimate.hf_run import HFRun
    from lightning_memkit.estimate.levers.sharding import SHARDING
    from lightning_memkit.estimate.levers.tiled_mlp import TILED_MLP

    path = tmp_path / "config.json"
    path.write_text(tiny_hf_config("llama", hidden_size=64, num_layers=2, vocab_size=256).to_json_string())
    run = HFRun(path, seq_len=1024, batch_size=1, allow=("tiled_mlp", "sharding"), device="cpu", devices=2)
    plan = run.base.replace(sharding="full_shard", tiled_mlp=64)
    assert TILED_MLP.runs_sharded and not SHARDING.conflicts(plan, run)


def test_memory_budget_pulls_the_tiled_mlp_when_allowed():
    """``MemoryBudget(allow=["tiled_mlp"])`` at a budget the untiled run exceeds: it adds ``TiledMLP`` and the fit
    stays within the budget and its prediction (the module's weights, built before the measurement, not counted
    here)."""
    import lightning.pytorch as pl

    from lightning_memkit.callbacks import MemoryBudget, TiledMLP
    from lightning_memkit.demo import ByteTextDataModule, HFCausalLM

    def peak(callbacks: list) -> tuple[int, pl.Trainer]:
        module = HFCausalLM("llama", hidden_size=64, num_layers=2, seed=0)
        pl.seed_everything(0)
        trainer = pl.Trainer(accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks)
        with LivePeak() as live:
            trainer.fit(module, ByteTextDataModule(batch_size=1, seq_len=1024, batch_format="hf"))
        return live.peak_bytes, trainer

    budget = int(peak([])[0] * 0.85)
    planner = MemoryBudget(budget, allow=["tiled_mlp"])
    measured, trainer = peak([planner])
    assert any(isinstance(c, TiledMLP) for c in trainer.callbacks)
    assert measured <= budget and measured <= planner.plan.peak_bytes
    assert planner.plan.peak_bytes * 1.05 <= budget


@pytest.mark.slow
@pytest.mark.parametrize("family", ["mistral", "qwen2", "qwen3", "mixtral", "gemma2", "phi3", "qwen2_moe", "olmoe",
                                    "deepseek_v3", "gpt_oss"])
def test_every_family_trains_tiled_as_untiled(family):
    """The other tiny families (dense, mixture-of-experts, with shared experts): the same loss and gradients in tiles
    of 64 tokens, and a lower measured peak."""
    model = build(family)
    plain, tiled = step(model, 512, None), step(model, 512, TILE)
    assert_same(plain, tiled)
    assert tiled[2] < plain[2]


def test_a_qlora_moe_step_tiled_is_estimated(tmp_path):
    """The estimator's expert routing sees each tile of a QLoRA mixture-of-experts block (the tiles are called
    through the experts module's hooks, in forward and in their recompute): the tiled step is estimated, lower."""
    from lightning_memkit.demo.hf_models import tiny_hf_config
    from lightning_memkit.estimate.hf_run import HFRun

    path = tmp_path / "config.json"
    path.write_text(tiny_hf_config("qwen3_moe", hidden_size=64, num_layers=2, vocab_size=256).to_json_string())
    run = HFRun(path, seq_len=1024, batch_size=1, precision="bf16-true", plugin="nf4-lora",
                allow=("tiled_mlp", "recompute"), device="cpu")
    plain, tiled = (run.estimate(run.base.replace(recompute="full", tiled_mlp=t)).peak_bytes for t in (False, 64))
    assert tiled < plain
