"""``memkit estimate --config`` of a fine-tune of a user's checkpoint (``PretrainedCausalLM``): built from its config in
the dtype it trains in (no weight read), with the QLoRA plugin's own adapters, within 5% of the measured peak."""

from __future__ import annotations

import json
import random

import pytest

pytest.importorskip("transformers")
pytest.importorskip("bitsandbytes")

from lightning_memkit.demo.hf_models import tiny_hf_causal_lm  # noqa: E402
from lightning_memkit.finetune import train_tokenizer  # noqa: E402

WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta"]


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    root = tmp_path_factory.mktemp("finetune")
    rng = random.Random(0)
    texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(10, 60))) for _ in range(40)]
    (root / "d.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    train_tokenizer(texts, root / "tok", vocab_size=300)
    tiny_hf_causal_lm("llama", hidden_size=64, num_layers=2, vocab_size=320, seed=0).save_pretrained(root / "m")
    path = root / "run.yaml"
    path.write_text(f"""
trainer:
  accelerator: cpu
  max_steps: 2
  plugins:
    - class_path: lightning_memkit.plugins.NoSaveBitsandbytesPrecision
      init_args: {{mode: nf4, dtype: bfloat16, lora_rank: 8}}
model:
  class_path: lightning_memkit.finetune.PretrainedCausalLM
  init_args: {{model: {root / "m"}, dtype: bfloat16}}
data:
  class_path: lightning_memkit.finetune.TextDataModule
  init_args: {{path: {root / "d.jsonl"}, tokenizer: {root / "tok"}, max_length: 64, batch_size: 4, val_fraction: 0}}
""")
    return path


def test_the_plugins_adapters_on_a_pretrained_checkpoint_estimate_within_5_percent(config, tmp_path):
    from lightning_memkit.config.comparison import compare
    from lightning_memkit.estimate.config import estimate_from_config

    est = estimate_from_config(config)
    # the weights are counted as loaded (bf16: 2 bytes each, before the plugin packs them), not read from disk
    embeddings = 2 * 320 * 64 * 2  # embed_tokens and lm_head, bf16
    assert est.phases[0].peak_bytes > embeddings
    assert est.trainable_parameters == 2 * 8 * ((64 + 64) + (64 + 32) * 2 + (64 + 64) + (64 + 128) * 3)
    result = compare(config, steps=2, out_dir=tmp_path)
    rows = {r.phase: r for r in result.rows}
    measured = max(rows["forward+backward"].memkit_bytes, rows["optimizer step"].memkit_bytes)
    assert abs(est.peak_bytes / measured - 1) <= 0.05, (est.peak_bytes, measured)


def test_a_full_fine_tune_of_bf16_weights_counts_them_in_bf16(config, tmp_path):
    """Without the plugin the weights train as loaded, in bf16: the load phase holds 2 bytes a parameter (and the
    rotary buffer), and the estimate says so."""
    import yaml

    from lightning_memkit.estimate.config import estimate_from_config

    parsed = yaml.safe_load(config.read_text())
    parsed["trainer"].pop("plugins")
    plain = tmp_path / "full.yaml"
    plain.write_text(yaml.safe_dump(parsed))
    est = estimate_from_config(plain)
    assert est.precision == "32-true (bfloat16 weights)"
    assert est.trainable_parameters == est.parameters
    assert 2 * est.parameters <= est.phases[0].peak_bytes <= 2 * est.parameters + 1024


def _estimated_within_5_percent(config, tmp_path, dropout: float) -> int:
    """Estimate and measure a full fine-tune of a tiny Llama with ``attention_dropout=dropout``: within 5% (attention
    dropout keeps its mask for backward; the estimate counts it as the measured run holds it). Returns the measured
    peak."""
    import yaml

    from lightning_memkit.config.comparison import compare
    from lightning_memkit.estimate.config import estimate_from_config

    tiny_hf_causal_lm("llama", hidden_size=64, num_layers=2, vocab_size=320, seed=0,
                      attention_dropout=dropout).save_pretrained(tmp_path / "m")
    parsed = yaml.safe_load(config.read_text())
    parsed["trainer"].pop("plugins")
    parsed["model"]["init_args"] = {"model": str(tmp_path / "m"), "dtype": "float32"}
    parsed["trainer"]["callbacks"] = [{"class_path": "lightning_memkit.callbacks.FusedLinearCrossEntropy"}]
    # every record longer than max_length: each step's batch is the longest one, as the estimate plans on
    rng = random.Random(1)
    data = tmp_path / "long.jsonl"
    data.write_text("".join(json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(90))}) + "\n"
                            for _ in range(16)))
    parsed["data"]["init_args"]["path"] = str(data)
    path = tmp_path / "dropout.yaml"
    path.write_text(yaml.safe_dump(parsed))
    est = estimate_from_config(path)
    result = compare(path, steps=2, out_dir=tmp_path / "out")
    rows = {r.phase: r for r in result.rows}
    measured = max(rows["forward+backward"].memkit_bytes, rows["optimizer step"].memkit_bytes)
    assert abs(est.peak_bytes / measured - 1) <= 0.05, (est.peak_bytes, measured)
    return measured


def test_a_pretrained_model_trains_with_its_dropout_on_and_estimates_within_5_percent(config, tmp_path):
    """from_pretrained returns the model in eval mode; PretrainedCausalLM trains it in training mode (dropout on, as
    transformers' Trainer does): the dropout masks are measured, more bytes than the same model without dropout,
    and both are estimated within 5%."""
    from lightning_memkit.finetune import PretrainedCausalLM

    tiny_hf_causal_lm("llama", seed=0, attention_dropout=0.1).save_pretrained(tmp_path / "m")
    lm = PretrainedCausalLM(str(tmp_path / "m"), dtype="float32")
    assert all(m.training for m in lm.modules())
    with_dropout = _estimated_within_5_percent(config, tmp_path / "a", 0.1)
    without = _estimated_within_5_percent(config, tmp_path / "b", 0.0)
    assert with_dropout > without
