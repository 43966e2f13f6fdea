"""Every feature on a peft model: fused loss (LoRA on lm_head too), QLoRA conversion, checkpointing, release,
estimate and compare, on tiny random transformers models wrapped by ``peft.get_peft_model``."""

import copy
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
bnb = pytest.importorskip("bitsandbytes")

import lightning as L  # noqa: E402
from peft import IA3Config, LoraConfig, get_peft_model  # noqa: E402

from lightning_memkit.callbacks import (  # noqa: E402
    ActivationCheckpointing,
    FusedLinearCrossEntropy,
    PhaseMemoryRelease,
)
from lightning_memkit.demo import HFCausalLM  # noqa: E402
from lightning_memkit.demo.hf_models import tiny_hf_causal_lm  # noqa: E402
from lightning_memkit.hf import fused_linear_cross_entropy  # noqa: E402
from lightning_memkit.hf.fused_loss import find_causal_lms  # noqa: E402
from lightning_memkit.hf.peft_models import peft_adapter_parameters, unwrap_peft  # noqa: E402
from lightning_memkit.memory import LivePeak, estimate_training_memory  # noqa: E402
from lightning_memkit.ops.nosave_matmul import dequantize_weight  # noqa: E402
from lightning_memkit.plugins import NoSaveBitsandbytesPrecision  # noqa: E402

VOCAB, SEQ = 128, 16
CONFIG = Path(__file__).resolve().parents[2] / "examples" / "configs" / "hf_llama_peft_lora.yaml"
QUANTIZED = (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt)
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


def _lm(family="llama", **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return tiny_hf_causal_lm(family, seed=0, vocab_size=VOCAB, **kw)


def _peft(model, **config):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # peft's own deprecation and lora_bias notes
        return get_peft_model(model, LoraConfig(**{"r": 4, "lora_alpha": 8, **config}))


def _live_adapters(model, std=0.1):
    """Fresh LoRA B matrices are zero: make every adapter contribute (seeded)."""
    torch.manual_seed(5)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            nn.init.normal_(p, std=std)
    return model


def _batch(seed=0, b=2, t=SEQ, vocab=VOCAB):
    ids = torch.randint(0, vocab, (b, t), generator=torch.Generator().manual_seed(seed))
    labels = ids.clone()
    labels[0, :3] = -100
    return {"input_ids": ids, "labels": labels}


def _loss_and_grads(model, batch, fused: bool, seed=1):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # the same dropout masks in both runs: the head's dropout draws last in both
    if fused:
        with fused_linear_cross_entropy(model):
            out = model(**batch)
    else:
        out = model(**batch)
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same(ref, ref_grads, out, grads):
    assert out.logits is None and ref.logits is not None
    torch.testing.assert_close(out.loss, ref.loss, atol=1e-5, rtol=0)
    assert grads.keys() == ref_grads.keys() and grads
    for n, g in grads.items():
        torch.testing.assert_close(g, ref_grads[n], atol=1e-5, rtol=1e-4, msg=n)


# -- fused loss ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("targets", [["q_proj", "v_proj"], ["q_proj", "lm_head"]], ids=["body", "lm_head"])
def test_fused_loss_matches_peft_loss_and_adapter_gradients(targets):
    model = _live_adapters(_peft(_lm(), target_modules=targets, lora_dropout=0.1))
    batch = _batch()
    ref, ref_grads = _loss_and_grads(model, batch, fused=False)
    out, grads = _loss_and_grads(model, batch, fused=True)
    _assert_same(ref, ref_grads, out, grads)
    assert set(grads) == {n for n, p in model.named_parameters() if p.requires_grad}  # the adapters, all of them
    assert any(".lm_head.lora_A." in n for n in grads) == ("lm_head" in targets)
    assert "forward" not in unwrap_peft(model).__dict__  # restored


def test_fused_loss_with_two_active_adapters_and_a_lora_bias_on_lm_head():
    model = _peft(_lm(), target_modules=["q_proj", "lm_head"], lora_bias=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.add_adapter("second", LoraConfig(r=2, lora_alpha=4, target_modules=["lm_head", "k_proj"]))
    model.base_model.set_adapter(["default", "second"])  # both active and trainable
    _live_adapters(model)
    batch = _batch(1)
    ref, ref_grads = _loss_and_grads(model, batch, fused=False)
    out, grads = _loss_and_grads(model, batch, fused=True)
    _assert_same(ref, ref_grads, out, grads)
    assert {n for n in grads if ".lm_head." in n} == {
        f"base_model.model.lm_head.lora_{k}.{a}.{w}" for k, a, w in
        [("A", "default", "weight"), ("B", "default", "weight"), ("B", "default", "bias"),
         ("A", "second", "weight"), ("B", "second", "weight")]}


def test_fused_loss_with_a_disabled_adapter_and_modules_to_save_head():
    model = _live_adapters(_peft(_lm(), target_modules=["q_proj", "lm_head"]))
    batch = _batch(2)
    with model.disable_adapter():  # the base model alone: no adapter in the head (nothing to train: no backward)
        ref = model(**batch)
        with fused_linear_cross_entropy(model):
            out = model(**batch)
    torch.testing.assert_close(out.loss, ref.loss, atol=1e-5, rtol=0)
    assert out.logits is None and abs(model(**batch).loss.item() - ref.loss.item()) > 1e-3  # adapters on again
    saved = _live_adapters(_peft(_lm(), target_modules=["q_proj"], modules_to_save=["lm_head"]))
    ref, ref_grads = _loss_and_grads(saved, batch, fused=False)
    out, grads = _loss_and_grads(saved, batch, fused=True)
    _assert_same(ref, ref_grads, out, grads)
    assert "base_model.model.lm_head.modules_to_save.default.weight" in grads


def test_fused_loss_on_moe_with_peft_expert_and_head_adapters():
    model = _live_adapters(_peft(_lm("qwen3_moe"), target_modules=["q_proj", "lm_head"],
                                 target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]))
    batch = _batch(3)
    ref, ref_grads = _loss_and_grads(model, batch, fused=False)
    out, grads = _loss_and_grads(model, batch, fused=True)
    _assert_same(ref, ref_grads, out, grads)
    torch.testing.assert_close(out.aux_loss, ref.aux_loss, atol=1e-6, rtol=0)
    assert any(".mlp.experts." in n for n in grads)


def test_fused_loss_refuses_dora_on_lm_head_by_name():
    model = _peft(_lm(), target_modules=["lm_head"], use_dora=True)
    with pytest.raises(ValueError, match=r"lm_head.*\['default'\].*LoRA variants"):
        with fused_linear_cross_entropy(model):
            pass
    assert "forward" not in unwrap_peft(model).__dict__


def test_fused_loss_refuses_per_sample_adapter_names_on_a_lora_head():
    model = _peft(_lm(), target_modules=["q_proj", "lm_head"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.add_adapter("other", LoraConfig(r=2, target_modules=["q_proj", "lm_head"]))
    model.eval()  # peft takes adapter_names in eval mode only
    ids = _batch()["input_ids"]
    with fused_linear_cross_entropy(model), pytest.raises(ValueError, match="adapter_names .* lm_head has LoRA"):
        model(input_ids=ids, labels=ids, adapter_names=["default", "other"])
    plain = model(input_ids=ids, labels=ids, adapter_names=["default", "other"])  # outside: peft's own forward
    assert plain.logits.shape == (2, SEQ, VOCAB)


def test_find_causal_lms_looks_inside_peft():
    model = _peft(_lm(), target_modules=["q_proj"])
    inner = unwrap_peft(model)
    assert isinstance(inner, transformers.LlamaForCausalLM) and inner is model.base_model.model
    holder = L.LightningModule()
    holder.model = model
    assert find_causal_lms(holder) == [inner] and find_causal_lms(model) == [inner]


class _Holder(L.LightningModule):
    """A LightningModule holding a peft model as ``self.model``, recording losses and logits."""

    def __init__(self, model, lr=0.1):
        super().__init__()
        self.model, self.lr = model, lr
        self.losses, self.logits = [], []

    def training_step(self, batch, batch_idx):
        out = self.model(**batch)
        self.losses.append(out.loss.item())
        self.logits.append(out.logits)
        return out.loss

    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=self.lr)


def _fit(module, callbacks=(), steps=2, plugins=None, batches=None):
    data = batches or [_batch(i) for i in range(steps)]
    loader = torch.utils.data.DataLoader(data, batch_size=None)
    trainer = L.Trainer(accelerator="cpu", max_steps=steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=list(callbacks),
                        plugins=plugins, limit_val_batches=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, loader)
    return trainer


def test_fused_callback_in_trainer_on_a_peft_model():
    lm = _live_adapters(_peft(_lm(), target_modules=["q_proj", "lm_head"]))
    fused, plain, callback = _Holder(copy.deepcopy(lm)), _Holder(copy.deepcopy(lm)), FusedLinearCrossEntropy()
    _fit(fused, [callback], batches=[_batch()] * 2)  # the same batch twice: the loss must fall
    _fit(plain, batches=[_batch()] * 2)
    assert all(x is None for x in fused.logits) and plain.logits[0] is not None
    assert fused.losses == pytest.approx(plain.losses, abs=1e-5) and fused.losses[1] < fused.losses[0]
    assert callback.fused_calls == 2 and callback.max_logits_bytes == 2 * SEQ * VOCAB * 4
    assert "forward" not in unwrap_peft(fused.model).__dict__


# -- QLoRA conversion --------------------------------------------------------------------------------------------
def test_conversion_quantizes_base_layers_and_keeps_peft_adapters_trainable():
    model = _peft(_lm(), target_modules=["q_proj", "v_proj", "lm_head"])
    adapters = set(peft_adapter_parameters(model).values())
    plugin = NoSaveBitsandbytesPrecision("nf4", "bfloat16")
    model = plugin.convert_module(model)
    quantized = {n.removeprefix("base_model.model.") for n, m in model.named_modules() if isinstance(m, QUANTIZED)}
    projections = ATTENTION + ["gate_proj", "up_proj", "down_proj"]
    expected = {f"model.layers.{i}.{'self_attn' if p in ATTENTION else 'mlp'}.{p}"
                + (".base_layer" if p in ("q_proj", "v_proj") else "") for i in range(2) for p in projections}
    assert quantized == expected  # peft's base layers and the plain Linear layers; not lm_head, not the adapters
    assert all(m.weight.dtype == torch.uint8 for m in model.modules() if isinstance(m, QUANTIZED))
    dense = {n.removeprefix("base_model.model.") for n, m in model.named_modules() if type(m) is nn.Linear}
    assert dense == {"lm_head.base_layer", "lm_head.lora_A.default", "lm_head.lora_B.default"} | {
        f"model.layers.{i}.self_attn.{p}.lora_{k}.default" for i in range(2) for p in ("q_proj", "v_proj")
        for k in "AB"}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == adapters and len(trainable) == 10
    for n, p in model.named_parameters():
        if p.is_floating_point():
            assert p.dtype == torch.float32, n  # the adapters float32, the rest as loaded
    assert len(plugin.quantized_weights) == 14
    assert plugin.memory_effect().startswith("NoSaveBitsandbytesPrecision: 14 Linear weights quantized to nf4")


def _dequantized_reference(original, converted):
    """``original`` (a peft model) whose base weights are the converted model's, dequantized (fp32)."""
    ref = copy.deepcopy(original)
    with torch.no_grad():
        for name, m in converted.named_modules():
            if isinstance(m, QUANTIZED):
                ref.get_submodule(name).weight.copy_(dequantize_weight(m, torch.float32))
    return ref


def test_converted_peft_model_matches_peft_on_dequantized_weights():
    original = _live_adapters(_peft(_lm(), target_modules=["q_proj", "v_proj", "down_proj", "lm_head"]))
    model = NoSaveBitsandbytesPrecision("nf4", "float32").convert_module(copy.deepcopy(original))
    reference = _dequantized_reference(original, model)
    batch = _batch(4)
    ours, grads = _loss_and_grads(model, batch, fused=False)
    ref, ref_grads = _loss_and_grads(reference, batch, fused=False)
    assert abs(ours.loss.item() - ref.loss.item()) <= 1e-5 * ref.loss.item()
    assert grads.keys() == ref_grads.keys() == {n for n, p in model.named_parameters() if p.requires_grad}
    for n, g in grads.items():
        torch.testing.assert_close(g, ref_grads[n], atol=1e-5, rtol=1e-4, msg=n)
    # a real quantization: the unquantized model differs a little
    plain = original(**batch).loss.item()
    assert 0 < abs(plain - ref.loss.item()) < 0.05 * plain
    # and the fused loss on the converted model is peft's loss too
    fused, fused_grads = _loss_and_grads(model, batch, fused=True)
    _assert_same(ours, grads, fused, fused_grads)


def test_trainer_fit_of_a_converted_peft_llama_trains_only_the_adapters():
    module = HFCausalLM(vocab_size=VOCAB, lr=1e-2, peft_lora={"r": 8, "lora_alpha": 16, "target_modules": ATTENTION})
    module.losses = []
    module.on_train_batch_end = lambda outputs, batch, batch_idx: module.losses.append(float(outputs["loss"]))
    batches = [_batch(0)] * 3  # the same batch: the loss must fall
    trainer = _fit(module, [FusedLinearCrossEntropy()], steps=3, plugins=[NoSaveBitsandbytesPrecision("nf4", "bf16")],
                   batches=batches)
    optimized = {id(p) for g in trainer.optimizers[0].param_groups for p in g["params"]}
    trainable = {id(p) for p in module.parameters() if p.requires_grad}
    assert optimized == trainable == set(peft_adapter_parameters(module))
    assert len(trainable) == 2 * 4 * 2  # A and B of q, k, v, o in both layers
    assert all(torch.isfinite(torch.tensor(module.losses))) and module.losses[-1] < module.losses[0]


def _snapshot(model):
    return ({n: type(m) for n, m in model.named_modules()},
            {n: (p.dtype, p.requires_grad, p.detach().clone()) for n, p in model.named_parameters()})


def _assert_unchanged(model, snapshot):
    types, params = snapshot
    assert {n: type(m) for n, m in model.named_modules()} == types
    for n, p in model.named_parameters():
        dtype, requires_grad, value = params[n]
        assert (p.dtype, p.requires_grad) == (dtype, requires_grad) and torch.equal(p.detach(), value), n


def test_lora_rank_on_a_peft_model_is_refused_naming_both():
    model = _peft(_lm(), target_modules=["q_proj"])
    before = _snapshot(model)
    with pytest.raises(ValueError, match=r"lora_rank=4 .* already has peft adapters \('default' on 2 layers"):
        NoSaveBitsandbytesPrecision("nf4", "float32", lora_rank=4).convert_module(model)
    _assert_unchanged(model, before)


@pytest.mark.parametrize("kind", ["dora", "ia3"])
def test_adapters_that_read_the_base_weight_are_refused_by_name(kind):
    if kind == "dora":
        model = _peft(_lm(), target_modules=["q_proj"], use_dora=True)
        message = r"'base_model.model.model.layers.0.self_attn.q_proj' has LoRA variant adapters \['default'\]"
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = get_peft_model(_lm(), IA3Config(target_modules=["q_proj", "down_proj"],
                                                    feedforward_modules=["down_proj"]))
        message = r"'base_model.model.model.layers.0.self_attn.q_proj' is a peft Linear \(not LoRA\)"
    before = _snapshot(model)
    with pytest.raises(ValueError, match=message):
        NoSaveBitsandbytesPrecision("nf4", "float32").convert_module(model)
    _assert_unchanged(model, before)


def test_experts_with_peft_adapters_are_refused_unless_ignored_then_train():
    targets = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    model = _live_adapters(_peft(_lm("qwen3_moe"), target_modules=["q_proj"], target_parameters=targets))
    before = _snapshot(model)
    with pytest.raises(ValueError, match=r"'base_model.model.model.layers.0.mlp.experts', "
                                         r"'base_model.model.model.layers.1.mlp.experts' carry peft adapters.*"
                                         r"ignore_modules"):
        NoSaveBitsandbytesPrecision("nf4", "float32").convert_module(model)
    _assert_unchanged(model, before)
    experts = [f"base_model.model.model.layers.{i}.mlp.experts" for i in range(2)]
    plugin = NoSaveBitsandbytesPrecision("nf4", "float32", ignore_modules=experts)
    original = copy.deepcopy(model)
    model = plugin.convert_module(model)
    assert plugin.experts_converted == 0 and len(plugin.quantized_weights) == 8  # q, k, v, o in both layers
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {n for n, p in original.named_parameters() if p.requires_grad}
    assert any(".mlp.experts." in n for n in trainable)
    reference = _dequantized_reference(original, model)
    batch = _batch(5)
    ours, grads = _loss_and_grads(model, batch, fused=False)
    ref, ref_grads = _loss_and_grads(reference, batch, fused=False)
    assert abs(ours.loss.item() - ref.loss.item()) <= 1e-5 * ref.loss.item()
    for n, g in grads.items():
        torch.testing.assert_close(g, ref_grads[n], atol=1e-5, rtol=1e-4, msg=n)


# -- checkpointing, release, estimate, compare ----------------------------------------------------------------
class _StepPeak(L.Callback):
    """LivePeak over each step's forward and backward, and the losses."""

    def __init__(self):
        self.peaks, self.losses = [], []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.live = LivePeak().__enter__()

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.live.__exit__(None, None, None)
        self.peaks.append(self.live.peak_bytes)

    def on_exception(self, trainer, pl_module, exception):
        if self.live is not None and len(self.peaks) < trainer.global_step + 1:
            self.live.__exit__(type(exception), exception, None)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))


def test_checkpointing_and_release_on_a_peft_model():
    lora = {"r": 4, "target_modules": ATTENTION}
    batches = [_batch(0, b=2, t=48)]
    base = _StepPeak()
    _fit(HFCausalLM(vocab_size=VOCAB, peft_lora=lora), [base], steps=1, batches=batches)
    ac, release = _StepPeak(), PhaseMemoryRelease(after=("fit",), strict=True)
    module = HFCausalLM(vocab_size=VOCAB, peft_lora=lora)
    _fit(module, [ac, ActivationCheckpointing(), release], steps=1, batches=batches)
    torch.testing.assert_close(ac.losses, base.losses, rtol=0, atol=1e-6)
    assert all(a < 0.75 * b for a, b in zip(ac.peaks, base.peaks)), (ac.peaks, base.peaks)
    layers = unwrap_peft(module.model).model.layers
    assert not any("forward" in vars(layer) for layer in layers)  # unwrapped after fit
    # fit released exactly AdamW's state of the adapters (two fp32 moments per element, one fp32 step each)
    adapters = [p for p in module.parameters() if p.requires_grad]
    assert len(adapters) == 16 and all(id(p) in peft_adapter_parameters(module) for p in adapters)
    (result,) = release.results
    assert result.optimizer_state_bytes == sum(2 * 4 * p.numel() + 4 for p in adapters)
    assert result.retained_bytes <= release.tolerance_bytes


def test_estimate_counts_only_the_adapters_and_matches_the_measured_peak():
    lora = {"r": 4, "target_modules": ["q_proj", "v_proj", "lm_head"]}

    def make():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return HFCausalLM(vocab_size=VOCAB, num_layers=1, peft_lora=lora).model

    est = estimate_training_memory(make, _batch, optimizer="adamw", zero_grad="before_forward")
    with LivePeak() as lp:
        model = make().train()
        adapters = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(adapters, lr=1e-3)
        for step in range(2):
            batch = _batch()
            opt.zero_grad(set_to_none=True)
            if step:
                lp.reset_peak()
            loss = model(**batch).loss
            loss.backward()
            del loss
            opt.step()
            del batch
        measured = lp.peak_bytes
    # r=4 on q (64 -> 64), v (64 -> 32) and lm_head (64 -> 128) of the one layer: A and B
    assert est.trainable_parameters == sum(p.numel() for p in adapters) == 4 * ((64 + 64) + (64 + 32) + (64 + VOCAB))
    assert est.parameters == sum(p.numel() for p in model.parameters())
    assert abs(est.peak_bytes / measured - 1) <= 0.05, (est.peak_bytes, measured)


@pytest.mark.slow
def test_config_estimate_within_5_percent_of_compare_measured_peak(tmp_path):
    from lightning_memkit.config.comparison import compare
    from lightning_memkit.estimate.config import estimate_from_config

    small = ["--data.seq_len", "16", "--data.batch_size", "2", "--data.max_bytes", "20000"]
    est = estimate_from_config(CONFIG, small)
    result = compare(CONFIG, steps=2, out_dir=tmp_path, overrides=small)
    rows = {r.phase: r for r in result.rows}
    measured = max(rows["forward+backward"].memkit_bytes, rows["optimizer step"].memkit_bytes)
    assert abs(est.peak_bytes / measured - 1) <= 0.05, (est.peak_bytes, measured)
    # r=8 on q, k, v, o, gate, up, down of two layers (hidden 64, kv 32, mlp 128): the adapters only
    per_layer = 8 * ((64 + 64) + (64 + 32) * 2 + (64 + 64) + (64 + 128) * 3)
    assert est.trainable_parameters == 2 * per_layer == 16384
    assert result.features == ["ActivationCheckpointing", "FusedLinearCrossEntropy", "PhaseMemoryRelease",
                               "NoSaveBitsandbytesPrecision"]
    assert rows["forward+backward"].memkit_bytes < rows["forward+backward"].baseline_bytes
    assert result.memkit.steps == result.baseline.steps == 2
    assert abs(result.memkit.loss_first - result.baseline.loss_first) < 0.05  # nf4 vs full weights, same start


def test_hf_causal_lm_refuses_bad_peft_lora_by_name():
    with pytest.raises(TypeError, match=r"HFCausalLM\(peft_lora=...\) must be None or a dict"):
        HFCausalLM(peft_lora=["q_proj"])
    with pytest.raises(ValueError, match=r"HFCausalLM\(peft_lora=\{'rank': 4\}\): not valid peft.LoraConfig"):
        HFCausalLM(peft_lora={"rank": 4})
    with pytest.raises(ValueError, match=r"HFCausalLM\(peft_lora=.*Target modules \{'nope'\} not found"):
        HFCausalLM(peft_lora={"target_modules": ["nope"]})


# -- bf16 QLoRA: the fused loss and the budget keep the math ----------------------------------------------------
class _Batches(L.LightningDataModule):
    """Fixed batches from a data module, so that a budget plans in ``setup``, on the model not yet quantized."""

    def __init__(self, batches):
        super().__init__()
        self.batches = batches

    def train_dataloader(self):
        return torch.utils.data.DataLoader(self.batches, batch_size=None)


def _qlora_bf16_fit(callbacks, steps=3, vocab=VOCAB):
    """A 3-step bf16 QLoRA (nf4) fit of a peft Llama on distinct batches: its losses and its trained adapters."""
    L.seed_everything(0, verbose=False)
    module = HFCausalLM(vocab_size=vocab, lr=5e-2, peft_lora={"r": 8, "lora_alpha": 16, "target_modules": ATTENTION})
    module.losses = []
    module.on_train_batch_end = lambda outputs, batch, batch_idx: module.losses.append(float(outputs["loss"]))
    trainer = L.Trainer(accelerator="cpu", max_steps=steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=list(callbacks),
                        plugins=[NoSaveBitsandbytesPrecision("nf4", "bf16")], limit_val_batches=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, datamodule=_Batches([_batch(i, b=4, t=32, vocab=vocab) for i in range(steps)]))
    names = peft_adapter_parameters(module)
    adapters = {names[id(p)]: p.detach().float().clone() for p in module.parameters() if id(p) in names}
    return module.losses, adapters, trainer


def _relative_gap(a: dict, b: dict) -> float:
    return max(float((a[n] - b[n]).norm() / b[n].norm().clamp_min(1e-12)) for n in b)


def test_bf16_qlora_fit_with_the_fused_loss_has_the_losses_of_the_fit_without_it():
    plain, plain_adapters, _ = _qlora_bf16_fit([])
    callback = FusedLinearCrossEntropy(token_accuracy=True)
    fused, fused_adapters, trainer = _qlora_bf16_fit([callback])
    assert callback.fused_calls == 3 and fused_adapters.keys() == plain_adapters.keys()
    assert fused == pytest.approx(plain, abs=1e-4, rel=0)
    assert _relative_gap(fused_adapters, plain_adapters) < 1e-2  # bf16 training: not bitwise, far from 5%
    assert 0.0 <= float(trainer.callback_metrics["train_token_accuracy"]) <= 1.0


def test_memory_budget_on_bf16_qlora_uses_the_fused_loss_with_the_same_losses():
    """A vocabulary whose logits dominate the step: the budget's fused loss (the one lever allowed, so the plan is
    the same on any machine) fits where the run as given does not, with the losses of the run without it."""
    from lightning_memkit.callbacks import MemoryBudget
    from lightning_memkit.memory import LivePeak as Peak

    with Peak() as lp:
        plain, plain_adapters, _ = _qlora_bf16_fit([], vocab=1024)
    budget = MemoryBudget(int(lp.peak_bytes * 0.9), allow=["fused_loss"])
    with Peak() as fused_peak:
        fused, fused_adapters, _ = _qlora_bf16_fit([budget], vocab=1024)
    assert budget.changes == ["fused cross-entropy (FusedLinearCrossEntropy)"]
    assert fused_peak.peak_bytes <= budget.budget_bytes < lp.peak_bytes
    assert fused == pytest.approx(plain, abs=1e-4, rel=0)
    assert _relative_gap(fused_adapters, plain_adapters) < 1e-2
