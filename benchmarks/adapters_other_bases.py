"""Exported adapters served on the base ``memkit_base.json`` names and on other bases: how far the logits move.

A tiny Llama (bf16 checkpoint) is QLoRA-trained for 3 steps (nf4, bf16 compute; the plugin's own rank-4 adapters,
then peft's), its adapters exported, and served with transformers + peft on each base below; the table gives the
largest logit difference from the trained model in bf16 steps at the logits' scale and whether the greedy
generation (8 tokens) is the same. bitsandbytes' AVX512-BF16 CPU inference kernel is off except in the row that
names it. ``python -m benchmarks.adapters_other_bases`` (about a minute on 2 cores).
"""

from __future__ import annotations

import json
import tempfile
import warnings
from pathlib import Path

import torch

BASES = {  # row -> (from_pretrained dtype, BitsAndBytesConfig arguments or None; None: as memkit_base.json says)
    "as `memkit_base.json` says (nf4, bf16 compute)": None,
    "the same, bitsandbytes' AVX512-BF16 CPU kernel on": None,
    "nf4 with float32 compute": ("bfloat16", {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
                                              "bnb_4bit_compute_dtype": "float32"}),
    "fp4 instead of nf4": ("bfloat16", {"load_in_4bit": True, "bnb_4bit_quant_type": "fp4",
                                        "bnb_4bit_compute_dtype": "bfloat16"}),
    "dense bf16 (no quantization)": ("bfloat16", None),
    "dense float32": ("float32", None),
}


def _fit(folder: Path, peft: bool):
    from lightning.pytorch import Trainer

    from lightning_memkit.demo import ByteTextDataModule
    from lightning_memkit.demo.hf_models import tiny_hf_causal_lm
    from lightning_memkit.finetune import ExportAdapters, PretrainedCausalLM
    from lightning_memkit.plugins import NoSaveBitsandbytesPrecision

    torch.manual_seed(0)
    tiny_hf_causal_lm("llama", seed=0, dtype=torch.bfloat16).save_pretrained(folder / "base")
    lora = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "up_proj"]} if peft else None
    module = PretrainedCausalLM(str(folder / "base"), dtype="bfloat16", peft_lora=lora, lr=1e-2)
    export = ExportAdapters(str(folder / "adapters"))
    Trainer(accelerator="cpu", max_steps=3, logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, limit_val_batches=0, callbacks=[export],
            plugins=[NoSaveBitsandbytesPrecision("nf4", "bfloat16", lora_rank=0 if peft else 4)]).fit(
        module, ByteTextDataModule(batch_size=4, seq_len=32, batch_format="hf", max_bytes=20_000))
    return module.model.eval(), export.written


def _served(adapters: Path, row: str, spec) -> torch.nn.Module:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    meta = json.loads((adapters / "memkit_base.json").read_text())
    dtype, bnb = spec if spec is not None else (meta["dtype"], meta["bitsandbytes_config"])
    kwargs = {"dtype": getattr(torch, dtype)}
    if bnb:
        kwargs["quantization_config"] = BitsAndBytesConfig(**bnb)
    base = AutoModelForCausalLM.from_pretrained(meta["base_model_name_or_path"], **kwargs)
    for m in base.modules():
        if hasattr(m, "support_avx512bf16_for_cpu"):
            m.support_avx512bf16_for_cpu = m.support_avx512bf16_for_cpu and "kernel on" in row
    return PeftModel.from_pretrained(base, str(adapters)).eval()


def _outputs(model, ids):
    with torch.no_grad():
        return (model(input_ids=ids).logits.float(),
                model.generate(input_ids=ids, max_new_tokens=8, do_sample=False, pad_token_id=0))


def main() -> None:
    warnings.filterwarnings("ignore")
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    cells = {}
    for peft in (False, True):
        trained, adapters = _fit(Path(tempfile.mkdtemp()), peft)
        logits, generated = _outputs(trained, ids)
        step = 2.0 ** (torch.tensor(float(logits.abs().max())).log2().floor().item() - 7)
        for row, spec in BASES.items():
            theirs, their_generation = _outputs(_served(adapters, row, spec), ids)
            diff = float((theirs - logits).abs().max())
            same = "the same" if torch.equal(their_generation, generated) else "**differs**"
            cells.setdefault(row, []).append(f"{diff / step:.2f} steps ({diff:.4f}), {same}")
    print("| base loaded as | the plugin's own adapters | peft's adapters |")
    print("| --- | --- | --- |")
    for row, values in cells.items():
        print(f"| {row} | {' | '.join(values)} |")


if __name__ == "__main__":
    main()
