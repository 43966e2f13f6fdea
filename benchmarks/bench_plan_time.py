"""How long MemoryBudget plans the runs users launch: bf16 and QLoRA + peft fine-tunes of their own checkpoint.

A tiny Gemma3 and a tiny Qwen3-MoE (hidden 128, 4 decoder layers, vocabulary 512; random weights saved with
``save_pretrained``, loaded back by ``PretrainedCausalLM``) on ``TextDataModule`` text of 10 to 400 tokens (one padded
record a row, batches of 4, ``longest_batch()`` 4 x 400), each trained ``bf16-true`` and as nf4 QLoRA with peft
adapters (``NoSaveBitsandbytesPrecision("nf4", "bfloat16")``, rank 8 on the attention projections). Per run:

- one estimate of the run as given (``ModuleRun.estimate``, the step MemoryBudget predicts), and one of the same
  model in float32 without the plugin: the goal is at most twice the float32 estimate;
- MemoryBudget's search at 60% of that prediction with its default levers (the time in its ``setup``; goal under
  30 s), the number of estimates it ran and the plan it chose;
- the fit that follows (2 optimizer steps, model and data set-up excluded) for scale.

All on CPU with this machine's two threads; the plans are ranked with the H100 balance
(``MemoryBudget(machine="h100")``) so the chosen plan does not depend on the machine's load. ``quick=True`` runs
the Gemma3 QLoRA case alone.

    python -m benchmarks.run --only plan_time --device cpu
"""

from __future__ import annotations

import json
import random
import tempfile
import time
import warnings
from pathlib import Path

import torch

from benchmarks.common import record

CASES = [("gemma3_text", "bf16"), ("gemma3_text", "qlora"), ("qwen3_moe", "bf16"), ("qwen3_moe", "qlora")]
WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa"]
LORA = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}
GOAL_SEARCH_S = 30.0


def _files(root: Path) -> None:
    from lightning_memkit.demo.hf_models import tiny_hf_causal_lm
    from lightning_memkit.finetune import train_tokenizer

    rng = random.Random(0)
    texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 200))) for _ in range(64)]
    (root / "train.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    train_tokenizer(texts, root / "tokenizer", vocab_size=300)
    for family in ("gemma3_text", "qwen3_moe"):
        tiny_hf_causal_lm(family, hidden_size=128, num_layers=4, vocab_size=512, seed=0).save_pretrained(root / family)


def _parts(root: Path, family: str, mode: str, dtype: str = "bfloat16"):
    from lightning_memkit.finetune import PretrainedCausalLM, TextDataModule
    from lightning_memkit.plugins import NoSaveBitsandbytesPrecision

    model = PretrainedCausalLM(str(root / family), dtype=dtype, peft_lora=LORA if mode == "qlora" else None)
    data = TextDataModule(str(root / "train.jsonl"), str(root / "tokenizer"), max_length=400, packing=False,
                          batch_size=4, val_fraction=0)
    plugin = NoSaveBitsandbytesPrecision("nf4", "bfloat16") if mode == "qlora" else None
    return model, data, plugin


def _estimate_seconds(root: Path, family: str, mode: str, float32: bool) -> tuple[float, int]:
    from lightning_memkit.estimate.module import ModuleRun

    model, data, plugin = _parts(root, family, mode, "float32" if float32 else "bfloat16")
    data.setup("fit")
    batch = data.longest_batch()
    run = ModuleRun(model, batch, precision="32-true" if float32 or plugin else "bf16-true",
                    plugin=None if float32 else plugin)
    start = time.perf_counter()
    peak = run.estimate(run.base).peak_bytes
    return time.perf_counter() - start, peak


def _search_and_fit(root: Path, family: str, mode: str, budget: int) -> dict:
    import lightning.pytorch as pl

    from lightning_memkit.callbacks import MemoryBudget
    from lightning_memkit.estimate.module import ModuleRun

    calls = []
    estimate = ModuleRun.estimate

    class Timed(MemoryBudget):
        seconds = 0.0

        def setup(self, trainer, pl_module, stage):
            start = time.perf_counter()
            super().setup(trainer, pl_module, stage)
            self.seconds += time.perf_counter() - start

    class FitClock(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            self.start = time.perf_counter()

        def on_train_end(self, trainer, pl_module):
            self.seconds = time.perf_counter() - self.start

    model, data, plugin = _parts(root, family, mode)
    budget_cb, clock = Timed(budget, machine="h100"), FitClock()  # plans ranked alike on any machine
    kwargs = {"plugins": [plugin]} if plugin is not None else {"precision": "bf16-true"}
    ModuleRun.estimate = lambda self, plan: calls.append(1) or estimate(self, plan)
    try:
        pl.seed_everything(0, verbose=False)
        trainer = pl.Trainer(accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                             callbacks=[budget_cb, clock], **kwargs)
        trainer.fit(model, data)
    finally:
        ModuleRun.estimate = estimate
    return {"search_s": round(budget_cb.seconds, 1), "estimates": len(calls), "fit_s": round(clock.seconds, 1),
            "plan": "; ".join(budget_cb.changes) or "the run as given",
            "predicted_mib": round(budget_cb.plan.peak_bytes / 2**20, 2)}


def run(device: str = "cpu", quick: bool = False) -> list[dict]:
    if device != "cpu":
        return []
    entries = []
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        root = Path(tmp)
        _files(root)
        torch.set_num_threads(2)
        for family, mode in CASES[1:2] if quick else CASES:
            f32_s, _ = _estimate_seconds(root, family, mode, float32=True)
            est_s, peak = _estimate_seconds(root, family, mode, float32=False)
            found = _search_and_fit(root, family, mode, int(peak * 0.6))
            label = "bf16-true" if mode == "bf16" else "nf4 QLoRA + peft (bf16)"
            ratio = est_s / f32_s
            met = found["search_s"] < GOAL_SEARCH_S and ratio <= 2.0
            rows = [{"impl": "float32 estimate (reference)", "seconds": round(f32_s, 2)},
                    {"impl": f"{label} estimate", "seconds": round(est_s, 2), "x_float32": round(ratio, 2)},
                    {"impl": "MemoryBudget search at 60% of the prediction", "seconds": found["search_s"],
                     "estimates": found["estimates"], "plan": found["plan"],
                     "predicted_mib": found["predicted_mib"], "budget_mib": round(peak * 0.6 / 2**20, 2)},
                    {"impl": "the fit after it (2 steps)", "seconds": found["fit_s"]}]
            entries.append(record("plan_time", f"{family} {label}, 4 x 400 tokens", "float32 estimate", rows,
                                  goal=f"search < {GOAL_SEARCH_S:.0f} s and estimate <= 2x float32", met=met))
    return entries
