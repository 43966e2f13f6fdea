"""MXFP4 GPT-OSS checkpoints into models built on the meta device: every tensor real, HF's own numbers."""

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from lightning.pytorch import Trainer  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from lightning_memkit.callbacks import MXFP4CheckpointLoader  # noqa: E402
from lightning_memkit.demo import ByteTextDataModule, HFCausalLM  # noqa: E402
from lightning_memkit.demo.hf_models import tiny_hf_config  # noqa: E402
from lightning_memkit.hf.meta_init import holds_hf_model, init_hf_buffers  # noqa: E402
from lightning_memkit.loading import load_mxfp4_into  # noqa: E402
from lightning_memkit.memory import LivePeak  # noqa: E402

ROPE = ["model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq"]
NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


def write_gpt_oss_mxfp4(directory, drop=()):
    """A GPT-OSS checkpoint laid out as the released ones: expert weights as blocks/scales, the rest bf16."""
    torch.manual_seed(1)
    model = transformers.GptOssForCausalLM(tiny_hf_config("gpt_oss")).to(torch.bfloat16)
    tensors = {}
    for name, t in model.state_dict().items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # [E, in, out] <- [E, out, in // 32, 16]
            experts, inp, out = t.shape
            tensors[name + "_blocks"] = torch.randint(0, 256, (experts, out, inp // 32, 16), dtype=torch.uint8)
            tensors[name + "_scales"] = torch.randint(119, 128, (experts, out, inp // 32), dtype=torch.uint8)
        elif name not in drop:
            tensors[name] = t.contiguous()
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    config = tiny_hf_config("gpt_oss", dtype="bfloat16")
    config.quantization_config = {"quant_method": "mxfp4", "modules_to_not_convert": NOT_CONVERTED}
    config.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_gpt_oss_mxfp4(tmp_path_factory.mktemp("gpt_oss_mxfp4"))


@pytest.fixture(scope="module")
def reference(checkpoint):
    """The same directory through transformers' own MXFP4 dequantization (CPU, offline, local files only)."""
    quant = transformers.Mxfp4Config(dequantize=True)
    return transformers.AutoModelForCausalLM.from_pretrained(checkpoint, quantization_config=quant).eval()


def meta_model(dtype=torch.bfloat16):
    with torch.device("meta"):
        if dtype is None:  # the plain constructor: float32 parameters
            return transformers.GptOssForCausalLM(tiny_hf_config("gpt_oss"))
        return transformers.AutoModelForCausalLM.from_config(tiny_hf_config("gpt_oss"), dtype=dtype)


def every_tensor(model):
    return list(model.named_parameters()) + list(model.named_buffers())


IDS = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(3))  # longer than the 16-token window


def test_meta_build_loads_to_the_same_logits_as_transformers(checkpoint, reference):
    model = meta_model()
    assert all(t.is_meta for _, t in every_tensor(model))
    result = load_mxfp4_into(model, checkpoint, device="cpu", init_buffers=init_hf_buffers)
    assert [n for n, t in every_tensor(model) if t.is_meta or t.device.type != "cpu"] == []
    assert result.initialized == ROPE
    assert sorted(result.dequantized) == sorted(f"model.layers.{i}.mlp.experts.{w}" for i in range(2)
                                                for w in ("gate_up_proj", "down_proj"))
    ours, theirs = model.state_dict(), reference.state_dict()
    assert ours.keys() == theirs.keys()
    for name, t in theirs.items():
        assert t.dtype == ours[name].dtype and torch.equal(ours[name], t), name
    with torch.no_grad():
        assert torch.equal(model.eval()(input_ids=IDS).logits, reference(input_ids=IDS).logits)


def test_rotary_buffers_equal_a_normally_built_model(checkpoint):
    model = meta_model()
    result = load_mxfp4_into(model, checkpoint, device="cpu")  # a transformers model: init_hf_buffers by default
    assert result.initialized == ROPE
    normal = transformers.AutoModelForCausalLM.from_config(tiny_hf_config("gpt_oss"), dtype=torch.bfloat16)
    ours, theirs = model.model.rotary_emb, normal.model.rotary_emb
    assert ours.rope_type == theirs.rope_type == "yarn"
    assert ours.inv_freq.dtype == theirs.inv_freq.dtype == torch.float32
    assert torch.equal(ours.inv_freq, theirs.inv_freq)
    assert torch.equal(ours.original_inv_freq, theirs.original_inv_freq)
    assert ours.attention_scaling == theirs.attention_scaling != 1.0  # yarn's factor, computed in __init__
    assert not hasattr(ours.inv_freq, "_is_hf_initialized") or not ours.inv_freq._is_hf_initialized
    assert all(not getattr(p, "_is_hf_initialized", False) for p in model.parameters())  # flags put back


def test_plain_float32_constructor_matches_transformers_in_float32(checkpoint, reference):
    """``GptOssForCausalLM(config)`` makes float32 parameters: the same values, upcast (MXFP4 values fit bf16)."""
    model = meta_model(dtype=None)
    load_mxfp4_into(model, checkpoint, device="cpu", init_buffers=init_hf_buffers)
    assert model.dtype == torch.float32
    reference32 = copy.deepcopy(reference).float()
    for name, t in reference32.state_dict().items():
        assert torch.equal(model.state_dict()[name], t), name
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(input_ids=IDS).logits, reference32(input_ids=IDS).logits,
                                   rtol=1e-5, atol=1e-5)


def test_without_init_buffers_a_module_that_is_no_transformers_model_is_refused_by_name(checkpoint):
    module = torch.nn.Module()
    module.rope = meta_model().model.rotary_emb  # a transformers module, but no PreTrainedModel holds it
    with pytest.raises(ValueError, match=r"rope\.inv_freq, rope\.original_inv_freq: non-persistent buffer\(s\) on the "
                                         r"meta device, which no checkpoint holds; pass init_buffers=") as info:
        load_mxfp4_into(module, checkpoint, device="cpu", strict=False)
    assert "nothing was loaded" in str(info.value)
    assert all(t.is_meta for _, t in every_tensor(module))


def test_leftover_meta_tensor_is_named_before_anything_loads(tmp_path):
    path = write_gpt_oss_mxfp4(tmp_path, drop=("model.norm.weight",))
    model = meta_model()
    with pytest.raises(ValueError, match=r"model\.norm\.weight: on the meta device with no checkpoint entry, so it "
                                         r"would stay there"):
        load_mxfp4_into(model, path, device="cpu", strict=False, init_buffers=init_hf_buffers)
    assert all(t.is_meta for _, t in every_tensor(model))


def test_failing_buffer_init_puts_everything_back(checkpoint):
    model = meta_model()

    def broken(module, names):
        raise RuntimeError("rope init failed")

    with pytest.raises(RuntimeError, match="rope init failed"):
        load_mxfp4_into(model, checkpoint, device="cpu", init_buffers=broken)
    assert all(t.is_meta for _, t in every_tensor(model))
    with pytest.raises(ValueError, match=r"model\.rotary_emb\.original_inv_freq: init_buffers did not write it"):
        load_mxfp4_into(model, checkpoint, device="cpu", init_buffers=lambda m, n: m.model.rotary_emb.inv_freq.zero_())
    assert all(t.is_meta for _, t in every_tensor(model))


def test_init_hf_buffers_refuses_a_buffer_outside_any_pretrained_model():
    module = torch.nn.Module()
    module.register_buffer("scale", torch.empty(2), persistent=False)
    with pytest.raises(ValueError, match="scale: no transformers PreTrainedModel holds it"):
        init_hf_buffers(module, ["scale"])


def test_memory_report_of_the_load(checkpoint):
    model = meta_model()
    with LivePeak() as outer:
        result = load_mxfp4_into(model, checkpoint, device="cpu", init_buffers=init_hf_buffers)
    report = result.memory
    assert report.tensor_peak_bytes == outer.peak_bytes  # the same exact count
    final = sum(t.untyped_storage().nbytes() for _, t in every_tensor(model))
    assert report.tensor_peak_bytes >= final
    assert report.rss_peak_bytes >= report.rss_start_bytes and report.rss_method in ("vmhwm", "sampled")
    assert "host RSS peak" in str(report) and "tensor storage peak" in str(report)


class MetaGptOss(HFCausalLM):
    """HFCausalLM whose GPT-OSS model is built on the meta device in ``__init__`` (no memory until loaded)."""

    def __init__(self):
        super().__init__(family="gpt_oss", num_layers=1)
        with torch.device("meta"):
            self.model = transformers.AutoModelForCausalLM.from_config(tiny_hf_config("gpt_oss"),
                                                                       dtype=torch.bfloat16)
        self.logits_at_start = None

    def on_fit_start(self):
        with torch.no_grad():
            self.logits_at_start = self.model.eval()(input_ids=IDS).logits
        self.model.train()


def test_callback_loads_a_meta_built_model_inside_a_trainer(checkpoint, reference):
    module = MetaGptOss()
    assert holds_hf_model(module) and all(t.is_meta for _, t in every_tensor(module.model))
    loader = MXFP4CheckpointLoader(str(checkpoint), submodule="model")
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=2, callbacks=[loader], logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      limit_val_batches=0)
    trainer.fit(module, datamodule=ByteTextDataModule(batch_size=2, seq_len=16, batch_format="hf", max_bytes=20_000))
    with torch.no_grad():
        assert torch.equal(module.logits_at_start, reference(input_ids=IDS).logits)
    assert loader.result.initialized == ROPE and loader.result.memory is not None
    assert not any(t.is_meta for _, t in every_tensor(module))
    assert trainer.global_step == 2
