"""Optimizer8bit in real fits: it trains along the float32 fit (TinyLM, every parameter 8-bit; a tiny Llama); the
state takes the bytes eight_bit_state_bytes says; its checkpoint resumes with it and a float32 one is refused; the
LR scheduler still reaches it; refusals; bad arguments; YAML."""

from __future__ import annotations

import pytest
from optimizer_fits import STEPS, FitBytes, fit, resumed

from lightning_memkit.callbacks import Optimizer8bit
from lightning_memkit.measure.storage import unique_storage_bytes
from lightning_memkit.optim import EightBitAdamW, eight_bit_state_bytes


@pytest.fixture(scope="module")
def plain() -> dict:
    return {kind: fit(kind, FitBytes())[0] for kind in ("tiny_lm", "llama", "ScheduledLM")}


@pytest.mark.parametrize("kind", ["tiny_lm", "llama", "ScheduledLM"])
def test_it_trains_along_the_float32_fit(kind, plain):
    bytes_ = FitBytes()
    losses, trainer, module = fit(kind, bytes_, Optimizer8bit(min_8bit_size=0))
    reference = plain[kind]
    assert len(losses) == STEPS and losses != reference
    # 8-bit moments change each update by about a percent (see tests/optim/test_eight_bit.py): the losses stay
    # within 2% of what the float32 fit's steps take off the loss
    assert max(abs(a - b) for a, b in zip(losses, reference)) < 0.02 * (reference[0] - min(reference))
    opt = trainer.optimizers[0]
    assert isinstance(opt, EightBitAdamW)  # it stays the Trainer's: its state is the run's
    trainable = [p for p in module.parameters() if p.requires_grad]
    assert unique_storage_bytes(opt.state) == eight_bit_state_bytes(trainable, min_8bit_size=0)
    if kind == "ScheduledLM":
        assert [g["lr"] for g in opt.eight_bit.param_groups] == [g["lr"] * 2 for g in opt.param_groups]


def test_its_checkpoint_resumes_with_it_and_a_float32_one_is_refused(tmp_path):
    straight, _, _ = fit("tiny_lm", Optimizer8bit())
    assert resumed(tmp_path / "8bit", "tiny_lm", [Optimizer8bit()], [Optimizer8bit()]) == straight
    with pytest.raises(ValueError, match="float32 Adam/AdamW's"):
        resumed(tmp_path / "float32", "tiny_lm", [], [Optimizer8bit()])


@pytest.mark.parametrize(("kind", "reason"), [
    ("SGDLM", "EightBitAdamW: only torch.optim.Adam and AdamW have an 8-bit replacement, got SGD"),
    ("TwoOptimizersLM", "it replaces one optimizer; configure_optimizers returned 2"),
])
def test_refusals(kind, reason):
    lever = Optimizer8bit()
    with pytest.raises(ValueError, match=f"^Optimizer8bit: {reason}$"):
        fit(kind, lever)
    assert lever.optimizer is None


def test_bad_arguments_and_yaml():
    from lightning.pytorch.cli import LightningCLI
    from lightning.pytorch.demos.boring_classes import BoringModel

    with pytest.raises(ValueError, match=r"Optimizer8bit\(min_8bit_size=-1\): must be an int >= 0"):
        Optimizer8bit(min_8bit_size=-1)
    cli = LightningCLI(BoringModel, run=False, args={"trainer": {"logger": False, "callbacks": [{
        "class_path": "lightning_memkit.callbacks.Optimizer8bit", "init_args": {"min_8bit_size": 0}}]}})
    assert next(c for c in cli.trainer.callbacks if isinstance(c, Optimizer8bit)).min_8bit_size == 0
