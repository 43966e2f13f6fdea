"""Quantized pipeline stages (``memkit estimate --pipeline N --plugin nf4-lora``, a plan's stages under QLoRA): the
model converted by the plugin as ``memkit_pipeline``'s setup converts it, each layer's bytes measured on fake tensors;
the same measurement on the real converted model gives the same split and per-rank peaks."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("bitsandbytes")


def test_quantized_stages_are_estimated_as_the_real_converted_layers_measure(tmp_path):
    from lightning_memkit.demo.hf_models import tiny_hf_config
    from lightning_memkit.estimate.hf_run import HFRun
    from lightning_memkit.estimate.hf_step import model_factory
    from lightning_memkit.estimate.levers.quantization import qlora_plugin
    from lightning_memkit.estimate.step import build_model, resolve_optimizer
    from lightning_memkit.hf.pipeline_stages import causal_lm_stages
    from lightning_memkit.pipeline import partition_layers
    from lightning_memkit.pipeline.runtime import measure_pipeline_costs

    path = tmp_path / "config.json"
    path.write_text(tiny_hf_config("llama", hidden_size=64, num_layers=4, vocab_size=1000).to_json_string())
    run = HFRun(path, seq_len=32, batch_size=2, device="cpu", plugin="nf4-lora", precision="bf16-true", lora_rank=8)
    plain = HFRun(path, seq_len=32, batch_size=2, device="cpu", precision="bf16-true")
    est = run.estimate(run.base.replace(stages=2)).partition
    assert max(est.predicted_peak_bytes) < max(plain.estimate(plain.base.replace(stages=2)).partition
                                               .predicted_peak_bytes)

    plugin = qlora_plugin("nf4-lora", "bf16-true", 8)
    net = build_model(model_factory(run.config, torch.bfloat16), "32-true", plugin)
    split = causal_lm_stages(net)
    ids = torch.randint(0, 1000, (1, 32))  # one microbatch of the 2
    inputs, target = split.inputs({"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids)})
    with plugin.forward_context():
        costs = measure_pipeline_costs(list(split.layers), inputs, target, loss_fn=split.loss,
                                       optimizer=resolve_optimizer("adamw", None)[0](net))
    real = partition_layers(costs, 2, schedule="1f1b", microbatches=2)
    assert est.sizes == real.sizes
    for fake, measured in zip(est.predicted_peak_bytes, real.predicted_peak_bytes, strict=True):
        assert fake == pytest.approx(measured, rel=0.01)
