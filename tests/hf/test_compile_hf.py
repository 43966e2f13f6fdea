"""A ``torch.compile``d tiny HF Llama trains with memkit's features as it does eagerly (same losses)."""

import lightning as L
import pytest
import torch
from torch import nn
from torch._dynamo.backends.registry import lookup_backend

transformers = pytest.importorskip("transformers")

from lightning_memkit.callbacks import (  # noqa: E402
    ActivationCheckpointing,
    FusedLinearCrossEntropy,
    PeakMemoryMonitor,
)
from lightning_memkit.demo import HFCausalLM  # noqa: E402

CHECKPOINT_HOP = torch.ops.higher_order.tag_activation_checkpoint


class Recording:
    """A dynamo backend (``inner`` compiles): keeps the graphs it was given, counts the compiled calls run."""

    def __init__(self, inner):
        self.inner, self.graphs, self.calls = inner, [], 0

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        compiled = lookup_backend(self.inner)(gm, example_inputs)

        def run(*args):
            self.calls += 1
            return compiled(*args)

        return run

    def count(self, target) -> int:
        return sum(node.target is target for gm in self.graphs for node in gm.graph.nodes)


class Losses(L.Callback):
    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _features(names):
    callbacks, plugins = [], []
    for name in names:
        if name == "recompute":
            callbacks.append(ActivationCheckpointing())
        elif name == "selective":
            callbacks.append(ActivationCheckpointing(selective=True))
        elif name == "fused_loss":
            callbacks.append(FusedLinearCrossEntropy())
        elif name == "monitor":
            callbacks.append(PeakMemoryMonitor(cpu_sample_every_n_steps=1, verbose=False))
        elif name == "qlora":
            from lightning_memkit.plugins import NoSaveBitsandbytesPrecision

            plugins.append(NoSaveBitsandbytesPrecision("nf4", "float32", lora_rank=8))
    return callbacks, plugins


def train(names, backend=None, steps=2):
    """Fit the tiny Llama (hidden 64, 2 layers) with the features; its HF model compiled in place with ``backend``."""
    module = HFCausalLM(family="llama", hidden_size=64, num_layers=2, seed=0)
    recording = None
    if backend is not None:
        recording = Recording(backend)
        module.model.compile(backend=recording)  # in place: the features find the HF model and its layers as usual
    ids = torch.randint(0, 256, (steps * 2, 32), generator=torch.Generator().manual_seed(1))
    data = torch.utils.data.DataLoader([{"input_ids": x, "labels": x} for x in ids], batch_size=2)
    callbacks, plugins = _features(names)
    losses = Losses()
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[*callbacks, losses],
                        plugins=plugins)
    trainer.fit(module, data)
    return losses.losses, recording, callbacks


def _check(names, backend):
    eager, _, _ = train(names)
    compiled, recording, callbacks = train(names, backend)
    assert len(compiled) == len(eager) == 2
    assert max(abs(a - b) for a, b in zip(compiled, eager)) <= 1e-4
    assert recording.graphs and recording.calls >= 2  # compiled, and the compiled graph ran in every step
    for cb in callbacks:
        if isinstance(cb, ActivationCheckpointing):
            assert len(cb.checkpointed) == 2 and recording.count(CHECKPOINT_HOP) == 2  # recompute traced in
        if isinstance(cb, FusedLinearCrossEntropy):
            assert cb.fused_calls == 2  # the fused loss ran (eagerly, between two graphs)
        if isinstance(cb, PeakMemoryMonitor):
            assert cb.summary["method"] == "AllocatorPeak" and cb.summary["measured_steps"] == 2


@pytest.mark.slow
def test_compiled_llama_with_selective_recompute_and_monitor_trains_like_eager():
    _check(["selective", "monitor"], "aot_eager")


@pytest.mark.slow
@pytest.mark.parametrize("names", [["recompute"], ["selective"], ["fused_loss"], ["monitor"], ["qlora"]],
                         ids=lambda names: "+".join(names))
def test_inductor_compiled_llama_trains_like_eager(names):
    _check(names, "inductor")


# -- the QLoRA layers compiled, without the HF model (the default suite's cheap twin of the slow test) ----------


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(64, 128), nn.Linear(128, 64)

    def forward(self, x):
        return self.down(nn.functional.silu(self.up(x)))


def compiled_qlora_run() -> tuple[int, int, list[float], list[float]]:
    """Two SGD steps of the QLoRA-converted ``Mlp``, eager then compiled (aot_eager): the compiled graphs and calls,
    and each run's losses."""
    from lightning_memkit.plugins import NoSaveBitsandbytesPrecision

    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(0))
    losses = {}
    for backend in (None, "aot_eager"):
        torch.manual_seed(0)
        model = NoSaveBitsandbytesPrecision("nf4", "float32", lora_rank=4).convert_module(Mlp())
        recording = None
        if backend is not None:
            recording = Recording(backend)
            model.compile(backend=recording)
        optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
        losses[backend] = []
        for _ in range(2):
            loss = model(x).square().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses[backend].append(float(loss))
    return len(recording.graphs), recording.calls, losses[None], losses["aot_eager"]


def test_compiled_qlora_layers_train_like_eager():
    """In a process of its own: how dynamo splits the layers into graphs depends on what the process compiled and
    registered before (a shared test worker once split them into 25 graphs)."""
    pytest.importorskip("bitsandbytes")
    import ast
    from pathlib import Path

    import ranks  # a process of its own that has imported torch, Lightning and transformers, nothing compiled

    here = str(Path(__file__).resolve().parent)
    code = f"import sys; sys.path.insert(0, {here!r}); import test_compile_hf as t; print(repr(t.compiled_qlora_run()))"
    proc = ranks.run(["-c", code], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    graphs, calls, eager, compiled = ast.literal_eval(proc.stdout.strip().splitlines()[-1])
    assert graphs and calls == 2  # one graph, run once per step: no graph break in the quantized layers
    assert max(abs(a - b) for a, b in zip(eager, compiled)) <= 1e-5
    assert compiled[1] != compiled[0]  # the adapters trained


def test_the_fused_loss_finds_the_causal_lm_inside_a_compiled_wrapper():
    import lightning.pytorch as pl

    from lightning_memkit.demo.hf_models import tiny_hf_causal_lm
    from lightning_memkit.hf.fused_loss import find_causal_lms

    class Holder(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.inner = tiny_hf_causal_lm("llama")
            self.model = torch.compile(self.inner, backend="eager")  # nothing is compiled before a call

    holder = Holder()
    assert find_causal_lms(holder) == [holder.inner]
