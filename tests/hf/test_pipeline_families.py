"""memkit_pipeline on any decoder-only transformers causal LM: read from the model, not from a list of names.

Single process (default): the stages of Gemma2, Gemma3 (text), Phi3, Qwen2-MoE, OLMoE and DeepSeek-V3 give HF's
loss and gradients (padding, fused loss), each family's own pieces (per-type rotary pairs, final-logit softcap,
router aux loss where the family has one), the refusals (layout, layer kinds, masks the family never builds, the
probe) and ``memkit estimate --pipeline`` on new families. Slow: the same families on 2 gloo ranks against a plain
Trainer, and every causal LM family transformers registers either reproduced or refused.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
import ranks
import torch
from torch import nn
from torch.torch_version import TorchVersion

transformers = pytest.importorskip("transformers")

from lightning_memkit.demo.hf_models import TINY_HF_FAMILIES, tiny_hf_causal_lm, tiny_hf_config  # noqa: E402
from lightning_memkit.hf.pipeline_stages import (  # noqa: E402
    TESTED_MODEL_TYPES,
    causal_lm_config_problems,
    causal_lm_problems,
    causal_lm_stages,
)
from lightning_memkit.pipeline.runtime import TUPLES_SINCE, LayerChain  # noqa: E402

WORKER = Path(__file__).with_name("_pipeline_hf_worker.py")
NEW = ("gemma2", "gemma3_text", "phi3", "qwen2_moe", "olmoe", "deepseek_v3")
WINDOWED = ("gemma2", "gemma3_text", "phi3")  # given sliding windows shorter than the test batches
SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, vocab_size=256, pad_token_id=0)


def make_model(family: str, **overrides) -> nn.Module:
    window = {"sliding_window": 5} if family in WINDOWED else {}
    return tiny_hf_causal_lm(family, seed=0, num_layers=4, **{**window, **overrides})


def make_batch(padded: bool, b: int = 4, t: int = 24) -> dict:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (b, t), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100
    batch = {"input_ids": ids, "labels": labels}
    if padded:
        mask = torch.ones_like(ids)
        mask[1, :5] = 0  # left padding
        mask[2, -4:] = 0  # right padding
        batch["attention_mask"] = mask
        batch["labels"] = labels.masked_fill(mask == 0, -100)
    return batch


def grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def hf_loss_and_grads(model: nn.Module, batch: dict) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(5)  # the same random draws as the stages' (router jitter noise, dropout: if a family has any)
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), grads(model)


def stage_loss_and_grads(model: nn.Module, batch: dict, **options) -> tuple[torch.Tensor, dict]:
    """Every stage layer chained in one process on the whole batch: the 2-rank test's single-process twin."""
    model.zero_grad(set_to_none=True)
    stages = causal_lm_stages(model, **options)
    inputs, labels = stages.inputs(batch)
    torch.manual_seed(5)
    loss = stages.loss.whole(LayerChain(*stages.layers)(*inputs), labels)
    loss.backward()
    return loss.detach(), grads(model)


def assert_same_loss_and_grads(model: nn.Module, batch: dict, **options) -> None:
    ref, ref_grads = hf_loss_and_grads(model, batch)
    loss, got = stage_loss_and_grads(model, batch, **options)
    torch.testing.assert_close(loss, ref, atol=2e-6, rtol=0)
    assert got.keys() == ref_grads.keys()
    for name in ref_grads:
        torch.testing.assert_close(got[name], ref_grads[name], atol=2e-6, rtol=1e-4, msg=name)


def test_the_tiny_families_are_the_tested_ones_with_their_features():
    assert set(NEW) < set(TESTED_MODEL_TYPES) and set(TESTED_MODEL_TYPES) == set(TINY_HF_FAMILIES)
    assert {tiny_hf_config(f).model_type for f in TINY_HF_FAMILIES} == set(TINY_HF_FAMILIES)
    deepseek, qwen2_moe = make_model("deepseek_v3"), make_model("qwen2_moe")
    assert [type(layer.mlp).__name__ for layer in deepseek.model.layers] == ["DeepseekV3MLP"] + ["DeepseekV3MoE"] * 3
    assert type(qwen2_moe.model.layers[0].mlp).__name__ == "Qwen2MoeMLP"  # dense, then MoE with a shared expert
    assert all(hasattr(layer.mlp, "shared_expert") for layer in qwen2_moe.model.layers[1:])
    gemma3 = make_model("gemma3_text")
    assert gemma3.config.layer_types == ["sliding_attention", "full_attention"] * 2
    assert gemma3.model.embed_tokens.embed_scale == 8.0  # sqrt(64), inside the embedding module


# -- every new family in one process: HF's loss and gradients ----------------------------------------------------
@pytest.mark.parametrize("family", NEW)
@pytest.mark.parametrize("fused", [False, True])
def test_stage_layers_give_hf_loss_and_gradients(family, fused):
    """With and without padding, fused or not: HF's loss (router aux, embedding scale, softcap) and gradients."""
    model = make_model(family)
    assert model.config.model_type == family
    for padded in (False, True):
        assert_same_loss_and_grads(model, make_batch(padded), fused_loss=fused)


def test_gemma3_carries_the_rotary_pair_of_each_layer_type():
    """Gemma3's local (sliding) and global (full) rotaries: both pairs cross the boundaries, each layer uses its own."""
    model = make_model("gemma3_text")
    stages = causal_lm_stages(model)
    (ids, mask), _ = stages.inputs(make_batch(padded=False))
    hidden, carried_mask, *pairs = stages.layers[0](ids, mask)
    assert len(pairs) == 4 and carried_mask is mask
    positions = torch.arange(ids.shape[1]).unsqueeze(0)
    for i, kind in enumerate(("full_attention", "sliding_attention")):  # sorted layer types
        cos, sin = model.model.rotary_emb(hidden, positions, kind)
        assert torch.equal(pairs[2 * i], cos) and torch.equal(pairs[2 * i + 1], sin)
    assert not torch.allclose(pairs[0], pairs[2])  # rope_theta 1e6 (global) against 1e4 (local)
    assert [(layer.kind, layer.pair) for layer in stages.layers[1:5]] == [("sliding_attention", 1),
                                                                           ("full_attention", 0)] * 2
    assert stages.layers[5](hidden, mask, *pairs).shape == hidden.shape  # the final norm drops all four


@pytest.mark.parametrize("fused", [False, True])
def test_final_logit_softcap_is_hf_in_the_head_and_in_the_fused_loss(fused):
    """A strong cap (0.5): HF's logits are capped; the head gives them, and the fused loss caps them itself."""
    model = make_model("gemma2", final_logit_softcapping=0.5)
    batch = make_batch(padded=True)
    stages = causal_lm_stages(model, fused_loss=fused)
    inputs, _ = stages.inputs(batch)
    out = LayerChain(*stages.layers)(*inputs)
    with torch.no_grad():
        logits = model(**batch).logits
    assert logits.abs().max() < 0.5
    if not fused:
        torch.testing.assert_close(out, logits, atol=1e-6, rtol=0)
    assert_same_loss_and_grads(model, batch, fused_loss=fused)


@pytest.mark.parametrize(("family", "aux", "carried"), [
    ("qwen2_moe", True, 2 * 4 + 1), ("olmoe", True, 2 * 4 + 1), ("qwen2_moe", False, 0),
    ("deepseek_v3", True, 0),  # output_router_logits=True, but DeepSeek-V3 has no aux loss in HF
])
def test_router_aux_loss_follows_the_family_and_its_config(family, aux, carried):
    model = make_model(family, output_router_logits=aux)
    stages = causal_lm_stages(model)
    assert stages.layers[0].statistics_size == carried
    batch = make_batch(padded=True)
    out = model(**batch)
    assert (out.aux_loss is not None and float(out.aux_loss.detach()) > 0) == bool(carried)
    assert_same_loss_and_grads(model, batch)


# -- refusals --------------------------------------------------------------------------------------------------
def test_models_of_another_layout_are_refused_naming_what_is_missing():
    t5 = transformers.T5ForConditionalGeneration(transformers.T5Config(d_model=32, d_ff=64, num_layers=1,
                                                                       num_heads=2, d_kv=16, vocab_size=64))
    with pytest.raises(ValueError, match=r"config.is_encoder_decoder=True \(T5ForConditionalGeneration is an "
                                         r"encoder-decoder model; the pipeline splits decoder-only causal LMs\)"):
        causal_lm_stages(t5)
    olmoe = make_model("olmoe", sliding_window=8)  # a config that carries a window its family never uses
    assert causal_lm_problems(olmoe) == [
        "config.sliding_window gives layers sliding_attention masks, but transformers.models.olmoe.modeling_olmoe "
        "never builds them (create_sliding_window_causal_mask)"]
    gemma3 = make_model("gemma3_text", use_bidirectional_attention=True)
    assert causal_lm_problems(gemma3) == ["config.use_bidirectional_attention=True (the stages build causal masks)"]


@pytest.mark.parametrize(("config", "name"), [
    (lambda: transformers.CohereConfig(**SMALL), "CohereForCausalLM"),  # logits * config.logit_scale in its head
    (lambda: transformers.GraniteConfig(**SMALL, embedding_multiplier=4.0), "GraniteForCausalLM"),  # in its forward
])
def test_a_family_whose_forward_does_more_is_refused_by_the_probe_and_left_unchanged(config, name):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config())
    assert causal_lm_problems(model) == []  # the layout alone is fine
    model.model.layers[1].eval()  # mixed modes: each is restored
    modes = [m.training for m in model.modules()]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=rf"cannot be split: the stages do not reproduce {name}.forward on a probe "
                                         r"batch \(logits and loss differ; largest logit difference"):
        causal_lm_stages(model)
    assert [m.training for m in model.modules()] == modes
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert len(causal_lm_stages(model, verify=False).layers) == 5  # the caller may skip the probe


def test_the_probe_skips_a_model_without_weights():
    with torch.device("meta"):
        model = tiny_hf_causal_lm("gemma2", num_layers=2)
    stages = causal_lm_stages(model)
    assert [type(layer).__name__ for layer in stages.layers] == ["Embedding", "DecoderLayer", "DecoderLayer",
                                                                 "FinalNorm", "Head"]


def test_a_config_is_checked_on_a_meta_model():
    assert causal_lm_config_problems(tiny_hf_config("gemma3_text")) == []
    assert causal_lm_config_problems(tiny_hf_config("deepseek_v3")) == []
    t5 = transformers.T5Config(d_model=32, d_ff=64, num_layers=1, num_heads=2, d_kv=16, vocab_size=64)
    assert causal_lm_config_problems(t5) == ["config.is_encoder_decoder=True (model_type 't5' is an encoder-decoder "
                                             "model; the pipeline splits decoder-only causal LMs)"]
    linear = tiny_hf_config("llama", layer_types=["full_attention", "linear_attention"])
    assert causal_lm_config_problems(linear) == [
        "config.layer_types has layers the stages cannot drive: 'linear_attention' (layer 1); allowed kinds: "
        "full_attention, sliding_attention, chunked_attention"]


# -- memkit estimate --pipeline --------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["gemma3_text", "deepseek_v3"])
def test_estimate_pipeline_is_the_strategy_planning_on_new_families(family, tmp_path, capsys):
    """``memkit estimate --pipeline 2`` (fake tensors) gives the split and peaks of the strategy's own planning."""
    from lightning_memkit.cli.main import main
    from lightning_memkit.pipeline import partition_layers
    from lightning_memkit.pipeline.runtime import measure_pipeline_costs

    config = tiny_hf_config(family, hidden_size=32, num_layers=2)
    path = tmp_path / "config.json"
    path.write_text(config.to_json_string())
    main(["estimate", "--hf-config", str(path), "--pipeline", "2", "--microbatches", "2", "--seq-len", "8",
          "--batch-size", "2", "--json"])
    est = json.loads(capsys.readouterr().out)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    stages = causal_lm_stages(model)
    ids = torch.randint(0, 256, (1, 8))
    inputs, target = stages.inputs({"input_ids": ids, "labels": ids})
    costs = measure_pipeline_costs(list(stages.layers), inputs, target, loss_fn=stages.loss,
                                   optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3))
    real = partition_layers(costs, 2, schedule="1f1b", microbatches=2)
    assert est["stage_sizes"] == list(real.sizes) and est["rank_peak_bytes"] == list(real.predicted_peak_bytes)


def test_estimate_pipeline_refuses_an_encoder_decoder_in_one_line(tmp_path, capsys):
    from lightning_memkit.cli.main import main

    path = tmp_path / "config.json"
    path.write_text(transformers.T5Config(d_model=32, d_ff=64, num_layers=1, num_heads=2, d_kv=16,
                                          vocab_size=64).to_json_string())
    with pytest.raises(SystemExit) as exited:
        main(["estimate", "--hf-config", str(path), "--pipeline", "2", "--microbatches", "2", "--batch-size", "2"])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and len(err.splitlines()) == 1
    assert "--pipeline: model_type 't5' of" in err
    assert "is not split by memkit_pipeline: config.is_encoder_decoder=True" in err


# -- two ranks -------------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(TorchVersion(torch.__version__) < TUPLES_SINCE, reason=f"needs torch >= {TUPLES_SINCE}")
def test_two_ranks_train_each_family_as_a_single_process_trainer(tmp_path):
    """Gemma2 (DualPipeV, tied ends on rank 0; and fused 1F1B, the tie across ranks), Gemma3, Phi3 (GPipe),
    Qwen2-MoE, OLMoE (uniform split) and DeepSeek-V3 (DualPipeV), padded batches, hidden 64, 4 layers: 3 AdamW
    steps and a validation batch of 7 rows on 2 gloo ranks, within 1e-4 of a plain single-process Trainer."""
    t0 = time.monotonic()
    procs = ranks.launch(WORKER, [str(tmp_path), "families"], 2)
    try:
        sys.path.insert(0, str(WORKER.parent))
        import _pipeline_hf_worker as worker

        torch.set_num_threads(1)
        reference = {name: worker.family_reference(name) for name in worker.FAMILY_SCENARIOS}
    finally:
        sys.path.remove(str(WORKER.parent))
        for code, out in ranks.wait(procs, 280 - (time.monotonic() - t0), "Hugging Face families pipeline"):
            assert code == 0, out[-4000:]
    r0, r1 = (json.loads((tmp_path / f"families{r}.json").read_text()) for r in range(2))
    assert r0 == r1  # both ranks log the same (broadcast) values
    assert {family for family, _ in worker.FAMILY_SCENARIOS.values()} == set(NEW)
    for name in worker.FAMILY_SCENARIOS:
        assert len(r0[name]["losses"]) == worker.FAMILY_STEPS, name
        assert r0[name]["losses"] == pytest.approx(reference[name]["losses"], abs=1e-4, rel=0), name
        assert r0[name]["val"] == pytest.approx(reference[name]["val"], abs=1e-4, rel=0), name


# -- every family transformers registers -----------------------------------------------------------------------
def _every_causal_lm():
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    for model_type, name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
        try:
            config = transformers.AutoConfig.for_model(model_type, **SMALL)
            if getattr(config, "hidden_size", None) != 64 or getattr(config, "vocab_size", None) != 256:
                continue  # a composite or differently named config: not built small here
            cls = getattr(transformers, name)
            with torch.device("meta"):
                size = sum(p.numel() for p in cls(config).parameters())
            if size > 20_000_000:
                continue  # sizes this config does not shrink (vision towers, hash embeddings)
            torch.manual_seed(0)
            yield model_type, cls(config)
        except Exception:  # noqa: BLE001 - a family that cannot be built from these sizes is not tried
            continue


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_every_registered_causal_lm_is_reproduced_or_refused():
    """Each causal LM family transformers registers, built small: its stages give HF's training loss and gradients
    on a padded batch, or ``causal_lm_stages`` refuses it with a ValueError naming why; never a third outcome."""
    reproduced, refused = [], []
    for model_type, model in _every_causal_lm():
        try:
            causal_lm_stages(model)
        except ValueError as err:
            assert "cannot be split: " in str(err), (model_type, err)
            refused.append(model_type)
            continue
        batch = make_batch(padded=True, b=3)
        try:
            assert_same_loss_and_grads(model, batch)
        except AssertionError as err:
            raise AssertionError(f"{model_type}: the stages are accepted but differ from HF: {err}") from None
        reproduced.append(model_type)
    print(f"reproduced ({len(reproduced)}): {', '.join(reproduced)}\nrefused ({len(refused)}): {', '.join(refused)}")
    # not built from these sizes: the MoE families with large default experts; DeepSeek-V3 (MLA needs 4 kv heads)
    built = {"llama", "mistral", "qwen2", "qwen3", "mixtral", "gpt_oss", "gemma2", "gemma3_text", "phi3", "olmoe"}
    assert built <= set(reproduced)
    assert len(reproduced) >= 40 and refused, (reproduced, refused)


def test_the_tested_families_are_exported_by_the_hf_package():
    import lightning_memkit.hf as hf

    assert hf.TESTED_MODEL_TYPES is TESTED_MODEL_TYPES and "TESTED_MODEL_TYPES" in hf.__all__
