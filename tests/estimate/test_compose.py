"""The step composed from traces at a few depths equals the trace of the whole model; it falls back where it cannot."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import ranks
import torch

from lightning_memkit.demo.hf_models import tiny_hf_config
from lightning_memkit.estimate.compose import FIRST_DEPTHS, NotComposable, layer_signatures, truncated_config
from lightning_memkit.estimate.fast_ops import FastOps
from lightning_memkit.estimate.hf import (
    _hf_factories,
    checkpoint_mode,
    estimate_from_hf_config,
    fused_linear_cross_entropy_inside,
    plugin_dtype,
    qlora_plugin,
)
from lightning_memkit.estimate.step import estimate_training_memory
from lightning_memkit.estimate.trace import CategoryTracker, FlopCount, fake_tensors
from lightning_memkit.hf.layers import kv_cache_off
from lightning_memkit.optim import host_offload, in_backward

LAYERS = 8  # the smallest depth composed from FIRST_DEPTHS with a layer of each position left over
TOKENS = dict(seq_len=16, batch_size=1)
FEATURES = {
    "plain": {},
    "checkpointing": dict(activation_checkpointing=True),
    "selective": dict(activation_checkpointing="selective"),
    "fused": dict(fused_loss=True),
    "qlora": dict(plugin="nf4-lora"),
    "qlora+checkpointing+fused": dict(plugin="nf4-lora", activation_checkpointing=True, fused_loss=True),
    "accumulate": dict(accumulate=True),
    "fp32+sgd": dict(precision="32-true", optimizer="sgd"),
    "cpu+checkpointing+fused": dict(device="cpu", activation_checkpointing=True, fused_loss=True),
    "bf16-mixed": dict(precision="bf16-mixed"),
}


def full_trace(path: Path, *, precision: str = "bf16-true", optimizer: str = "adamw",
               activation_checkpointing: bool | str = False, fused_loss: bool = False, plugin: str | None = None,
               accumulate: bool = False, device: str = "cuda", optimizer_wraps: tuple = (), **tokens: int):
    """The whole model traced by ``estimate_training_memory`` with a real first step: the reference."""
    if optimizer_wraps:  # a lever's wrapper around the named optimizer's factory
        from lightning_memkit.estimate.step import resolve_optimizer

        optimizer, _ = resolve_optimizer(optimizer, None)
        for wrap in optimizer_wraps:
            optimizer = wrap(optimizer)
    mode = checkpoint_mode(activation_checkpointing)
    qlora = qlora_plugin(plugin, precision)
    model, batch, _ = _hf_factories(path, tokens["seq_len"], tokens["batch_size"],
                                    dtype=plugin_dtype(precision) if qlora else None)  # as memkit estimate builds it
    return estimate_training_memory(model, batch, optimizer=optimizer, precision="32-true" if qlora else precision,
                                    checkpoint="auto" if mode else None, checkpoint_mode=mode or "full",
                                    patches=[*([kv_cache_off] if mode else []),
                                             *([fused_linear_cross_entropy_inside] if fused_loss else [])],
                                    plugin=qlora,
                                    zero_grad="accumulate" if accumulate else "after_forward", target=device,
                                    fake_batch=True)


def config_file(tmp_path: Path, family: str, layers: int = LAYERS, **overrides) -> Path:
    path = tmp_path / f"{family}.json"
    path.write_text(tiny_hf_config(family, hidden_size=32, num_layers=layers, **overrides).to_json_string())
    return path


def assert_same(composed, full) -> None:
    """Every phase's peak, split and running module, and the step's counts, to the byte (the goal is 0.5%)."""
    assert composed.assumptions[-1].startswith("composed from traces at depths"), composed.assumptions[-1]
    for c, f in zip(composed.phases, full.phases, strict=True):
        assert abs(c.peak_bytes / f.peak_bytes - 1) <= 0.005, (c, f)
        assert c == f
    assert (composed.peak_bytes, composed.parameters, composed.trainable_parameters, composed.step_flops,
            composed.step_bytes, composed.features) == (full.peak_bytes, full.parameters, full.trainable_parameters,
                                                         full.step_flops, full.step_bytes, full.features)


DEFAULT_FEATURES = ("plain", "qlora+checkpointing+fused")  # on Llama


@pytest.mark.parametrize("features", [f if f == "plain" else pytest.param(f, marks=pytest.mark.slow)
                                      for f in DEFAULT_FEATURES])  # QLoRA: in the optimizer levers' test below
def test_composed_equals_the_full_trace(features: str, tmp_path: Path) -> None:
    path = config_file(tmp_path, "llama")
    kw = {**TOKENS, "precision": "bf16-true", **FEATURES[features]}
    assert_same(estimate_from_hf_config(path, compose=True, **kw), full_trace(path, **kw))


WRAPS = {"in backward": lambda: (in_backward,), "host offload": lambda: (host_offload,),
         "host offload in backward": lambda: (lambda f: host_offload(f, offload_gradients=True),)}


@pytest.mark.parametrize("wrap", [w if w == "host offload in backward" else pytest.param(w, marks=pytest.mark.slow)
                                  for w in sorted(WRAPS)])  # both hooks in backward in the fast suite
def test_the_optimizer_levers_compose(wrap: str, tmp_path: Path) -> None:
    """A step in backward runs the optimizer on each layer's tensors inside the backward: its allocations are the
    layer's, and the step composes (it did not: it was traced in full, ten times slower at 32 layers)."""
    path = config_file(tmp_path, "llama")
    kw = {**TOKENS, **FEATURES["qlora+checkpointing+fused"], "precision": "bf16-true",
          "optimizer_wraps": WRAPS[wrap]()}
    assert_same(estimate_from_hf_config(path, compose=True, **kw), full_trace(path, **kw))


#: every feature alone, and none, on a dense and an MoE family (the features' composition does not depend on the
#: family beyond its layer kinds); Llama's DEFAULT_FEATURES run in the default suite, not twice. Every family with
#: every layer-level feature at once: test_compose_families.py (a module of its own, so that a second test process
#: can take it)
SLOW_CASES = sorted({(f, c) for f in ("llama", "qwen3_moe") for c in FEATURES}
                    - {("llama", c) for c in DEFAULT_FEATURES})


@pytest.mark.slow
@pytest.mark.parametrize("family, features", SLOW_CASES)
def test_composed_equals_the_full_trace_for_every_feature(family: str, features: str, tmp_path: Path) -> None:
    path = config_file(tmp_path, family)
    kw = {**TOKENS, "precision": "bf16-true", **FEATURES[features]}
    assert_same(estimate_from_hf_config(path, compose=True, **kw), full_trace(path, **kw))


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [dict(mlp_only_layers=[0]), dict(decoder_sparse_step=2)],
                         ids=["dense-first-layer", "every-other-layer-moe"])
def test_layer_patterns_compose(overrides: dict, tmp_path: Path) -> None:
    """A dense first layer (as DeepSeek-V3's ``first_k_dense_replace``) and alternating dense and MoE layers (Qwen-MoE's
    ``decoder_sparse_step``) are kinds of their own, read from the config cut to the samples' depths."""
    path = config_file(tmp_path, "qwen3_moe", layers=12, **overrides)
    assert_same(estimate_from_hf_config(path, compose=True, **TOKENS), full_trace(path, precision="32-true", **TOKENS))


@pytest.mark.slow
def test_a_kind_no_sample_holds_falls_back_to_the_full_trace(tmp_path: Path) -> None:
    """The last layer dense (``mlp_only_layers=[6]`` of 7, the fewest that compose): no model cut to a few layers has
    such a layer last, nor an MoE layer last of its kind and followed by another, so the estimate traces the whole
    model and says so."""
    layers = max(FIRST_DEPTHS) + 2
    path = config_file(tmp_path, "qwen3_moe", layers=layers, mlp_only_layers=[layers - 1])
    est = estimate_from_hf_config(path, compose=True, **TOKENS)
    assert est.assumptions[-1].startswith(f"traced all {layers} layers: the step did not compose"), est.assumptions
    assert "no sample has a layer of the kind of layer" in est.assumptions[-1]
    assert est.phases == full_trace(path, precision="32-true", **TOKENS).phases


def test_too_few_layers_are_traced_in_full(tmp_path: Path) -> None:
    path = config_file(tmp_path, "llama", layers=max(FIRST_DEPTHS) + 1)
    est = estimate_from_hf_config(path, compose=True, **TOKENS)
    assert "too few to compose" in est.assumptions[-1]
    auto = estimate_from_hf_config(path, **TOKENS)  # "auto": not even tried on a small model
    assert not any("compose" in a for a in auto.assumptions) and auto.phases == est.phases


@pytest.mark.slow
def test_a_peak_that_moves_with_depth_is_found_where_it_is(tmp_path: Path) -> None:
    """Backward starts with every layer's saved activations alive and ends with every layer's gradients: with small
    activations and large weights the peak is at the start for the samples' few layers and at the end for many.
    A straight line through the samples' backward peaks misses it; the composition evaluates every allocation at the
    real depth and finds it."""
    path = tmp_path / "config.json"
    config = tiny_hf_config("llama", hidden_size=64, intermediate_size=1536, num_layers=12, vocab_size=8000)
    path.write_text(config.to_json_string())
    run = dict(seq_len=32, batch_size=1, precision="bf16-true")
    composed = estimate_from_hf_config(path, compose=True, **run)
    full = full_trace(path, **run)
    assert composed.phases == full.phases
    peaks = {}
    for d in FIRST_DEPTHS:  # the samples' own backward peaks, and a line through them
        cut = tmp_path / f"cut{d}.json"
        cut.write_text(json.dumps({**json.loads(config.to_json_string()), "num_hidden_layers": d}))
        peaks[d] = full_trace(cut, **run).phases[2]
        assert peaks[d].peak_layer.endswith("(LogSoftmaxBackward0)")  # a few layers: the start of backward
    d0, d1 = FIRST_DEPTHS[0], FIRST_DEPTHS[-1]
    line = peaks[d1].peak_bytes + (peaks[d1].peak_bytes - peaks[d0].peak_bytes) / (d1 - d0) * (12 - d1)
    assert line < 0.98 * full.phases[2].peak_bytes  # the straight line under-estimates by more than 2%
    assert composed.phases[2].peak_layer.startswith("model.embed_tokens")  # 12 layers: the end of backward


def test_truncated_config_keeps_the_first_layers_kinds() -> None:
    config = tiny_hf_config("gpt_oss", num_layers=10)
    cut = truncated_config(config, 4)
    assert cut.num_hidden_layers == 4 and cut.layer_types == config.layer_types[:4]
    assert config.num_hidden_layers == 10  # the original is untouched
    real = layer_signatures(config)
    assert layer_signatures(cut) == real[:4] and real[0] != real[1] and real[0] == real[2]  # sliding / full


def _slab_loop() -> None:
    """A weight copied slab by slab into a buffer and multiplied into column slices of an output (the CPU fused loss's
    pattern): views, in-place copies and arithmetic, ``mm(out=)``; nothing allocated but the four tensors."""
    w, x, z, wf = torch.empty(64, 32), torch.empty(8, 32), torch.empty(8, 64), torch.empty(16, 32)
    for s in range(0, 64, 16):
        part = wf[:16]
        part.copy_(w[s:s + 16])
        torch.mm(x, part.t(), out=z[:, s:s + 16])  # a column slice of z: the CPU kernel writes it in place
        z[:, s:s + 16].add_(1).mul_(0.5)


def test_fast_ops_answer_as_the_real_kernels_do() -> None:
    """Views, in-place arithmetic and ``mm(out=)`` answered without the fake-tensor machinery: the bytes LivePeak
    counts on real tensors and on fake ones the long way, and the FLOPs ``FlopCount`` counts."""
    from lightning_memkit.memory import LivePeak

    with LivePeak() as real:
        _slab_loop()
    with fake_tensors(), CategoryTracker() as plain, FlopCount() as flops:
        _slab_loop()
    with fake_tensors(), CategoryTracker() as short, FastOps() as fast:
        fast.counting = True
        _slab_loop()
    assert short.peak_bytes == plain.peak_bytes == real.peak_bytes == 4 * (64 * 32 + 8 * 32 + 8 * 64 + 16 * 32)
    assert fast.flops == flops.total == 4 * 2 * 8 * 32 * 16
    assert fast._trusted and all(fast._trusted.values())  # each shortened op checked once against fake mode


def test_not_composable_is_an_exception() -> None:
    assert issubclass(NotComposable, Exception)


@pytest.mark.parametrize("caller_froze", [False, True], ids=["no-freeze", "caller-froze"])
def test_forked_traces_leave_the_callers_freeze_as_it_was(caller_froze: bool) -> None:
    """The samples' processes are forked with the heap frozen; afterwards the collector's state is the caller's
    again: nothing frozen stays frozen, and a caller's own ``gc.freeze`` is not undone (nor added to). In a fork of
    this test process, whose own freeze (conftest.py) no test may change."""
    import gc
    from types import SimpleNamespace

    from lightning_memkit.estimate import compose

    def check() -> None:
        compose.workers = lambda: 2
        calls = []

        def spy(name: str):
            real = getattr(gc, name)
            return lambda: (calls.append(name), real())[1]

        gc.unfreeze()
        if caller_froze:
            gc.freeze()
        gc.freeze, gc.unfreeze = spy("freeze"), spy("unfreeze")
        out = compose.traced(lambda depth: SimpleNamespace(log=None, depth=depth, pid=os.getpid()), {1: 1, 3: 3})
        assert {d: s.depth for d, s in out.items()} == {1: 1, 3: 3}
        assert all(s.pid != os.getpid() for s in out.values())  # traced in processes of their own
        with pytest.raises(ZeroDivisionError):  # a process's error is raised here, the state restored as well
            compose.traced(lambda depth: SimpleNamespace(log=None, x=1 / (depth - 1)), {1: 1, 3: 3})
        assert calls == ([] if caller_froze else ["freeze", "unfreeze"] * 2)
        assert (gc.get_freeze_count() > 0) == caller_froze

    ranks.in_fork(check)
