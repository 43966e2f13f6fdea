"""Exported adapters served on the base ``memkit_base.json`` names and on other bases: how far the logits move.

A tiny Llama (a bf16 checkpoint, then a float32 one, each loaded in its own dtype) is QLoRA-trained for 3 steps
(nf4, bf16 compute; the plugin's own rank-4 adapters, then peft's), its adapters exported, and served with
transformers + peft on each base below, and merged (``export_merged``, bf16) with transformers alone; the table gives
the largest logit difference from the trained model in bf16 steps at the logits' scale and whether the greedy
generation (8 tokens) is the same. bitsandbytes' AVX512-BF16 CPU inference kernel is off except in the row that
names it. ``python -m benchmarks.adapters_other_bases`` (about two minutes on 2 cores).
"""

from __future__ import annotations

import json
import tempfile
import warnings
from pathlib import Path

import torch

NF4 = {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_compute_dtype": "bfloat16"}
MERGED = "merged (`export_merged`, bf16), transformers alone"
BASES = {  # row -> (from_pretrained dtype, BitsAndBytesConfig arguments or None; None: as memkit_base.json says)
    "as `memkit_base.json` says (nf4, bf16 compute)": None,
    "in its own dtype (`dtype=\"auto\"`), the user's nf4 config": ("auto", NF4),
    "in bf16 (a float32 checkpoint cast), nf4": ("bfloat16", NF4),
    "the same as `memkit_base.json`, bitsandbytes' AVX512-BF16 CPU kernel on": None,
    "nf4 with float32 compute": ("bfloat16", {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
                                              "bnb_4bit_compute_dtype": "float32"}),
    "fp4 instead of nf4": ("bfloat16", {"load_in_4bit": True, "bnb_4bit_quant_type": "fp4",
                                        "bnb_4bit_compute_dtype": "bfloat16"}),
    "dense bf16 (no quantization)": ("bfloat16", None),
    "dense float32": ("float32", None),
}


def _fit(folder: Path, dtype: str, peft: bool):
    from lightning.pytorch import Trainer

    from lightning_memkit.demo import ByteTextDataModule
    from lightning_memkit.demo.hf_models import tiny_hf_causal_lm
    from lightning_memkit.finetune import ExportAdapters, PretrainedCausalLM
    from lightning_memkit.plugins import NoSaveBitsandbytesPrecision

    torch.manual_seed(0)
    tiny_hf_causal_lm("llama", seed=0, dtype=getattr(torch, dtype)).save_pretrained(folder / "base")
    lora = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "up_proj"]} if peft else None
    module = PretrainedCausalLM(str(folder / "base"), dtype=dtype, peft_lora=lora, lr=1e-2)
    export = ExportAdapters(str(folder / "adapters"))
    Trainer(accelerator="cpu", max_steps=3, logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, limit_val_batches=0, callbacks=[export],
            plugins=[NoSaveBitsandbytesPrecision("nf4", "bfloat16", lora_rank=0 if peft else 4)]).fit(
        module, ByteTextDataModule(batch_size=4, seq_len=32, batch_format="hf", max_bytes=20_000))
    return module, export.written


def _served(adapters: Path, row: str, spec) -> torch.nn.Module:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    meta = json.loads((adapters / "memkit_base.json").read_text())
    dtype, bnb = spec if spec is not None else (meta["dtype"], meta["bitsandbytes_config"])
    kwargs = {"dtype": dtype if dtype == "auto" else getattr(torch, dtype)}
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


def _merged(module, folder: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    from lightning_memkit.finetune import export_merged

    return AutoModelForCausalLM.from_pretrained(str(export_merged(module, folder / "merged"))).eval()


def main() -> None:
    warnings.filterwarnings("ignore")
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    cells, columns = {}, []
    for dtype in ("bfloat16", "float32"):
        for peft in (False, True):
            columns.append(f"{'bf16' if dtype == 'bfloat16' else 'float32'} checkpoint, "
                           f"{'peft' if peft else 'the plugin'}'s adapters")
            folder = Path(tempfile.mkdtemp())
            module, adapters = _fit(folder, dtype, peft)
            logits, generated = _outputs(module.model.eval(), ids)
            step = 2.0 ** (torch.tensor(float(logits.abs().max())).log2().floor().item() - 7)
            for row in [*BASES, MERGED]:
                model = _merged(module, folder) if row == MERGED else _served(adapters, row, BASES[row])
                theirs, their_generation = _outputs(model, ids)
                diff = float((theirs - logits).abs().max())
                same = "the same" if torch.equal(their_generation, generated) else "**differs**"
                cells.setdefault(row, []).append(f"{diff / step:.2f} ({diff:.4f}), {same}")
    print(f"| base loaded as | {' | '.join(columns)} |")
    print("| --- |" + " --- |" * len(columns))
    for row, values in cells.items():
        print(f"| {row} | {' | '.join(values)} |")


if __name__ == "__main__":
    main()
