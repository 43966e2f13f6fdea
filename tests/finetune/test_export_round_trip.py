"""The adapters of a QLoRA fit, exported (``ExportAdapters``), load elsewhere with plain transformers + peft +
bitsandbytes (a process that never imports this package), with ``memkit_base.json``'s settings or with none (the
base loaded in its own dtype and quantized by the user's ``BitsAndBytesConfig``: the plugin quantizes the weights as
loaded and keeps the rest as loaded, as transformers does, so both give the base it trained on). On bitsandbytes'
dequantize-then-matmul path (its path on CUDA for prompts, in training, and on CPUs without its AVX512-BF16 kernel),
for bf16 and fp32 checkpoints: the trained model's greedy generation, and its logits bitwise with the plugin's own
adapters, within one bf16 step (at the logits' scale) with peft's. With that AVX512-BF16 CPU inference kernel (its
own accumulation order): within 2 bf16 steps."""

import json
import subprocess
import sys
import warnings

import pytest
import torch
from lightning.pytorch import Trainer

pytest.importorskip("bitsandbytes")
pytest.importorskip("peft")

from lightning_memkit.demo import ByteTextDataModule  # noqa: E402
from lightning_memkit.demo.hf_models import tiny_hf_causal_lm  # noqa: E402
from lightning_memkit.finetune import ExportAdapters, PretrainedCausalLM, export_adapters, export_merged  # noqa: E402
from lightning_memkit.finetune.export import BASE_FILE  # noqa: E402
from lightning_memkit.plugins import NoSaveBitsandbytesPrecision  # noqa: E402

ELSEWHERE = """
import json, sys, torch
from pathlib import Path
from peft import PeftModel
from transformers import AutoModelForCausalLM, BitsAndBytesConfig

adapters, out = Path(sys.argv[1]), Path(sys.argv[2])
meta = json.loads((adapters / "memkit_base.json").read_text())
kwargs = {"dtype": getattr(torch, meta["dtype"])}
if meta["bitsandbytes_config"]:
    kwargs["quantization_config"] = BitsAndBytesConfig(**meta["bitsandbytes_config"])
base = AutoModelForCausalLM.from_pretrained(meta["base_model_name_or_path"], **kwargs)
model = PeftModel.from_pretrained(base, str(adapters)).eval()
ids = torch.load(out / "ids.pt")
served, layers = {}, [m for m in model.modules() if hasattr(m, "support_avx512bf16_for_cpu")]
kernel = [m.support_avx512bf16_for_cpu for m in layers]  # bitsandbytes' AVX512-BF16 CPU inference kernel
for path in ("dequantize", "default"):  # the kernel repacks the weights for good: dequantize-then-matmul first
    for m, default in zip(layers, kernel):
        m.support_avx512bf16_for_cpu = default and path == "default"
    with torch.no_grad():
        served[path] = {"logits": model(input_ids=ids).logits.float(), "generated": model.generate(
            input_ids=ids, max_new_tokens=8, do_sample=False, pad_token_id=0)}
torch.save(served, out / "theirs.pt")
assert "lightning_memkit" not in sys.modules
"""


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    """``fitted(dtype, peft) -> (module, adapters directory, base directory)``: each fit made once per module (the
    adapter and merged exports of a fit are tested on the same trained model)."""
    fits = {}

    def get(dtype: str, peft: bool):
        if (dtype, peft) not in fits:
            folder = tmp_path_factory.mktemp(f"fit-{dtype}-{'peft' if peft else 'own'}")
            fits[dtype, peft] = (*_fit(folder, dtype, peft), folder / "base")
        return fits[dtype, peft]

    return get


def _fit(tmp_path, dtype: str, peft: bool):
    torch.manual_seed(0)  # the adapters' initialisation: the measured gaps below are this fit's
    base = tmp_path / "base"
    tiny_hf_causal_lm("llama", seed=0, dtype=getattr(torch, dtype)).save_pretrained(base)
    lora = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "up_proj"]} if peft else None
    module = PretrainedCausalLM(str(base), dtype=dtype, peft_lora=lora, lr=1e-2)
    export = ExportAdapters(str(tmp_path / "adapters"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        Trainer(accelerator="cpu", max_steps=3, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                enable_model_summary=False, limit_val_batches=0, callbacks=[export],
                plugins=[NoSaveBitsandbytesPrecision("nf4", "bfloat16", lora_rank=0 if peft else 4)]).fit(
            module, ByteTextDataModule(batch_size=4, seq_len=32, batch_format="hf", max_bytes=20_000))
    return module, export.written


@pytest.mark.parametrize("dtype", ["bfloat16", pytest.param("float32", marks=pytest.mark.slow)])
@pytest.mark.parametrize("peft", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["own_adapters", "peft_adapters"])  # peft's adapters served in the fast suite below
def test_exported_adapters_give_the_trained_model_in_plain_transformers_and_peft(tmp_path, fitted, dtype, peft):
    module, written, base = fitted(dtype, peft)
    meta = json.loads((written / BASE_FILE).read_text())
    assert meta == {"base_model_name_or_path": str(base), "dtype": dtype, "bitsandbytes_config": {
        "load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": False,
        "bnb_4bit_compute_dtype": "bfloat16"}}
    ours, theirs = _served_elsewhere(module, ELSEWHERE, written, tmp_path, "theirs.pt")
    exact = theirs["dequantize"]
    assert torch.equal(exact["generated"], ours["generated"])
    if peft:  # trained, peft's plain Linear wrapper adds the float32 update to the base's output, then rounds;
        assert _steps(exact["logits"], ours["logits"]) <= 1.0  # served, its 4-bit wrapper rounds both first
    else:
        assert torch.equal(exact["logits"], ours["logits"])
    # measured on this kernel: 1.0-1.5 (peft's adapters) and 1.0-2.0 steps (the plugin's; 2.0: another greedy
    # generation) on bf16 and float32 checkpoints
    assert _steps(theirs["default"]["logits"], ours["logits"]) <= 2.0


PLAIN = """
import sys, torch
from pathlib import Path
from peft import PeftModel
from transformers import AutoModelForCausalLM, BitsAndBytesConfig

adapters, out = Path(sys.argv[1]), Path(sys.argv[2])
quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)
base = AutoModelForCausalLM.from_pretrained(sys.argv[3], dtype="auto", quantization_config=quantization)
model = PeftModel.from_pretrained(base, str(adapters)).eval()
for m in model.modules():  # bitsandbytes' dequantize-then-matmul path
    if hasattr(m, "support_avx512bf16_for_cpu"):
        m.support_avx512bf16_for_cpu = False
ids = torch.load(out / "ids.pt")
with torch.no_grad():
    torch.save({"logits": model(input_ids=ids).logits.float(), "generated": model.generate(
        input_ids=ids, max_new_tokens=8, do_sample=False, pad_token_id=0)}, out / "plain.pt")
assert "lightning_memkit" not in sys.modules
"""


@pytest.mark.parametrize("dtype", [pytest.param("bfloat16", marks=pytest.mark.slow), "float32"])
@pytest.mark.parametrize("peft", [pytest.param(False, marks=pytest.mark.slow), True],
                         ids=["own_adapters", "peft_adapters"])
def test_adapters_serve_as_trained_on_the_base_loaded_in_its_own_dtype(tmp_path, fitted, dtype, peft):
    """The user's own serving, ignoring ``memkit_base.json``: the checkpoint loaded as saved (``dtype="auto"``) and
    quantized by a ``BitsAndBytesConfig`` of the same type and compute dtype. A float32 checkpoint quantized from
    its bf16 cast (the plugin's former convention) served 5.7 (peft's) and 8.1 (the plugin's adapters) bf16 steps
    off; quantized and kept as loaded: 0."""
    module, written, base = fitted(dtype, peft)
    ours, plain = _served_elsewhere(module, PLAIN, written, tmp_path, "plain.pt", str(base))
    assert torch.equal(plain["generated"], ours["generated"])
    assert _steps(plain["logits"], ours["logits"]) <= (1.0 if peft and dtype == "bfloat16" else 0.0)


def _served_elsewhere(module, script: str, exported, tmp_path, result: str, *args: str) -> tuple[dict, dict]:
    """``(ours, theirs)``: the trained ``module``'s logits and greedy generation, and what ``script`` (a process of
    its own, serving ``exported``) saved to ``result``, on the same input."""
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    torch.save(ids, tmp_path / "ids.pt")
    model = module.model.eval()
    with torch.no_grad():
        ours = {"logits": model(input_ids=ids).logits.float(),
                "generated": model.generate(input_ids=ids, max_new_tokens=8, do_sample=False, pad_token_id=0)}
    (tmp_path / "serve.py").write_text(script)
    ran = subprocess.run([sys.executable, str(tmp_path / "serve.py"), str(exported), str(tmp_path), *args],
                         capture_output=True, text=True)
    assert ran.returncode == 0, ran.stderr[-3000:]
    return ours, torch.load(tmp_path / result)


def _steps(theirs: torch.Tensor, ours: torch.Tensor) -> float:
    """The largest difference in bf16 steps at the logits' scale."""
    return float((theirs - ours).abs().max()) / _bf16_step(ours)


def _bf16_step(logits: torch.Tensor) -> float:
    """One bf16 step at the logits' scale: the spacing of bf16 numbers at the largest magnitude."""
    top = float(logits.abs().max())
    return 2.0 ** (torch.tensor(top).log2().floor().item() - 7)


def test_a_model_without_adapters_is_refused(tmp_path):
    base = tmp_path / "base"
    tiny_hf_causal_lm("llama", seed=0).save_pretrained(base)
    module = PretrainedCausalLM(str(base), dtype="float32")
    with pytest.raises(ValueError, match="the model has no adapters"):
        export_adapters(module, tmp_path / "out")
    assert not (tmp_path / "out").exists()  # refused before anything is written


MERGED = """
import sys, torch
from pathlib import Path
from transformers import AutoModelForCausalLM

merged, out = Path(sys.argv[1]), Path(sys.argv[2])
model = AutoModelForCausalLM.from_pretrained(str(merged)).eval()
ids = torch.load(out / "ids.pt")
with torch.no_grad():
    logits = model(input_ids=ids).logits.float()
    generated = model.generate(input_ids=ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
torch.save({"logits": logits, "generated": generated}, out / "merged.pt")
assert not {"lightning_memkit", "peft", "bitsandbytes"} & set(sys.modules), "served by transformers alone"
"""


@pytest.mark.parametrize("dtype", ["bfloat16", pytest.param("float32", marks=pytest.mark.slow)])
@pytest.mark.parametrize("peft", [pytest.param(False, marks=pytest.mark.slow), True],
                         ids=["own_adapters", "peft_adapters"])  # own adapters round-trip in the fast suite above
def test_the_merged_export_serves_with_transformers_alone(tmp_path, fitted, dtype, peft):
    """Not bitwise (``W + scaling * B @ A`` rounded once to bf16, where the trained model adds the rounded update
    to the base's output), measured 1.00 (peft's adapters) and 1.03 (the plugin's) bf16 steps off the trained
    model on a CPU with bf16 kernels, 1.5 (the plugin's) on one without (AVX2: the matmuls round otherwise), the
    same greedy generation up to a near tie: where the two part, the trained model's own two choices are within
    those 2 bf16 steps of each other (on a CPU with bf16 kernels, the same generation). A float32 checkpoint's
    merged bf16 export: 1.16 (peft's) and 1.76 steps (the plugin's) on this AVX2 CPU."""
    module, _, _ = fitted(dtype, peft)
    merged = export_merged(module, tmp_path / "merged")
    ours, theirs = _served_elsewhere(module, MERGED, merged, tmp_path, "merged.pt")
    assert _steps(theirs["logits"], ours["logits"]) <= 2
    for mine, other in zip(ours["generated"], theirs["generated"], strict=True):
        parted = (mine != other).nonzero()
        if len(parted):
            k = int(parted[0])
            with torch.no_grad():
                logits = module.model(input_ids=mine[None, :k]).logits[0, -1].float()
            assert logits[mine[k]] - logits[other[k]] <= 2 * _bf16_step(logits), (k, mine, other)


def test_the_merge_refuses_dora_and_matches_peft_merge_and_unload(tmp_path):
    """Unquantized, the merge is peft's own ``merge_and_unload`` to float32 rounding; DoRA is refused, not merged
    as plain LoRA."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = get_peft_model(tiny_hf_causal_lm("llama", seed=0), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    out = export_merged(model, tmp_path / "merged", dtype=torch.float32)
    from safetensors.torch import load_file

    ours = load_file(out / "model.safetensors")
    reference = model.merge_and_unload().state_dict()
    for key, value in ours.items():
        torch.testing.assert_close(value, reference[key], rtol=1e-6, atol=1e-6, msg=key)
    dora = get_peft_model(tiny_hf_causal_lm("llama", seed=0),
                          LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], use_dora=True))
    with pytest.raises(ValueError, match="DoRA adapters"):
        export_merged(dora, tmp_path / "dora")


def test_export_adapters_refuses_a_model_without_adapters_before_training(tmp_path):
    from lightning_memkit.demo import HFCausalLM

    steps = []

    class Count(ExportAdapters):
        def on_train_batch_end(self, *args):
            steps.append(1)

    with pytest.raises(ValueError, match="the model has no adapters"):
        Trainer(accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                enable_model_summary=False, limit_val_batches=0, callbacks=[Count(str(tmp_path / "a"))]).fit(
            HFCausalLM("llama"), ByteTextDataModule(batch_size=4, seq_len=32, batch_format="hf", max_bytes=20_000))
    assert steps == [] and not (tmp_path / "a").exists()


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])  # experts (E, out, in); (E, in, out) with biases
def test_the_merge_dequantizes_quantized_experts_in_transformers_layout(tmp_path, family):
    """A quantized MoE model with peft's adapters on attention (its experts quantized, frozen, not adapted): the
    merged checkpoint holds each expert weight as the plugin's packed copy dequantizes it, in transformers'
    layout, and loads in transformers alone."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from lightning_memkit.hf.qlora import dequantized_experts, expert_modules

    torch.manual_seed(0)
    model = get_peft_model(tiny_hf_causal_lm(family, seed=0), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]))
    NoSaveBitsandbytesPrecision("nf4", "bfloat16").convert_module(model)
    merged = AutoModelForCausalLM.from_pretrained(str(export_merged(model, tmp_path / "merged")), dtype=torch.bfloat16)
    experts = expert_modules(model.base_model.model, include_converted=True)
    assert experts
    for name, module in experts:
        loaded = merged.get_submodule(name.removeprefix("base_model.model."))
        for proj, dense in dequantized_experts(module).items():
            assert torch.equal(getattr(loaded, proj), dense.to(torch.bfloat16)), proj
