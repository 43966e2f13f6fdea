import pickle
from pathlib import Path

import pytest
import torch
from torch import nn

bnb = pytest.importorskip("bitsandbytes")

from lightning.pytorch import Trainer  # noqa: E402

from lightning_memkit.memory import LivePeak, profile_saved_tensors  # noqa: E402
from lightning_memkit.ops.nosave_matmul import dequantize_weight, saved_weight_tensors  # noqa: E402
from lightning_memkit.plugins import NoSaveBitsandbytesPrecision  # noqa: E402
from lightning_memkit.plugins import nosave_bitsandbytes as plugin_module  # noqa: E402

MODES = ["nf4", "nf4-dq", "fp4", "fp4-dq", "int8"]
IN, OUT, RANK = 64, 48, 4
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}
CONFIG = Path(__file__).resolve().parents[2] / "examples" / "configs" / "tiny_lm_qlora.yaml"


def _dtype(mode: str) -> torch.dtype:
    return torch.float16 if mode == "int8" else torch.float32


class MLP(nn.Module):
    def __init__(self, bias: bool = True):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(IN, 96, bias=bias), nn.GELU(), nn.Linear(96, IN, bias=bias))
        self.head = nn.Linear(IN, 10)

    def forward(self, x):
        return self.head(self.body(x))


def _converted_layer(mode: str, bias: bool, lora_rank: int = RANK, dtype=None):
    plugin = NoSaveBitsandbytesPrecision(mode, dtype or _dtype(mode), lora_rank=lora_rank)
    layer = plugin.convert_module(nn.Sequential(nn.Linear(IN, OUT, bias=bias)))[0]
    if bias:
        nn.init.uniform_(layer.bias, -0.5, 0.5)
    if lora_rank:
        nn.init.normal_(layer.lora.B, std=0.3)  # a fresh adapter is zero: make it contribute
    return layer


def _bnb_twin(layer: nn.Module) -> nn.Module:
    """bitsandbytes' own layer over the same packed weight (and bias)."""
    bias = layer.bias is not None
    if isinstance(layer, bnb.nn.Linear8bitLt):
        twin = bnb.nn.Linear8bitLt(IN, OUT, bias=bias, has_fp16_weights=False)
        w = layer.weight
        twin.weight = bnb.nn.Int8Params(w.data, requires_grad=False, has_fp16_weights=False, CB=w.data, SCB=w.SCB)
    else:
        twin = bnb.nn.Linear4bit(IN, OUT, bias=bias, compute_dtype=layer.compute_dtype)
        twin.weight = layer.weight
    if bias:
        twin.bias = layer.bias
    return twin


def _grads(fn, x, params):
    for t in (x, *params):
        t.grad = None
    out = fn(x)
    out.backward(torch.linspace(-1, 1, out.numel()).reshape(out.shape).to(out.dtype))
    return [out.detach(), x.grad.clone(), *(p.grad.clone() for p in params)]


def _close(actual, expected, dtype):
    scale = expected.abs().max().item() + 1e-6
    err = (actual.double() - expected.double()).abs().max().item()
    assert err <= TOL[dtype] * scale, f"max error {err:.3g} > {TOL[dtype]} x {scale:.3g}"


# -- construction ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"mode": "nf8"}, ValueError, r"NoSaveBitsandbytesPrecision\(mode='nf8'\): must be one of 'nf4', 'nf4-dq', "
                                      r"'fp4', 'fp4-dq', 'int8'"),
        ({"mode": "int8-training"}, ValueError, r"mode='int8-training'\): must be one of"),
        ({"mode": "int8", "dtype": "bfloat16"}, ValueError, r"dtype='bfloat16' cannot run with mode='int8'; allowed: "
                                                           r"torch.float16"),
        ({"mode": "nf4", "dtype": torch.float64}, ValueError, "dtype=torch.float64 cannot run with mode='nf4'"),
        ({"mode": "nf4", "dtype": "bfloat61"}, ValueError, r"dtype='bfloat61'\): not a torch dtype name"),
        ({"mode": "nf4", "dtype": 16}, TypeError, r"dtype=...\): must be None, a str or a torch.dtype, got int"),
        ({"mode": "nf4", "lora_rank": -1}, ValueError, r"NoSaveBitsandbytesPrecision\(lora_rank=-1\): must be an "
                                                       r"int >= 0"),
        ({"mode": "nf4", "lora_rank": 2.0}, TypeError, r"lora_rank=2.0\): must be an int >= 0, got float"),
        ({"mode": "nf4", "lora_rank": 4, "lora_alpha": 0}, ValueError, r"lora_alpha=0\): must be a finite number > 0"),
        ({"mode": "nf4", "lora_rank": 4, "lora_dropout": 1.0}, ValueError, r"lora_dropout=1.0\): must be a finite "
                                                                           r"number >= 0 and < 1"),
        ({"mode": "nf4", "ignore_modules": "head"}, TypeError, "ignore_modules must be a set or list of module names"),
        ({"mode": "nf4", "ignore_modules": ["head", 3]}, TypeError, "ignore_modules entries must be non-empty str"),
    ],
)
def test_bad_arguments_raise_at_construction(kwargs, error, match):
    with pytest.raises(error, match=match):
        NoSaveBitsandbytesPrecision(**kwargs)


@pytest.mark.parametrize(
    ("given", "expected"),
    [("bfloat16", torch.bfloat16), ("torch.bfloat16", torch.bfloat16), ("float16", torch.float16),
     ("float32", torch.float32), ("torch.float32", torch.float32), (torch.float16, torch.float16)],
)
def test_dtype_accepts_strings(given, expected):
    assert NoSaveBitsandbytesPrecision("nf4", given).dtype is expected


def test_default_dtypes():
    assert NoSaveBitsandbytesPrecision("int8").dtype is torch.float16
    expected = torch.bfloat16 if not torch.cuda.is_available() or torch.cuda.is_bf16_supported() else torch.float16
    assert NoSaveBitsandbytesPrecision("nf4").dtype is expected


def test_unmatched_ignore_modules_fail_at_conversion_and_change_nothing():
    plugin = NoSaveBitsandbytesPrecision("nf4", "float32", ignore_modules={"hed", "body"}, lora_rank=2)
    model = MLP()
    with pytest.raises(ValueError, match=r"ignore_modules entries \['hed'\] match no Linear layer of MLP.*"
                                         r"Linear layers: 'body.0', 'body.2', 'head'"):
        plugin.convert_module(model)
    assert all(type(m) is nn.Linear for m in (model.body[0], model.body[2], model.head))


def test_foreign_bitsandbytes_layers_are_refused():
    model = nn.Sequential(bnb.nn.Linear4bit(IN, OUT), nn.Linear(OUT, 2))
    with pytest.raises(ValueError, match=r"already holds bitsandbytes layers that this plugin did not create \(0\)"):
        NoSaveBitsandbytesPrecision("nf4").convert_module(model)
    assert type(model[1]) is nn.Linear


# -- conversion ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_convert_quantizes_on_cpu_and_adds_lora(mode):
    plugin = NoSaveBitsandbytesPrecision(mode, _dtype(mode), ignore_modules=["head"], lora_rank=RANK, lora_alpha=8)
    model = plugin.convert_module(MLP())
    parent = bnb.nn.Linear8bitLt if mode == "int8" else bnb.nn.Linear4bit
    for layer in (model.body[0], model.body[2]):
        assert isinstance(layer, parent) and type(layer).__name__.startswith("NoSave")
        assert layer.weight.dtype == (torch.int8 if mode == "int8" else torch.uint8)
        assert layer.weight.device.type == "cpu"
        assert layer.lora.scaling == 8 / RANK and layer.lora.A.shape == (RANK, layer.in_features)
        assert torch.count_nonzero(layer.lora.B) == 0
    assert type(model.head) is nn.Linear
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    assert trainable == ["body.0.lora.A", "body.0.lora.B", "body.2.lora.A", "body.2.lora.B", "head.bias", "head.weight"]
    assert plugin.convert_module(model) is model and model.body[0].lora is not None  # idempotent


@pytest.mark.parametrize("mode", ["nf4", "int8"])
def test_without_lora_the_converted_layers_are_frozen(mode):
    model = NoSaveBitsandbytesPrecision(mode, _dtype(mode), ignore_modules=["head"]).convert_module(MLP())
    assert sorted(n for n, p in model.named_parameters() if p.requires_grad) == ["head.bias", "head.weight"]
    assert "lora" not in dict(model.body[0].named_children())


CASES = [(m, d, b) for m in MODES for d in (2, 3) for b in (True, False)]


@pytest.mark.parametrize(("mode", "dims", "bias"), CASES)
def test_layer_matches_bitsandbytes_and_dequantized_reference(mode, dims, bias):
    dtype = _dtype(mode)
    layer = _converted_layer(mode, bias)
    lora = layer.lora
    x = torch.randn((5, IN) if dims == 2 else (2, 3, IN)).to(dtype).requires_grad_()
    params = [lora.A, lora.B]

    ours = _grads(layer, x, params)
    theirs = _grads(lambda t: _bnb_twin(layer)(t) + lora(t), x, params)
    w = dequantize_weight(layer, torch.float32).double()
    b = layer.bias.double() if bias else None

    def reference(t):
        t64 = t.double()
        delta = t64 @ lora.A.double().t() @ lora.B.double().t() * lora.scaling
        return (torch.nn.functional.linear(t64, w, b) + delta).to(t.dtype)

    expected = _grads(reference, x, params)
    assert ours[0].shape == (*x.shape[:-1], OUT) and ours[0].dtype == dtype
    for a, e in zip(ours, expected):
        _close(a, e, dtype)
    _close(ours[0], theirs[0], dtype)
    # bitsandbytes' 4-bit backward dequantizes into the quant state's dtype (float16: Lightning quantizes a
    # float16 copy) before casting; ours dequantizes into the gradient's dtype, so compare at float16 accuracy
    coarse = dtype if mode == "int8" else torch.float16
    for a, e in zip(ours[1:], theirs[1:]):
        _close(a, e, coarse)


def test_bf16_compute_of_a_float32_input():
    layer = _converted_layer("nf4-dq", True, dtype="bfloat16")
    assert layer.compute_dtype is torch.bfloat16
    x = torch.randn(7, IN, requires_grad=True)
    out, gx, ga, gb = _grads(layer, x, [layer.lora.A, layer.lora.B])
    assert out.dtype == gx.dtype == ga.dtype == gb.dtype == torch.float32
    w = dequantize_weight(layer, torch.float32).double()
    ref = torch.nn.functional.linear(x.double(), w, layer.bias.double())
    ref = ref + x.double() @ layer.lora.A.double().t() @ layer.lora.B.double().t() * layer.lora.scaling
    _close(out, ref, torch.bfloat16)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("lora_rank", [0, RANK])
def test_retained_bytes_are_exact(mode, lora_rank):
    layer = _converted_layer(mode, True, lora_rank=lora_rank)
    dtype = _dtype(mode)
    base = torch.randn(3, 10, IN).to(dtype).requires_grad_()
    with LivePeak() as lp:
        x = base * 1.0
        out = layer(x)
        x_bytes = x.untyped_storage().nbytes()
        del x
        retained = lp.live_bytes - out.untyped_storage().nbytes()
    # the base layer keeps nothing new; LoRA keeps its input as it came (for dA) and the float32 rank-r
    # intermediate (for dB); its float32 A and B are saved as they are, no copies
    assert retained == (0 if lora_rank == 0 else x_bytes + 30 * RANK * 4)
    if lora_rank == 0:
        return
    seen = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(t) or t, lambda t: t):
        layer(base)
    assert any(t is layer.weight for t in seen)
    assert not any(t.is_floating_point() and t.numel() == IN * OUT for t in seen), "no dequantized weight is saved"


def test_float_state_dict_is_requantized_on_cpu():
    plugin = NoSaveBitsandbytesPrecision("nf4", "float32", lora_rank=2)
    model = plugin.convert_module(nn.Sequential(nn.Linear(IN, OUT)))
    source = nn.Sequential(nn.Linear(IN, OUT))
    model.load_state_dict(source.state_dict(), strict=False)  # Lightning's load hook calls quantize_ (CPU here)
    assert model[0].weight.dtype == torch.uint8
    w = dequantize_weight(model[0], torch.float32)
    assert (w - source[0].weight).abs().max() <= 0.2 * source[0].weight.abs().max()
    torch.testing.assert_close(model[0].bias, source[0].bias)


def test_pickle_round_trip_keeps_the_layer_class():
    model = _converted_layer("int8", True)
    clone = pickle.loads(pickle.dumps(model))
    assert type(clone) is type(model) is plugin_module.NoSaveInt8Linear
    x = torch.randn(4, IN, dtype=torch.float16)
    torch.testing.assert_close(clone(x), model(x))


def test_trainer_accepts_the_plugin_on_cpu():
    plugin = NoSaveBitsandbytesPrecision("nf4", "bfloat16", lora_rank=RANK)
    trainer = Trainer(accelerator="cpu", plugins=[plugin], logger=False, enable_checkpointing=False)
    assert trainer.precision_plugin is plugin


# -- the example config ----------------------------------------------------------------------------------
def _assert_the_run_trained_in_bf16_with_nothing_stashed(trainer):
    """The config's plugin computes in bf16, the loss fell over 16 steps, the profiler saw nothing stashed."""
    from lightning_memkit.callbacks import SavedTensorProfiler
    from lightning_memkit.config.lightning_cli import LossTracker

    plugin = trainer.precision_plugin
    assert isinstance(plugin, NoSaveBitsandbytesPrecision) and plugin.dtype is torch.bfloat16
    tracker = next(cb for cb in trainer.callbacks if isinstance(cb, LossTracker))
    assert tracker.steps == 16 and tracker.last < tracker.first - 0.5
    report = next(cb for cb in trainer.callbacks if isinstance(cb, SavedTensorProfiler)).last_report
    assert report is not None and report.stashed_bytes == 0  # everything kept went through save_for_backward


def _assert_each_layer_keeps_only_its_packed_weight(converted, profile, seen):
    """Each quantized layer keeps its packed weight and quant state for backward, and no dense copy is saved."""
    for name, layer in converted.items():
        kept = [s for s in profile.storages if s.name == name]
        assert [s.kind for s in kept] == ["weight"] * len(kept)
        packed = sorted(t.untyped_storage().nbytes() for t in saved_weight_tensors(layer))
        assert sorted(s.nbytes for s in kept) == packed  # the packed weight and its quant state, nothing else
        dense = (layer.out_features, layer.in_features)
        assert not any(t.is_floating_point() and tuple(t.shape) in (dense, dense[::-1]) for t in seen)


def test_tiny_lm_qlora_config_trains_and_saves_no_dequantized_weight(tmp_path):
    from lightning_memkit.config.lightning_cli import MemkitCLI

    overrides = {
        "trainer.max_steps": 16, "trainer.limit_val_batches": 0, "trainer.enable_progress_bar": False,
        "trainer.logger": False, "trainer.default_root_dir": str(tmp_path), "model.d_model": 32,
        "model.n_layers": 1, "model.n_heads": 2, "model.seq_len": 32, "data.seq_len": 32, "data.batch_size": 8,
        "data.max_bytes": 50_000,
    }
    args = ["fit", "--config", str(CONFIG)] + [a for k, v in overrides.items() for a in (f"--{k}", str(v))]
    cli = MemkitCLI(args=args)
    trainer, model = cli.trainer, cli.model
    _assert_the_run_trained_in_bf16_with_nothing_stashed(trainer)

    converted = {n: m for n, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)}
    assert sorted(converted) == ["blocks.0.attn.proj", "blocks.0.attn.qkv", "blocks.0.mlp.0", "blocks.0.mlp.2"]
    tokens = torch.randint(0, 256, (2, 32))
    with trainer.precision_plugin.forward_context():
        profile = profile_saved_tensors(model, tokens)
        seen = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(t) or t, lambda t: t):
            model(tokens)
    _assert_each_layer_keeps_only_its_packed_weight(converted, profile, seen)


# -- CUDA ------------------------------------------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.parametrize("mode", MODES)
def test_cuda_conversion_and_reference(mode):
    dtype = torch.float16 if mode == "int8" else torch.bfloat16
    plugin = NoSaveBitsandbytesPrecision(mode, dtype, lora_rank=RANK)
    layer = plugin.convert_module(nn.Sequential(nn.Linear(IN, OUT)).cuda())[0]
    assert layer.weight.device.type == "cuda" and layer.weight.dtype in (torch.uint8, torch.int8)
    nn.init.normal_(layer.lora.B, std=0.3)
    x = torch.randn(2, 8, IN, device="cuda", dtype=dtype, requires_grad=True)
    out = layer(x)
    out.float().sum().backward()
    w = dequantize_weight(layer, torch.float32).double()
    ref = torch.nn.functional.linear(x.double(), w, layer.bias.double())
    ref = ref + x.double() @ layer.lora.A.double().t() @ layer.lora.B.double().t() * layer.lora.scaling
    _close(out, ref, dtype)
    assert layer.lora.A.grad is not None and x.grad is not None


@pytest.mark.cuda
def test_cuda_model_moved_after_cpu_conversion():
    plugin = NoSaveBitsandbytesPrecision("int8", lora_rank=RANK)
    model = plugin.convert_module(MLP()).cuda()  # quantized on CPU, then moved like Trainer does
    layer = model.body[0]
    assert layer.weight.device.type == "cuda" and layer.weight.SCB.device.type == "cuda"
    x = torch.randn(4, IN, device="cuda", dtype=torch.float16, requires_grad=True)
    model(x).float().sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


@pytest.mark.parametrize("mode", ["nf4", "int8"])
def test_a_converted_state_dict_is_restored_as_saved_not_quantized_again(mode):
    """Lightning's load hook would quantize the packed bytes as if they were values; the layer restores them (and
    their quant state) bit for bit instead."""
    plugin = NoSaveBitsandbytesPrecision(mode, _dtype(mode), lora_rank=2)
    torch.manual_seed(0)
    source = plugin.convert_module(nn.Sequential(nn.Linear(IN, OUT)))
    torch.manual_seed(1)
    target = plugin.convert_module(nn.Sequential(nn.Linear(IN, OUT)))
    assert not torch.equal(target[0].weight.detach(), source[0].weight.detach())
    target.load_state_dict(source.state_dict())
    for key, value in source.state_dict().items():
        assert torch.equal(target.state_dict()[key], value), key
    x = torch.randn(4, IN, dtype=_dtype(mode))
    torch.testing.assert_close(target(x), source(x), rtol=0, atol=0)


@pytest.mark.parametrize("mode", ["nf4", "int8"])
def test_a_peft_model_keeps_its_adapters_dense_and_its_base_layers_quantized(mode):
    """peft on a plain module (no transformers): the base layers and the other Linear layers are quantized, peft's
    lora_A / lora_B stay nn.Linear and alone keep requires_grad; the adapters' gradients are peft's own on the
    dequantized weights."""
    import copy

    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    original = peft.get_peft_model(MLP(), peft.LoraConfig(r=RANK, target_modules=["body.0", "head"]))
    for name, p in original.named_parameters():
        if "lora_B" in name:
            nn.init.normal_(p, std=0.1)
    dtype = _dtype(mode)
    model = NoSaveBitsandbytesPrecision(mode, dtype).convert_module(copy.deepcopy(original))
    quantized = {n.removeprefix("base_model.model.") for n, m in model.named_modules()
                 if isinstance(m, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt))}
    assert quantized == {"body.0.base_layer", "body.2", "head.base_layer"}
    dense = {n.removeprefix("base_model.model.") for n, m in model.named_modules() if type(m) is nn.Linear}
    assert dense == {f"{layer}.lora_{k}.default" for layer in ("body.0", "head") for k in "AB"}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {n for n, p in original.named_parameters() if p.requires_grad} and len(trainable) == 4
    reference = copy.deepcopy(original)
    with torch.no_grad():
        for name in quantized:
            layer = model.get_submodule(f"base_model.model.{name}")
            reference.get_submodule(f"base_model.model.{name}").weight.copy_(dequantize_weight(layer, torch.float32))
    x = torch.randn(8, IN)
    model(x.to(dtype)).float().square().mean().backward()
    reference(x).square().mean().backward()
    for name in trainable:
        got = dict(model.named_parameters())[name].grad.float()
        expected = dict(reference.named_parameters())[name].grad
        assert (got - expected).abs().max() <= TOL[dtype] * 10 * expected.abs().max(), name
