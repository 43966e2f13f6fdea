"""NoSaveBitsandbytesPrecision on tiny random HF causal LMs: a QLoRA model with quantized experts, no extra code."""

import copy
import pickle
from pathlib import Path

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")
bnb = pytest.importorskip("bitsandbytes")

from hf_checks import lora_weights  # noqa: E402
from lightning.pytorch import Callback, Trainer  # noqa: E402

from lightning_memkit.demo import ByteTextDataModule, HFCausalLM  # noqa: E402
from lightning_memkit.demo.hf_models import tiny_hf_causal_lm  # noqa: E402
from lightning_memkit.hf.qlora import ExpertConversion, QLoRAExperts, dequantized_experts  # noqa: E402
from lightning_memkit.memory import profile_saved_tensors  # noqa: E402
from lightning_memkit.ops.lora import ExpertLoRAAdapter, LoRAAdapter  # noqa: E402
from lightning_memkit.ops.nosave_experts import QuantizedExperts  # noqa: E402
from lightning_memkit.ops.nosave_matmul import dequantize_weight  # noqa: E402
from lightning_memkit.plugins import NoSaveBitsandbytesPrecision  # noqa: E402
from lightning_memkit.plugins import nosave_bitsandbytes as plugin_module  # noqa: E402

FAMILIES = ["qwen3_moe", "gpt_oss", "llama"]
MOE = ["qwen3_moe", "gpt_oss"]
RANK = 4
CONFIG = Path(__file__).resolve().parents[2] / "examples" / "configs" / "hf_qwen3_moe_qlora.yaml"
QUANTIZED_LINEAR = (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt)


def _convert(model, mode="nf4", dtype=torch.float32, **kwargs):
    kwargs.setdefault("lora_rank", RANK)
    return NoSaveBitsandbytesPrecision(mode, dtype, **kwargs).convert_module(model)


def _batch(seed=0, b=2, t=16):
    ids = torch.randint(0, 256, (b, t), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids}


def _round_trip_reference(original, converted, dtype):
    """HF's own model (its own forward) whose quantized weights are replaced by their dequantized copies."""
    ref = copy.deepcopy(original).to(dtype)
    with torch.no_grad():
        for name, m in converted.named_modules():
            if isinstance(m, QLoRAExperts):
                for proj, dense in dequantized_experts(m, dtype).items():
                    getattr(ref.get_submodule(name), proj).copy_(dense)
            elif isinstance(m, QUANTIZED_LINEAR):
                ref.get_submodule(name).weight.copy_(dequantize_weight(m, dtype))
    return ref


def _state(model):
    """Everything but the adapters: name -> a copy (parameters and buffers)."""
    tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    return {n: t.detach().clone() for n, t in tensors.items() if ".lora." not in n}


def _snapshot(model):
    return ({n: type(m) for n, m in model.named_modules()},
            {n: (p, p.dtype, p.requires_grad, p.detach().clone()) for n, p in model.named_parameters()})


def _assert_unchanged(model, snapshot):
    types, params = snapshot
    assert {n: type(m) for n, m in model.named_modules()} == types
    assert list(params) == [n for n, _ in model.named_parameters()]
    for n, p in model.named_parameters():
        obj, dtype, requires_grad, value = params[n]
        assert p is obj and p.dtype == dtype and p.requires_grad == requires_grad, n
        assert p.device.type == "meta" or torch.equal(p.detach(), value), n


# -- what the conversion produces ------------------------------------------------------------------------
def _assert_linears_quantized_but_the_head(model, loaded):
    """Every Linear but lm_head is a packed bitsandbytes layer; lm_head stays an nn.Linear in the loaded dtype."""
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert type(model.lm_head) is nn.Linear and model.lm_head.weight.dtype == loaded
    assert all(isinstance(m, QUANTIZED_LINEAR) and m.weight.dtype == torch.uint8
               for n, m in linears.items() if n != "lm_head")


def _assert_experts_quantized_with_adapters(model, family):
    """Each MoE experts module holds packed bf16-compute projections, each with its expert LoRA adapter."""
    experts = [m for m in model.modules() if isinstance(m, QLoRAExperts)]
    assert len(experts) == (2 if family in MOE else 0)
    for m in experts:
        assert not any(p.dim() == 3 and p.is_floating_point() for p in m._parameters.values())
        for proj in ("gate_up_proj", "down_proj"):
            q = m._modules[proj]
            assert isinstance(q, QuantizedExperts) and q.weight.dtype == torch.uint8
            assert q.compute_dtype is torch.bfloat16
            assert isinstance(m.lora[proj], ExpertLoRAAdapter) and m.lora[proj].A.shape == (4, q.in_features, RANK)


def _assert_only_the_adapters_train(model, family):
    """The trainable parameters are exactly the adapters' A and B, as many as the family has; returns their names."""
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    adapters = {f"{n}.{k}" for n, m in model.named_modules() if isinstance(m, (LoRAAdapter, ExpertLoRAAdapter))
                for k in ("A", "B")}
    assert trainable == adapters
    attention = {n for n in trainable if ".self_attn." in n}
    assert len(attention) == 2 * 4 * 2  # q, k, v, o of both layers, A and B
    assert len(trainable - attention) == {"qwen3_moe": 8, "gpt_oss": 8, "llama": 12}[family]
    return trainable


def _assert_the_rest_keeps_its_loaded_dtype(model, trainable, loaded, buffers):
    """Frozen floating parameters keep the loaded dtype, the adapters are float32, the buffers keep theirs."""
    for n, p in model.named_parameters():
        if n not in trainable and p.is_floating_point():
            assert p.dtype == loaded, n  # embeddings, norms, routers, sinks, biases, lm_head
        if n in trainable:
            assert p.dtype == torch.float32, n
    assert all(b.dtype == buffers[n] for n, b in model.named_buffers() if n in buffers)  # buffers as they were


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("loaded", [torch.float32, torch.bfloat16])
def test_conversion_quantizes_linears_and_experts_freezes_and_keeps_the_rest_as_loaded(family, loaded):
    """bf16 compute: the quantized products run in bf16, every other parameter keeps the dtype the model was loaded
    in (transformers' ``BitsAndBytesConfig`` loading), the adapters float32."""
    model = tiny_hf_causal_lm(family, seed=0, dtype=loaded)
    buffers = {n: b.dtype for n, b in model.named_buffers()}
    model = _convert(model, dtype=torch.bfloat16)
    _assert_linears_quantized_but_the_head(model, loaded)
    _assert_experts_quantized_with_adapters(model, family)
    trainable = _assert_only_the_adapters_train(model, family)
    _assert_the_rest_keeps_its_loaded_dtype(model, trainable, loaded, buffers)


@pytest.mark.parametrize(("mode", "dtype"), [("nf4", torch.bfloat16), ("int8", torch.float16)])
def test_the_report_counts_the_experts_bytes_with_the_linears(mode, dtype):
    """The plugin's line adds each 3-D expert weight: dense ``E x out x in`` in the compute dtype against its packed
    bytes and quant state (4-bit: half a byte per weight, a float32 absmax per 64, a 16-entry code; int8: a byte per
    weight, a float32 scale per row)."""
    model = tiny_hf_causal_lm("qwen3_moe", seed=0)
    shapes = [tuple(p.shape) for p in model.parameters() if p.dim() == 3]  # (E, out, in) per projection
    plugin = NoSaveBitsandbytesPrecision(mode, dtype, lora_rank=RANK)
    plugin.convert_module(model)

    def packed(e, out, cols):
        return e * out * cols + e * out * 4 if mode == "int8" else e * (out * cols // 2 + out * cols // 64 * 4) + 64

    assert len(shapes) == 4 and plugin.experts_converted == 2
    assert sorted(d for _, d, _ in plugin.quantized_experts) == sorted(e * o * i * 2 for e, o, i in shapes)
    assert sorted(q for _, _, q in plugin.quantized_experts) == sorted(packed(*s) for s in shapes)
    dense = sum(d for _, d, _ in plugin.quantized_weights) + sum(e * o * i * 2 for e, o, i in shapes)
    saved = dense - sum(q for _, _, q in plugin.quantized_weights) - sum(packed(*s) for s in shapes)
    line = plugin.memory_effect()
    assert line.startswith(f"NoSaveBitsandbytesPrecision: 8 Linear weights and 4 expert weights (2 MoE experts "
                           f"modules) quantized to {mode}: {dense:,} bytes dense"), line
    assert line.endswith(f", {saved:,} bytes saved"), line


@pytest.mark.parametrize(("family", "mode", "dtype", "tol"), [
    ("qwen3_moe", "nf4", torch.float32, 1e-5), ("gpt_oss", "nf4", torch.float32, 1e-5),
    ("llama", "nf4", torch.float32, 1e-5), ("qwen3_moe", "nf4-dq", torch.float32, 1e-5),
    ("gpt_oss", "fp4-dq", torch.float32, 1e-5), ("qwen3_moe", "int8", torch.float16, 2e-3),
])
def test_loss_equals_hf_with_round_tripped_weights(family, mode, dtype, tol):
    original = tiny_hf_causal_lm(family, seed=0)
    model = _convert(copy.deepcopy(original), mode, dtype)
    reference = _round_trip_reference(original, model, dtype)
    batch = _batch()
    ours = model(**batch).loss
    theirs = reference(**batch).loss
    assert ours.dtype == theirs.dtype
    assert abs(ours.item() - theirs.item()) <= tol * abs(theirs.item())
    # the round trip is a real quantization: the unquantized model's loss differs from it only slightly
    assert abs(original(**batch).loss.item() - theirs.item()) < 0.05 * abs(theirs.item())


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_gradients_match_plain_autograd_on_dequantized_weights(family):
    original = tiny_hf_causal_lm(family, seed=0)
    model = _convert(copy.deepcopy(original))
    torch.manual_seed(1)
    for m in model.modules():
        if isinstance(m, (LoRAAdapter, ExpertLoRAAdapter)):
            nn.init.normal_(m.B, std=0.05)  # a fresh adapter is zero: make every one contribute
    reference = _round_trip_reference(original, model, torch.float32)
    batch = _batch(seed=3)
    loss = model(**batch).loss
    loss.backward()
    leaves, weights = lora_weights(model)
    ref_loss = torch.func.functional_call(reference, weights, args=(), kwargs=batch).loss
    ref_loss.backward()
    assert abs(loss.item() - ref_loss.item()) <= 1e-5 * abs(ref_loss.item())
    params = dict(model.named_parameters())
    assert set(leaves) == {n for n, p in params.items() if p.requires_grad}
    for name, leaf in leaves.items():
        got, expected = params[name].grad, leaf.grad
        assert got is not None and expected.abs().max() > 0, name
        assert (got - expected).abs().max() <= 1e-4 * expected.abs().max() + 1e-7, name


# -- what the experts keep for backward ------------------------------------------------------------------
@pytest.mark.parametrize("family", MOE)
def test_experts_keep_only_their_packed_weights_for_backward(family):
    model = _convert(tiny_hf_causal_lm(family, seed=0), dtype=torch.bfloat16)
    batch = _batch(b=2, t=12)  # 24 tokens: no activation has the shape of a dense expert matrix
    report = profile_saved_tensors(model, **batch)
    quantized = {n: m for n, m in model.named_modules() if isinstance(m, QuantizedExperts)}
    assert len(quantized) == 4
    for name, q in quantized.items():
        kept = [s for s in report.storages if s.name == name]
        own = sorted(t.untyped_storage().nbytes() for t in [*q.parameters(), *q.buffers()])
        # no activation at all (the input is not kept), and the weights kept are this module's own storages
        assert [s.kind for s in kept] == ["weight"] * len(kept) and kept
        assert sorted(s.nbytes for s in kept) == own
        row = next(r for r in report.rows if r.name == name)
        assert row.activation_bytes == 0 and row.weight_bytes == sum(own)
    assert _dense_copies_saved(model, quantized, batch) == 0
    seen = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(t) or t, lambda t: t):
        model(**batch)
    storages = {t.untyped_storage().data_ptr() for q in quantized.values() for t in q.saved_tensors(0)}
    assert storages <= {t.untyped_storage().data_ptr() for t in seen}  # the packed slices went through the hook


def _dense_copies_saved(model, quantized, batch) -> int:
    """Saved floating tensors shaped like a dense expert matrix that are no parameter of the model."""
    shapes = {s for q in quantized.values() for s in ((q.out_features, q.in_features), (q.in_features, q.out_features))}
    params = {t.untyped_storage().data_ptr() for t in model.parameters()}  # lm_head's (256 x 64) weight, say
    seen = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(t) or t, lambda t: t):
        model(**batch)
    return sum(t.is_floating_point() and tuple(t.shape) in shapes and t.untyped_storage().data_ptr() not in params
               for t in seen)


def test_the_saved_copy_check_catches_a_dequantize_then_matmul_path(monkeypatch):
    model = _convert(tiny_hf_causal_lm("qwen3_moe", seed=0), dtype=torch.bfloat16)
    quantized = {n: m for n, m in model.named_modules() if isinstance(m, QuantizedExperts)}

    def dense_forward(self, x, expert, bias=None):  # plain autograd keeps the dequantized weight for dx
        return torch.nn.functional.linear(x, self.dequantize(expert, x.dtype), bias)

    monkeypatch.setattr(QuantizedExperts, "forward", dense_forward)
    assert _dense_copies_saved(model, quantized, _batch(b=2, t=12)) >= 4


# -- ignore_modules, errors, all-or-nothing --------------------------------------------------------------
def test_ignore_modules_stay_unquantized_and_are_frozen_as_loaded():
    model = tiny_hf_causal_lm("qwen3_moe", seed=0)
    layer1 = model.model.layers[1]
    before = {n: p.detach().clone() for n, p in layer1.named_parameters()}
    model = _convert(model, dtype=torch.bfloat16, ignore_modules=["model.layers.1"])
    assert type(model.model.layers[0].mlp.experts).__name__ == "QLoRAQwen3MoeExperts"
    assert type(layer1.mlp.experts).__name__ == "Qwen3MoeExperts" and type(layer1.self_attn.q_proj) is nn.Linear
    assert not any(isinstance(m, (LoRAAdapter, ExpertLoRAAdapter)) for m in layer1.modules())
    for n, p in layer1.named_parameters():
        assert p.dtype == torch.float32 and not p.requires_grad and torch.equal(p.detach(), before[n]), n
    model(**_batch()).loss.backward()
    assert model.model.layers[0].mlp.experts.lora.down_proj.B.grad is not None


def test_unmatched_ignore_modules_name_the_experts_modules():
    model = tiny_hf_causal_lm("gpt_oss", seed=0)
    snapshot = _snapshot(model)
    with pytest.raises(ValueError, match=r"ignore_modules entries \['model.layers.7'\] match no Linear layer or MoE "
                                         r"experts module of GptOssForCausalLM .*MoE experts modules: "
                                         r"'model.layers.0.mlp.experts', 'model.layers.1.mlp.experts'"):
        _convert(model, ignore_modules=["model.layers.7"])
    _assert_unchanged(model, snapshot)


@pytest.mark.parametrize(("spoil", "match"), [
    (lambda experts: setattr(experts, "_is_expert_parallel", True),
     r"experts module 'model.layers.1.mlp.experts' \(Qwen3MoeExperts\) is expert-parallel"),
    (lambda experts: setattr(experts, "gate_up_proj", nn.Parameter(torch.empty(4, 64, 64, device="meta"))),
     r"experts module 'model.layers.1.mlp.experts' \(Qwen3MoeExperts\): .*gate_up_proj is on the meta device"),
    (lambda experts: setattr(experts, "down_proj", nn.Parameter(torch.randn(3, 64, 32))),
     r"'model.layers.1.mlp.experts' \(Qwen3MoeExperts\): down_proj has 3 experts in dimension 0, num_experts=4"),
])
def test_an_unquantizable_experts_module_is_refused_before_anything_changes(spoil, match):
    model = tiny_hf_causal_lm("qwen3_moe", seed=0)
    spoil(model.model.layers[1].mlp.experts)
    snapshot = _snapshot(model)
    with pytest.raises(ValueError, match=match):
        _convert(model)
    _assert_unchanged(model, snapshot)


@pytest.mark.parametrize("where", ["experts", "freeze"])
def test_a_failure_midway_undoes_everything(where, monkeypatch):
    model = tiny_hf_causal_lm("gpt_oss", seed=0)
    snapshot = _snapshot(model)
    if where == "experts":
        calls = []
        original = ExpertConversion.apply

        def apply(self):
            calls.append(self.name)
            if len(calls) == 2:
                raise RuntimeError("boom")
            original(self)

        monkeypatch.setattr(ExpertConversion, "apply", apply)
    else:
        def freeze(*args, **kwargs):
            raise RuntimeError("boom")

        monkeypatch.setattr(plugin_module, "freeze_base_", freeze)
    with pytest.raises(RuntimeError, match="boom"):
        _convert(model, dtype=torch.bfloat16)
    _assert_unchanged(model, snapshot)
    assert not any(isinstance(m, (QUANTIZED_LINEAR, LoRAAdapter, ExpertLoRAAdapter)) for m in model.modules())
    batch = _batch()
    torch.testing.assert_close(model(**batch).loss, tiny_hf_causal_lm("gpt_oss", seed=0)(**batch).loss)


# -- a converted model behaves like a module -------------------------------------------------------------
def test_conversion_is_idempotent_and_the_model_copies_pickles_and_reloads():
    model = _convert(tiny_hf_causal_lm("gpt_oss", seed=0))
    names = [n for n, _ in model.named_parameters()]
    assert _convert(model) is model and [n for n, _ in model.named_parameters()] == names
    for m in model.modules():
        if isinstance(m, (LoRAAdapter, ExpertLoRAAdapter)):
            nn.init.normal_(m.B, std=0.05)
    batch = _batch()
    loss = model(**batch).loss
    torch.testing.assert_close(copy.deepcopy(model)(**batch).loss, loss, rtol=0, atol=0)
    experts = model.model.layers[0].mlp.experts
    clone = pickle.loads(pickle.dumps(experts))
    assert type(clone) is type(experts)
    x, idx, w = torch.randn(6, 64), torch.tensor([[0, 1], [2, 3], [1, 2], [0, 3], [3, 1], [2, 0]]), torch.rand(6, 2)
    torch.testing.assert_close(clone(x, idx, w), experts(x, idx, w), rtol=0, atol=0)
    other = _convert(tiny_hf_causal_lm("gpt_oss", seed=5)).model.layers[0].mlp.experts
    assert not torch.equal(other.gate_up_proj.weight, experts.gate_up_proj.weight)
    other.load_state_dict(experts.state_dict())  # strict: the packed experts and their adapters, exactly
    torch.testing.assert_close(other(x, idx, w), experts(x, idx, w), rtol=0, atol=0)
    # a converted model's state dict restores the packed Linear weights as saved (not quantized again as values)
    target = _convert(tiny_hf_causal_lm("gpt_oss", seed=5))
    target.load_state_dict(model.state_dict())
    torch.testing.assert_close(target(**batch).loss, loss, rtol=0, atol=0)


# -- inside a Trainer ------------------------------------------------------------------------------------
class _Watch(Callback):
    def __init__(self):
        self.losses, self.before, self.lora_before = [], None, None

    def on_train_start(self, trainer, pl_module):
        self.before = _state(pl_module)
        self.lora_before = {n: p.detach().clone() for n, p in pl_module.named_parameters() if ".lora." in n}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))


@pytest.mark.parametrize("family", FAMILIES)
def test_trainer_fits_only_the_adapters(family):
    module = HFCausalLM(family=family, hidden_size=64, num_layers=2, lr=1e-2)
    watch = _Watch()
    plugin = NoSaveBitsandbytesPrecision("nf4", "bfloat16", lora_rank=8)
    # 8 steps: the loss is on its plateau, ~0.4 below the first step's, after 5
    trainer = Trainer(accelerator="cpu", max_steps=8, plugins=[plugin], callbacks=[watch], logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, ByteTextDataModule(batch_size=8, seq_len=64, batch_format="hf"))
    assert sum(watch.losses[-3:]) / 3 < watch.losses[0] - 0.2
    after = _state(module)
    assert after.keys() == watch.before.keys()
    assert all(torch.equal(after[n], watch.before[n]) for n in after)  # the frozen base did not move
    trainable = {n: p for n, p in module.named_parameters() if p.requires_grad}
    assert trainable.keys() == watch.lora_before.keys()
    assert all(p.dtype == torch.float32 and not torch.equal(p.detach(), watch.lora_before[n])
               for n, p in trainable.items())
    hf = module.model
    assert type(hf.lm_head) is nn.Linear and hf.lm_head.weight.dtype == torch.float32  # kept as built (float32)
    assert all(p.dtype in (torch.float32, torch.uint8) for n, p in hf.named_parameters() if not p.requires_grad)
    experts = [m for m in hf.modules() if isinstance(m, QLoRAExperts)]
    assert len(experts) == (2 if family in MOE else 0)
    assert all(q.weight.dtype == torch.uint8 for m in experts for q in (m.gate_up_proj, m.down_proj))


def test_shipped_config_trains_qwen3_moe_qlora(tmp_path):
    from lightning_memkit.config.lightning_cli import LossTracker, MemkitCLI

    overrides = {"trainer.max_steps": 15, "trainer.enable_progress_bar": False, "trainer.logger": False,
                 "trainer.default_root_dir": str(tmp_path)}
    args = [a for k, v in overrides.items() for a in (f"--{k}", str(v))]
    cli = MemkitCLI(args=["fit", "--config", str(CONFIG), *args])  # the loss is down by ~0.35 after 5 steps
    plugin = cli.trainer.precision_plugin
    assert isinstance(plugin, NoSaveBitsandbytesPrecision) and plugin.dtype is torch.bfloat16
    tracker = next(cb for cb in cli.trainer.callbacks if isinstance(cb, LossTracker))
    assert tracker.steps == 15 and tracker.last < tracker.first - 0.2
    assert sum(isinstance(m, QLoRAExperts) for m in cli.model.modules()) == 2


# -- CUDA ------------------------------------------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.parametrize("family", MOE)
def test_cuda_conversion_quantizes_on_the_gpu_and_matches_the_round_trip(family):
    original = tiny_hf_causal_lm(family, seed=0).cuda()
    model = _convert(copy.deepcopy(original), dtype=torch.bfloat16)
    experts = [m for m in model.modules() if isinstance(m, QLoRAExperts)]
    assert experts and all(m.gate_up_proj.weight.device.type == "cuda" for m in experts)
    reference = _round_trip_reference(original, model, torch.bfloat16)
    batch = {k: v.cuda() for k, v in _batch().items()}
    loss = model(**batch).loss
    assert abs(loss.item() - reference(**batch).loss.item()) <= 2e-2 * loss.item()
    loss.backward()
    grads = [m.lora.down_proj.B.grad for m in experts]
    assert all(g is not None and torch.isfinite(g).all() and g.abs().max() > 0 for g in grads)


def test_the_demo_model_is_built_in_its_dtype_and_the_plugin_keeps_it():
    module = HFCausalLM("llama", hidden_size=16, num_layers=1, dtype="bfloat16")
    _convert(module.model, dtype=torch.bfloat16)
    assert {p.dtype for p in module.model.parameters() if not p.requires_grad} == {torch.bfloat16, torch.uint8}
    with pytest.raises(ValueError, match=r"HFCausalLM\(dtype='int8'\): must be one of 'float32', 'bfloat16'"):
        HFCausalLM(dtype="int8")


def test_a_float32_state_dict_loaded_into_a_converted_bf16_model_is_quantized_as_the_model_loaded_its_own():
    """The state dict's weights are cast to the dtype the layers were loaded in before they are quantized again (as
    ``load_state_dict`` casts into a parameter's dtype): the packed bytes of converting the bf16 model itself."""
    float32 = tiny_hf_causal_lm("llama", seed=0)
    direct = _convert(copy.deepcopy(float32).to(torch.bfloat16), dtype=torch.bfloat16)
    loaded = _convert(tiny_hf_causal_lm("llama", seed=1, dtype=torch.bfloat16), dtype=torch.bfloat16)
    loaded.load_state_dict(float32.state_dict(), strict=False)
    mine, theirs = loaded.state_dict(), direct.state_dict()
    packed = [k for k, v in theirs.items() if v.dtype == torch.uint8]
    assert packed and all(torch.equal(mine[k], theirs[k]) for k in packed)
