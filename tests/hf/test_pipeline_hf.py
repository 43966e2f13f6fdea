"""strategy="memkit_pipeline" on Hugging Face causal LMs with no pipeline methods: HF's loss, masks and router aux.

Single-process tests check the stage layers against HF's own forward, loss and gradients (every supported
family, padding, fused loss, microbatched terms); the 2-rank test trains ``HFCausalLM`` under the strategy and
compares every step with a plain single-process Trainer run.
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import pytest
import ranks
import torch
from torch import nn
from torch.torch_version import TorchVersion

transformers = pytest.importorskip("transformers")

from lightning_memkit.demo import HFCausalLM  # noqa: E402
from lightning_memkit.demo.hf_models import tiny_hf_causal_lm  # noqa: E402
from lightning_memkit.hf.pipeline_stages import (  # noqa: E402
    causal_lm_stages,
    find_causal_lm,
    router_aux_loss,
    router_statistics,
)
from lightning_memkit.pipeline.runtime import TUPLES_SINCE, LayerChain  # noqa: E402
from lightning_memkit.strategies import MemkitPipelineStrategy, load_pipeline_state_dict  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
PYPATH = ranks.PYPATH
WORKER = Path(__file__).with_name("_pipeline_hf_worker.py")
COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, vocab_size=256)
#: the first families the stages were tested on (the others: tests/hf/test_pipeline_families.py)
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "gpt_oss")


def make_model(family: str) -> nn.Module:
    """A tiny model of each supported family; sliding windows shorter than the test sequences."""
    if family in ("llama", "qwen3_moe", "gpt_oss"):
        return tiny_hf_causal_lm(family, seed=0, num_layers=3)
    torch.manual_seed(0)
    config = {
        "mistral": lambda: transformers.MistralConfig(**COMMON, sliding_window=5),
        "qwen2": lambda: transformers.Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=5,
                                                  max_window_layers=1),
        "qwen3": lambda: transformers.Qwen3Config(**COMMON),
        "mixtral": lambda: transformers.MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2,
                                                      output_router_logits=True, sliding_window=6),
    }[family]()
    return transformers.AutoModelForCausalLM.from_config(config)


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
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), grads(model)


def stage_loss_and_grads(model, batch, microbatches: int = 1, **options) -> tuple[torch.Tensor, dict]:
    """The stage layers in one process, microbatch by microbatch, as the pipeline runtime drives the loss."""
    model.zero_grad(set_to_none=True)
    stages = causal_lm_stages(model, **options)
    (ids, mask), labels = stages.inputs(batch)
    chain = LayerChain(*stages.layers)
    parts = list(zip(ids.chunk(microbatches), mask.chunk(microbatches), labels.chunk(microbatches)))
    stages.loss.begin(labels, microbatches)
    if stages.loss.observes_forward:
        with torch.no_grad():
            for i, m, y in parts:
                stages.loss.observe(chain(i, m), y)
    terms = [stages.loss(chain(i, m), y) for i, m, y in parts]
    torch.stack(terms).mean().backward()
    return stages.loss.end(terms), grads(model)


def assert_grads_close(got: dict, expected: dict, atol: float = 2e-6) -> None:
    assert got.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], atol=atol, rtol=1e-4, msg=name)


# -- the stage layers in one process ------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("fused", [False, True])
def test_stage_layers_give_hf_loss_and_gradients(family, fused):
    """Every family of FAMILIES, with and without padding: HF's loss (router aux included) and gradients."""
    model = make_model(family)
    assert model.config.model_type == family
    for padded in (False, True):
        batch = make_batch(padded)
        ref, ref_grads = hf_loss_and_grads(model, batch)
        loss, got = stage_loss_and_grads(model, batch, fused_loss=fused)
        torch.testing.assert_close(loss, ref, atol=2e-6, rtol=0)
        assert_grads_close(got, ref_grads)


@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "gpt_oss"])
def test_microbatches_give_the_batch_loss_and_its_exact_gradient(family):
    """4 microbatches of a padded batch: the mean over the batch's valid tokens and HF's router aux gradient."""
    model = make_model(family)
    batch = make_batch(padded=True, b=8)
    ref, ref_grads = hf_loss_and_grads(model, batch)
    loss, got = stage_loss_and_grads(model, batch, microbatches=4)
    torch.testing.assert_close(loss, ref, atol=2e-6, rtol=0)
    assert_grads_close(got, ref_grads)


def test_router_aux_microbatch_mode_is_hf_gradient_accumulation_of_the_aux_loss():
    """``router_aux="microbatch"``: HF's batch loss value; gradient of CE(batch) + coef * mean_m aux(microbatch m)."""
    model = make_model("qwen3_moe")
    batch = make_batch(padded=True, b=8)
    coef = model.config.router_aux_loss_coef
    model.zero_grad(set_to_none=True)
    full = model(**batch)
    chunks = [{k: v[i:i + 2] for k, v in batch.items()} for i in range(0, 8, 2)]
    aux = torch.stack([model(**c).aux_loss for c in chunks]).mean()
    (full.loss - coef * full.aux_loss + coef * aux).backward()
    expected = grads(model)
    loss, got = stage_loss_and_grads(model, batch, microbatches=4, router_aux="microbatch")
    torch.testing.assert_close(loss, full.loss.detach(), atol=2e-6, rtol=0)
    assert_grads_close(got, expected)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_summed_router_statistics_are_hf_load_balancing_loss(family):
    """Statistics summed over layers and row chunks give HF's load_balancing_loss_func over all of them."""
    model = make_model(family)
    fn = sys.modules[type(model).__module__].load_balancing_loss_func
    g = torch.Generator().manual_seed(0)
    logits = tuple(torch.randn(12, 4, generator=g) for _ in range(3))
    mask = (torch.rand(3, 4, generator=g) > 0.3).long()
    flat = mask.reshape(-1)
    stats = sum(router_statistics(t[rows], flat[rows], 4, 2) for t in logits for rows in (slice(0, 5), slice(5, 12)))
    torch.testing.assert_close(router_aux_loss(stats, 4), fn(logits, 4, 2, mask), atol=1e-6, rtol=1e-6)
    ones = sum(router_statistics(t, torch.ones(12), 4, 2) for t in logits)
    torch.testing.assert_close(router_aux_loss(ones, 4), fn(logits, 4, 2, None), atol=1e-6, rtol=1e-6)


def test_masks_are_built_once_per_stage_call(monkeypatch):
    """The layers of one LayerChain call share one mask of each kind; layers called alone build their own."""
    import transformers.masking_utils as masking

    calls = {"full": 0, "sliding": 0}

    def counting(kind, fn):
        @functools.wraps(fn)
        def build(**kwargs):
            calls[kind] += 1
            return fn(**kwargs)
        return build

    model = make_model("gpt_oss")  # layer types: sliding, full, sliding
    stages = causal_lm_stages(model)  # (its probe builds masks too: counted from here on)
    monkeypatch.setattr(masking, "create_causal_mask", counting("full", masking.create_causal_mask))
    monkeypatch.setattr(masking, "create_sliding_window_causal_mask",
                        counting("sliding", masking.create_sliding_window_causal_mask))
    (ids, mask), _ = stages.inputs(make_batch(padded=True))
    LayerChain(*stages.layers)(ids, mask)
    assert calls == {"full": 1, "sliding": 1}
    x = stages.layers[0](ids, mask)
    for layer in stages.layers[1:4]:
        x = layer(*x)
    assert calls == {"full": 2, "sliding": 3}


# -- refusals ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("batch", "error", "match"),
    [
        ((torch.zeros(2, 4),), TypeError, "must be a dict with input_ids, labels and optionally attention_mask"),
        ({"input_ids": torch.zeros(2, 4, dtype=torch.long)}, ValueError, r"missing \['labels'\]"),
        ({"input_ids": torch.zeros(2, 4, dtype=torch.long), "labels": torch.zeros(2, 4, dtype=torch.long),
          "position_ids": torch.zeros(2, 4, dtype=torch.long)}, ValueError, r"unsupported \['position_ids'\]"),
        ({"input_ids": torch.zeros(2, 4), "labels": torch.zeros(2, 4, dtype=torch.long)}, TypeError,
         r"batch\['input_ids'\] must be a 2-D integer tensor"),
        ({"input_ids": torch.zeros(2, 4, dtype=torch.long), "labels": torch.zeros(2, 5, dtype=torch.long)},
         ValueError, r"batch\['labels'\] has shape \(2, 5\), input_ids \(2, 4\)"),
    ],
)
def test_bad_batches_are_refused(batch, error, match):
    stages = causal_lm_stages(make_model("llama"))
    with pytest.raises(error, match=match):
        stages.inputs(batch[0] if isinstance(batch, tuple) else batch)


def test_unsupported_models_are_refused_and_left_unchanged():
    with pytest.raises(TypeError, match=r"causal_lm_stages\(model=...\): must be a transformers PreTrainedModel"):
        causal_lm_stages(nn.Linear(2, 2))
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64))
    with pytest.raises(ValueError, match=r"no \.model\.embed_tokens \(Embedding\); no \.model\.layers"):
        causal_lm_stages(gpt2)
    model = make_model("llama")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.config.layer_types = ["full_attention", "linear_attention", "full_attention"]
    with pytest.raises(ValueError, match=r"config.layer_types has layers the stages cannot drive: 'linear_attention' "
                                         r"\(layer 1\); allowed kinds: full_attention, sliding_attention"):
        causal_lm_stages(model)
    with pytest.raises(ValueError, match=r"causal_lm_stages\(router_aux='all'\): must be one of 'exact'"):
        causal_lm_stages(model, router_aux="all")
    state = model.state_dict()
    assert state.keys() == before.keys() and all(torch.equal(state[k], before[k]) for k in before)


def test_router_hooks_are_removed_when_a_layer_fails():
    model = make_model("qwen3_moe")
    stages = causal_lm_stages(model)  # its probe runs HF's forward, which installs HF's own capturing hooks
    routers = [m for m in model.modules() if type(m).__name__ == "Qwen3MoeTopKRouter"]
    hooks = [dict(r._forward_hooks) for r in routers]
    (ids, mask), _ = stages.inputs(make_batch(padded=False))
    hidden, *rest = stages.layers[0](ids, mask)
    with pytest.raises(RuntimeError):
        stages.layers[1](hidden[..., :-1], *rest)  # wrong width: the decoder layer raises
    assert routers and [dict(r._forward_hooks) for r in routers] == hooks


class _Two(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.a, self.b = make_model("llama"), make_model("llama")


class _Protocol(HFCausalLM):
    def pipeline_layers(self):
        return nn.ModuleList([self.model])

    def pipeline_loss(self, output, target):
        return output.float().mean()


def test_strategy_finds_the_hf_model_or_says_what_is_missing():
    class Plain(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(2, 2)

    with pytest.raises(TypeError, match=r"needs the LightningModule Plain to implement pipeline_layers, pipeline_loss: "
                                        r".*or to hold a transformers decoder-only causal LM .*but it holds no "
                                        r"transformers PreTrainedModel"):
        MemkitPipelineStrategy().connect(Plain())
    with pytest.raises(TypeError, match=r"it holds 2 transformers models \('a', 'b'\)"):
        MemkitPipelineStrategy().connect(_Two())

    class GPT2Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.lm = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2,
                                                                           vocab_size=64))

    with pytest.raises(TypeError, match=r"but lm \(GPT2LMHeadModel\) cannot be split: no \.model\.embed_tokens"):
        MemkitPipelineStrategy().connect(GPT2Module())
    module = HFCausalLM(family="qwen3_moe")
    assert find_causal_lm(module) == ("model", module.model) and find_causal_lm(module.model) == ("", module.model)
    strategy = MemkitPipelineStrategy()
    strategy.connect(module)
    assert strategy._hf_name == "model"
    strategy = MemkitPipelineStrategy()
    strategy.connect(_Protocol())  # the explicit protocol wins over the HF model it holds
    assert strategy._hf_name is None
    with pytest.raises(ValueError, match=r"MemkitPipelineStrategy\(router_aux='approx'\): must be one of"):
        MemkitPipelineStrategy(router_aux="approx")


def test_example_config_builds_through_lightning_cli(tmp_path):
    from lightning_memkit.config.lightning_cli import MemkitCLI

    config = ROOT / "examples" / "configs" / "hf_llama_pipeline.yaml"
    cli = MemkitCLI(args=["--config", str(config), "--trainer.default_root_dir", str(tmp_path)], run=False)
    assert isinstance(cli.trainer.strategy, MemkitPipelineStrategy)
    assert isinstance(cli.model, HFCausalLM) and cli.model.model.config.model_type == "llama"
    assert cli.trainer.num_devices == 2 and cli.datamodule.hparams.batch_format == "hf"


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.skipif(TorchVersion(torch.__version__) < TUPLES_SINCE, reason=f"needs torch >= {TUPLES_SINCE}")
def test_example_config_trains_on_two_processes(tmp_path):
    """``memkit fit`` with the example config: 2 CPU processes, 40 steps, the training loss falls."""
    config = ROOT / "examples" / "configs" / "hf_llama_pipeline.yaml"
    cmd = ["-m", "lightning_memkit.cli", "fit", "--config", config, "--trainer.default_root_dir", tmp_path]
    done = ranks.run(cmd, timeout=110, cwd=tmp_path)  # rank 0 from the zygote; Lightning starts rank 1 afresh
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    line = re.search(r"train loss: first (\S+) -> last (\S+) over 40 optimizer steps", done.stdout)
    first, last = map(float, line.groups())
    assert last < first - 1.0


# -- two ranks -----------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.skipif(TorchVersion(torch.__version__) < TUPLES_SINCE, reason=f"needs torch >= {TUPLES_SINCE}")
def test_two_ranks_train_hf_models_as_a_single_process_trainer(tmp_path):
    """HFCausalLM (no pipeline methods) on 2 gloo ranks: the losses of a plain Trainer, HF-named checkpoints.

    llama (1F1B, memory-balanced split), qwen3_moe (GPipe, padded batches, router aux loss), gpt_oss (DualPipeV,
    padded, sliding and full attention, router aux loss), llama with tied embeddings (DualPipeV: embedding and
    head on rank 0; 1F1B: on two ranks), llama with ``fused_loss=True``: 4 AdamW steps each within 1e-4 of the
    plain Trainer, then a validation batch of 7 rows (microbatches of 2, 2, 2, 1).
    """
    t0 = time.monotonic()
    procs = ranks.launch(WORKER, [str(tmp_path)], 2)
    try:
        sys.path.insert(0, str(WORKER.parent))
        import _pipeline_hf_worker as worker

        torch.set_num_threads(1)
        reference = {name: worker.reference(name) for name in ("llama", "qwen3_moe", "gpt_oss", "llama_tied")}
    finally:
        sys.path.remove(str(WORKER.parent))
        for code, out in ranks.wait(procs, 150 - (time.monotonic() - t0), "Hugging Face pipeline"):
            assert code == 0, out[-4000:]
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert r0 == r1  # both ranks log the same (broadcast) values
    for name in ("llama", "qwen3_moe", "gpt_oss", "llama_tied"):
        assert len(r0[name]["losses"]) == worker.STEPS
        assert r0[name]["losses"] == pytest.approx(reference[name]["losses"], abs=1e-4, rel=0), name
        assert r0[name]["val"] == pytest.approx(reference[name]["val"], abs=1e-4, rel=0), name
    # 1F1B puts the tied embedding on rank 0 and the head on rank 1: their gradients are summed, one update
    assert r0["llama_tied_1f1b"]["losses"] == pytest.approx(reference["llama_tied"]["losses"], abs=1e-4, rel=0)
    assert r0["llama_tied_1f1b"]["val"] == pytest.approx(reference["llama_tied"]["val"], abs=1e-4, rel=0)
    fused = r0["checkpoint"]
    assert fused["losses"] == pytest.approx(reference["llama"]["losses"], abs=1e-4, rel=0)
    assert fused["val"] == pytest.approx(reference["llama"]["val"], abs=1e-4, rel=0)
    assert fused["resumed"] == fused["losses"][2:]  # resuming from the epoch-0 checkpoint continues exactly
    assert fused["shape_error"].startswith("this training batch has shapes [(8, 31), (8, 31), (8, 31)]")
    state = load_pipeline_state_dict(tmp_path / "ckpt" / "epoch=1-step=4.ckpt")
    fresh = tiny_hf_causal_lm("llama", hidden_size=32, num_layers=4)
    fresh.load_state_dict({k.removeprefix("model."): v for k, v in state.items()}, strict=True)
    with torch.no_grad():
        val = fresh(**next(iter(worker.val_data()))).loss
    assert float(val) == pytest.approx(fused["val"], abs=1e-5)  # the checkpoint holds the trained weights


@pytest.mark.parametrize(("family", "stats"), [("llama", 0), ("qwen3_moe", (2 * 4 + 1) * 4)])
def test_bytes_carried_between_stages(family, stats):
    """Per microbatch of 2 x 64 tokens a decoder layer passes on hidden (B*T*H fp32), the padding mask (B*T
    int64), cos and sin (2*T*head_dim fp32) and, with the router aux loss, 2*experts+1 fp32 statistics."""
    from lightning_memkit.pipeline import measure_layer_costs

    model = tiny_hf_causal_lm(family, seed=0)  # hidden 64, head_dim 16, 4 experts
    stages = causal_lm_stages(model)
    ids = torch.randint(0, 256, (2, 64))
    inputs, labels = stages.inputs({"input_ids": ids, "labels": ids})
    costs = measure_layer_costs(stages.layers, inputs, loss_fn=stages.loss.whole, target=labels)
    hidden = 2 * 64 * 64 * 4
    assert hidden + 2 * 64 * 8 + 2 * 64 * 16 * 4 == 41_984
    assert [c.output_bytes for c in costs[:3]] == [41_984 + stats] * 3  # embedding, decoder layers
    assert costs[3].output_bytes == hidden + stats  # after the final norm: hidden states (and statistics) only


@pytest.mark.cuda
@pytest.mark.timeout(300)
def test_one_gpu_pipeline_matches_a_plain_trainer(tmp_path):
    """One rank on one GPU (nccl), 4 microbatches of padded batches: llama, qwen3_moe, gpt_oss, fused or not."""
    env = dict(os.environ, PYTHONPATH=PYPATH)
    done = subprocess.run([sys.executable, str(WORKER), str(tmp_path), "cuda"], capture_output=True, text=True,
                          timeout=280, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "cuda.json").read_text())
    assert len(result) == 6
    for name, (pipelined, plain) in result.items():
        assert len(pipelined) == 4 and pipelined == pytest.approx(plain, abs=1e-4, rel=0), name
