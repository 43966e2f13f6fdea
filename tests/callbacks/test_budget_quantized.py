"""MemoryBudget on the runs users launch: a QLoRA + peft fine-tune (nf4, bf16) of their own checkpoint on
``TextDataModule`` text of 10 to 200 tokens, at 60% of the unbudgeted whole-fit peak: planned, within the budget,
the unbudgeted losses; a step whose prediction is wrong on purpose re-plans, and an out-of-memory error at step 3 is
recovered, both estimated from the quantized model as it is now."""

from __future__ import annotations

import json
import random
import warnings

import lightning.pytorch as pl
import pytest
import torch
from step_faults import InjectOOM, StepLosses, short_estimates

pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")

from lightning_memkit.callbacks import MemoryBudget  # noqa: E402
from lightning_memkit.demo.hf_models import tiny_hf_causal_lm  # noqa: E402
from lightning_memkit.estimate.module import ModuleRun  # noqa: E402
from lightning_memkit.finetune import PretrainedCausalLM, TextDataModule, train_tokenizer  # noqa: E402
from lightning_memkit.memory import LivePeak  # noqa: E402
from lightning_memkit.plugins import NoSaveBitsandbytesPrecision  # noqa: E402

STEPS = 5
LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}
WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa"]


@pytest.fixture(scope="module")
def user_files(tmp_path_factory):
    """A user's text (10 to 200 words a record), a tokenizer trained on it, and tiny checkpoints of two families."""
    root = tmp_path_factory.mktemp("user")
    rng = random.Random(0)
    texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(10, 200))) for _ in range(4 * STEPS)]
    (root / "train.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    train_tokenizer(texts, root / "tokenizer", vocab_size=300)
    for family in ("gemma3_text", "qwen3_moe"):
        tiny_hf_causal_lm(family, hidden_size=64, num_layers=2, vocab_size=320, seed=0).save_pretrained(root / family)
    return root


def _fit(root, family: str, *callbacks: pl.Callback) -> tuple[int, StepLosses, pl.Trainer]:
    """The whole fit (model loading included) under one LivePeak."""
    pl.seed_everything(0, verbose=False)
    losses = StepLosses()
    with LivePeak() as lp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = PretrainedCausalLM(str(root / family), dtype="bfloat16", peft_lora=LORA)
        data = TextDataModule(str(root / "train.jsonl"), str(root / "tokenizer"), max_length=256, packing=False,
                              batch_size=4, val_fraction=0)
        trainer = pl.Trainer(accelerator="cpu", max_steps=STEPS, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                             plugins=[NoSaveBitsandbytesPrecision("nf4", "bfloat16")],
                             callbacks=[losses, *callbacks])
        trainer.fit(model, data)
    return lp.peak_bytes, losses, trainer


@pytest.fixture(scope="module")
def as_is(user_files):
    return {family: _fit(user_files, family)[:2] for family in ("gemma3_text", "qwen3_moe")}


@pytest.mark.slow  # 35 s a family on 2 cores; the fast suite estimates the quantized model below
@pytest.mark.parametrize("family", ["gemma3_text", "qwen3_moe"])
def test_a_qlora_fine_tune_is_planned_replanned_and_recovered_with_the_same_losses(family, user_files, as_is,
                                                                                   monkeypatch) -> None:
    peak, reference = as_is[family]
    budget = MemoryBudget(int(peak * 0.6), allow=["recompute", "fused_loss", "micro_batch"])
    short_estimates(monkeypatch, int(peak * 0.1))
    fault = InjectOOM("forward", at_step=3)
    measured, losses, trainer = _fit(user_files, family, budget, fault)
    assert trainer.global_step == STEPS and fault.raised == 1
    assert budget.changes, "60% of the unbudgeted peak needs a plan"
    whys = [r.why for r in budget.replans]
    assert any(w.startswith("a step peaked at") for w in whys), budget.memory_effect()  # the wrong prediction
    assert "out of memory in the forward" in whys, budget.memory_effect()
    assert measured <= budget.budget_bytes, (measured, budget.budget_bytes, budget.memory_effect())
    torch.testing.assert_close(torch.tensor(losses.steps), torch.tensor(reference.steps), rtol=1e-4, atol=0)


def test_the_quantized_model_is_estimated_as_it_is_now(user_files) -> None:
    """A re-plan's estimate of the converted model (packed weights and their quant state as they are) predicts the
    step the estimate before the conversion predicted, within the 4-bit code tables' bytes (16 floats a layer)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = PretrainedCausalLM(str(user_files / "gemma3_text"), dtype="bfloat16", peft_lora=LORA)
    plugin = NoSaveBitsandbytesPrecision("nf4", "bfloat16")
    batch = {"input_ids": torch.randint(0, 300, (2, 64)), "labels": torch.randint(0, 300, (2, 64))}
    before = ModuleRun(model, batch, plugin=plugin)
    planned = before.estimate(before.base).peak_bytes
    plugin.convert_module(model)
    now = ModuleRun(model, batch, plugin=plugin)
    layers = len(plugin.quantized_weights)
    assert layers > 0
    assert 0 <= now.estimate(now.base).peak_bytes - planned <= 64 * layers
