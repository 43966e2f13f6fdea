"""Every single-device feature on every tiny transformers family of ``TINY_HF_FAMILIES``, against the plain model.

Each test builds the family's tiny random causal LM (``tiny_hf_causal_lm``: hidden size 64, 2 layers, 4 experts
where the family has experts) and checks behaviour, not only that it runs:

- activation checkpointing (the decoder layers ``ActivationCheckpointing`` finds, recomputed through
  ``checkpoint_modules`` with the KV cache off, full and selective): HF's loss and gradients, fewer bytes kept
  after the forward and a lower step peak (``LivePeak``);
- the fused loss (``fused_linear_cross_entropy``): HF's loss and gradients with no logits, and the router
  auxiliary loss and its gradients where the family computes one (n/a where it does not; an MoE family whose
  transformers model computes none even with ``output_router_logits=True``, DeepSeek-V3, is refused then);
- QLoRA (``NoSaveBitsandbytesPrecision("nf4", float32, lora_rank=4)``): every linear but ``lm_head`` and every
  experts module quantized, only the adapters trainable, the loss and adapter gradients of HF's model on the
  dequantized weights plus the adapters' dense update;
- ``estimate_from_hf_config`` of the family's config within 5% of ``LivePeak``'s peak of the same step run in a
  ``Trainer`` (plain, recompute with the fused loss, QLoRA), as ``tests/estimate/test_step.py`` measures it;
- ``PeakMemoryMonitor``, ``SavedTensorProfiler``, ``PhaseMemoryRelease`` and ``StageBoundaryRelease`` in a
  ``Trainer`` fit, as ``test_features_hf.py`` checks them on the demo families.

Default: full recompute, the fused loss and QLoRA on every family (a few forward and backward passes each). Slow:
selective recompute, the estimate of every family (a fake-tensor trace and a real Trainer step per case; its
default twin is ``tests/estimate/test_step.py``'s fast cases) and the Trainer fits (twin: ``test_features_hf.py``).
"""

from __future__ import annotations

import copy
import functools
import json
import warnings

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

import bitsandbytes as bnb  # noqa: E402
from hf_checks import check_measuring_callbacks, lora_weights  # noqa: E402

from benchmarks.bench_estimate import BATCH, SEQ, TOLERANCE, VOCAB, Case, measure  # noqa: E402
from lightning_memkit.demo.hf_models import TINY_HF_FAMILIES, tiny_hf_causal_lm, tiny_hf_config  # noqa: E402
from lightning_memkit.hf import QLoRAExperts, dequantized_experts, expert_modules, fused_linear_cross_entropy  # noqa: E402
from lightning_memkit.hf.layers import decoder_layers, kv_cache_off  # noqa: E402
from lightning_memkit.memory import LivePeak  # noqa: E402
from lightning_memkit.ops.lora import ExpertLoRAAdapter, LoRAAdapter  # noqa: E402
from lightning_memkit.ops.nosave_matmul import dequantize_weight  # noqa: E402
from lightning_memkit.plugins import NoSaveBitsandbytesPrecision  # noqa: E402
from lightning_memkit.recompute import checkpoint_modules  # noqa: E402

FAMILIES = list(TINY_HF_FAMILIES)
QUANTIZED_LINEAR = (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt)


def _router_aux(family: str) -> bool:
    """Whether the family's tiny config asks its model for the router auxiliary loss."""
    return bool(getattr(tiny_hf_config(family), "output_router_logits", False))


@functools.cache
def _has_experts(family: str) -> bool:
    with torch.device("meta"):  # no memory, no initialisation: only the module layout is read
        return bool(expert_modules(tiny_hf_causal_lm(family)))


def _aux_param(family: str):
    if _router_aux(family):
        return family
    what = "transformers computes no router aux loss for it" if _has_experts(family) else "dense (no router)"
    return pytest.param(family, marks=pytest.mark.skip(reason=f"n/a: {what}"))


MOE_WITHOUT_AUX = [f for f in FAMILIES if not _router_aux(f) and _has_experts(f)]


def _batch(t: int = 16, seed: int = 0) -> dict[str, torch.Tensor]:
    """Batch 2 x ``t``: random tokens, the first 3 labels of the first row ignored."""
    ids = torch.randint(0, 256, (2, t), generator=torch.Generator().manual_seed(seed))
    labels = ids.clone()
    labels[0, :3] = -100
    return {"input_ids": ids, "labels": labels}


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _loss_and_grads(model: nn.Module, batch: dict, output=lambda out: out.loss):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(5)  # the same random draws in both runs (router jitter, dropout: where a family has any)
    out = model(**batch)
    output(out).backward()
    return out, _grads(model)


def _assert_same_grads(grads: dict, ref: dict) -> None:
    assert grads.keys() == ref.keys()
    for n, g in grads.items():
        torch.testing.assert_close(g, ref[n], atol=1e-5, rtol=1e-4, msg=n)


# -- activation checkpointing -----------------------------------------------------------------------------------
def _measured_step(model: nn.Module, batch: dict) -> tuple[torch.Tensor, dict, int, int]:
    """Loss, gradients, bytes the forward leaves alive (saved activations and output) and the step's peak."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(5)
    with LivePeak() as live:
        out = model(**batch)
        kept = live.live_bytes
        out.loss.backward()
    return out.loss.detach(), _grads(model), kept, live.peak_bytes


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mode", ["full", pytest.param("selective", marks=pytest.mark.slow)])
def test_activation_checkpointing_recomputes_the_decoder_layers_with_hf_loss_and_gradients(mode, family):
    model = tiny_hf_causal_lm(family, seed=0)
    batch = _batch(t=32)  # at 16 tokens Phi3's step peak is in the head's backward, where recompute adds bytes
    layers = decoder_layers(model)
    assert [name for name, _ in layers] == ["model.layers.0", "model.layers.1"]
    with kv_cache_off(model):  # the plain step without a KV cache too: only the recompute differs
        loss, grads, kept, peak = _measured_step(model, batch)
    with kv_cache_off(model) as configs, checkpoint_modules(layers, mode) as handle:
        assert configs and model.config.use_cache is False
        assert handle.modes == dict.fromkeys(["model.layers.0", "model.layers.1"], mode)
        recomputed = _measured_step(model, batch)
    assert model.config.use_cache is True and not any("forward" in vars(m) for _, m in layers)
    torch.testing.assert_close(recomputed[0], loss, atol=1e-5, rtol=0)
    assert len(grads) == sum(1 for _ in model.parameters())
    _assert_same_grads(recomputed[1], grads)
    assert recomputed[2] < kept and recomputed[3] < peak


# -- fused loss -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_fused_loss_gives_hf_loss_and_gradients_without_logits(family):
    model = tiny_hf_causal_lm(family, seed=0)
    batch = _batch()
    for extra in ({}, {"num_items_in_batch": torch.tensor(17)}):
        ref, ref_grads = _loss_and_grads(model, {**batch, **extra})
        with fused_linear_cross_entropy(model):
            out, grads = _loss_and_grads(model, {**batch, **extra})
        assert out.logits is None and ref.logits.shape == (2, 16, 256)
        torch.testing.assert_close(out.loss, ref.loss, atol=1e-5, rtol=0)
        if not _router_aux(family):  # the n/a of the router aux loss test: HF's own output has none either
            assert getattr(ref, "aux_loss", None) is None and getattr(out, "aux_loss", None) is None
        assert len(grads) == sum(1 for _ in model.parameters())
        _assert_same_grads(grads, ref_grads)
    assert "forward" not in vars(model)


@pytest.mark.parametrize("family", [_aux_param(f) for f in FAMILIES])
def test_fused_loss_keeps_the_router_aux_loss_and_its_gradients(family):
    model = tiny_hf_causal_lm(family, seed=0)
    batch = _batch()
    ref, ref_grads = _loss_and_grads(model, batch, output=lambda out: out.aux_loss)
    with fused_linear_cross_entropy(model):
        out, grads = _loss_and_grads(model, batch, output=lambda out: out.aux_loss)
    assert float(ref.aux_loss.detach()) > 0
    torch.testing.assert_close(out.aux_loss, ref.aux_loss, atol=1e-6, rtol=0)
    assert "lm_head.weight" not in ref_grads  # the aux loss alone: from the routers back, nothing of the head
    assert any(g.abs().max() > 0 for n, g in ref_grads.items() if n.endswith((".gate.weight", ".router.weight")))
    _assert_same_grads(grads, ref_grads)


@pytest.mark.parametrize("family", MOE_WITHOUT_AUX)
def test_fused_loss_refuses_output_router_logits_where_transformers_computes_no_aux_loss(family):
    model = tiny_hf_causal_lm(family, seed=0, output_router_logits=True)
    out = model(**_batch())
    assert model.config.output_router_logits is True and out.aux_loss is None  # HF trains on the plain loss
    with pytest.raises(ValueError, match=rf"config.output_router_logits=True but transformers.models.{family}."
                                         rf"modeling_{family} has no load_balancing_loss_func to reproduce the aux"):
        with fused_linear_cross_entropy(model):
            pass
    assert "forward" not in vars(model)


# -- QLoRA ------------------------------------------------------------------------------------------------------
def _adapters(model: nn.Module) -> dict[str, nn.Module]:
    return {n: m for n, m in model.named_modules() if isinstance(m, (LoRAAdapter, ExpertLoRAAdapter))}


def _round_trip(original: nn.Module, converted: nn.Module) -> nn.Module:
    """HF's own model whose quantized weights are replaced by their dequantized copies."""
    ref = copy.deepcopy(original)
    with torch.no_grad():
        for name, m in converted.named_modules():
            if isinstance(m, QLoRAExperts):
                for proj, dense in dequantized_experts(m).items():
                    getattr(ref.get_submodule(name), proj).copy_(dense)
            elif isinstance(m, QUANTIZED_LINEAR):
                ref.get_submodule(name).weight.copy_(dequantize_weight(m, torch.float32))
    return ref


@pytest.mark.parametrize("family", FAMILIES)
def test_qlora_trains_only_the_adapters_with_the_loss_and_gradients_of_the_dequantized_model(family):
    original = tiny_hf_causal_lm(family, seed=0)
    experts = [name for name, _ in expert_modules(original)]
    model = NoSaveBitsandbytesPrecision("nf4", torch.float32, lora_rank=4).convert_module(copy.deepcopy(original))
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear) and n != "lm_head"}
    assert linears and all(isinstance(m, QUANTIZED_LINEAR) for m in linears.values())
    assert type(model.lm_head) is nn.Linear
    assert [name for name, _ in expert_modules(model, include_converted=True)] == experts
    assert all(isinstance(model.get_submodule(name), QLoRAExperts) for name in experts)
    adapters = _adapters(model)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {f"{n}.{k}" for n in adapters for k in ("A", "B")}

    batch = _batch(seed=3)
    loss = model(**batch).loss  # fresh adapters add nothing: HF's loss on the dequantized weights
    reference = _round_trip(original, model)
    assert abs(loss.item() - reference(**batch).loss.item()) <= 1e-5 * abs(loss.item())

    torch.manual_seed(1)
    for m in adapters.values():
        nn.init.normal_(m.B, std=0.05)  # every adapter contributes, so every A gets a gradient too
    loss = model(**batch).loss
    loss.backward()
    assert torch.isfinite(loss)
    leaves, weights = lora_weights(model)
    ref_loss = torch.func.functional_call(reference, weights, args=(), kwargs=batch).loss
    ref_loss.backward()
    assert abs(loss.item() - ref_loss.item()) <= 1e-5 * abs(ref_loss.item())
    params = dict(model.named_parameters())
    assert leaves.keys() == trainable
    for name, leaf in leaves.items():
        got, expected = params[name].grad, leaf.grad
        assert got is not None and torch.isfinite(got).all() and expected.abs().max() > 0, name
        assert (got - expected).abs().max() <= 1e-4 * expected.abs().max() + 1e-7, name


# -- estimate ---------------------------------------------------------------------------------------------------
ESTIMATED = {  # name -> (bench_estimate Case features, estimate_from_hf_config arguments of the same step)
    "plain": ((), {}),
    "checkpoint+fused": (("checkpoint", "fused"), dict(activation_checkpointing=True, fused_loss=True)),
    "qlora": (("qlora",), dict(plugin="nf4-lora", precision="bf16-true", lora_rank=8)),  # nf4, bf16, rank 8
}


def _estimate_error(family: str, features: str, tmp_path) -> dict:
    from lightning_memkit.estimate.hf import estimate_from_hf_config

    case, kwargs = ESTIMATED[features]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(tiny_hf_config(family, hidden_size=64, num_layers=2, vocab_size=VOCAB).to_dict()))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # sizes the tiny config leaves to the config class's defaults
        predicted = estimate_from_hf_config(path, seq_len=SEQ, batch_size=BATCH, device="cpu", **kwargs).peak_bytes
    measured = measure(Case(family, case))  # the same model (seed 0), batch and step in a real Trainer
    return {"predicted": predicted, "measured": measured, "error": predicted / measured - 1}


@pytest.mark.slow
@pytest.mark.parametrize("features", list(ESTIMATED))
@pytest.mark.parametrize("family", FAMILIES)
def test_estimate_of_each_family_config_within_tolerance_of_a_real_step(family, features, tmp_path):
    r = _estimate_error(family, features, tmp_path)
    assert abs(r["error"]) <= TOLERANCE, r


# -- measuring and releasing callbacks in a Trainer -------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_monitor_profiler_and_release_in_a_trainer(family, tmp_path):
    import lightning as L

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = tiny_hf_causal_lm(family, seed=0)

        def training_step(self, batch, batch_idx):
            return self.model(**batch).loss

        def test_step(self, batch, batch_idx):
            self.log("test_loss", self.model(**batch).loss)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    module = Module()
    assert all(p.requires_grad for p in module.parameters())
    check_measuring_callbacks(module, tmp_path)


# -- fused loss in bf16: transformers' numerics -----------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_fused_loss_of_a_bf16_model_is_transformers_loss_to_float32_rounding(family):
    """A bf16 head: logits rounded to bf16 (softcap in bf16), a float32 loss, the logits' gradient rounded to bf16,
    as ``ForCausalLMLoss`` computes; ``logits_dtype="float32"`` keeps the logits in float32 instead."""
    model = tiny_hf_causal_lm(family, seed=0, dtype=torch.bfloat16)
    batch = _batch()
    ref, ref_grads = _loss_and_grads(model, batch)
    with fused_linear_cross_entropy(model, token_accuracy=True):
        out, grads = _loss_and_grads(model, batch)
    with fused_linear_cross_entropy(model, logits_dtype="float32"):
        exact, _ = _loss_and_grads(model, batch)
    assert out.logits is None and ref.loss.dtype == out.loss.dtype == torch.float32
    torch.testing.assert_close(out.loss, ref.loss, rtol=2e-6, atol=2e-6)
    assert 0 < abs(float(exact.loss.detach() - ref.loss)) < 2e-2  # float32 logits: other numbers
    hits = (ref.logits[:, :-1].argmax(-1) == batch["labels"][:, 1:]) & (batch["labels"][:, 1:] != -100)
    torch.testing.assert_close(out.token_accuracy, hits.sum() / (batch["labels"][:, 1:] != -100).sum())
    assert grads.keys() == ref_grads.keys()
    # at most one bf16 rounding of the same products, normwise: where the CPU has no bf16 kernels (AVX2), one logit
    # in a softcapped head can round the other way, and that one-ulp change spreads through the bf16 backward
    for n, g in grads.items():
        error = float((g.float() - ref_grads[n].float()).norm() / ref_grads[n].float().norm())
        assert error <= 2**-7, (n, error)
