"""OffloadOptimizer in real fits: the losses of the fit without it, bitwise (TinyLM with and without gradients
offloaded in backward, with accumulation and clipping, a tiny Llama, peft-wrapped too); the device holds no optimizer
state and the host exactly the copies, buffers and moments (LivePeak); checkpoints resume with or without it; each
refusal's one line; bad arguments; YAML."""

from __future__ import annotations

import pytest
from optimizer_fits import STEPS, FitBytes, fit, resumed

from lightning_memkit.callbacks import OffloadOptimizer
from lightning_memkit.optim import HostOffloadOptimizer

CASES = [("tiny_lm", {}), ("llama", {}), ("peft", {}), ("tiny_lm", {"accumulate_grad_batches": 2}),
         ("tiny_lm", {"gradient_clip_val": 0.05}), ("SGDLM", {})]


@pytest.fixture(scope="module")
def plain() -> dict:
    return {(kind, tuple(args)): fit(kind, FitBytes(), **args) for kind, args in CASES}


@pytest.mark.parametrize(("kind", "args"), CASES, ids=lambda c: str(c))
def test_the_losses_of_the_fit_without_it(kind, args, plain):
    losses, trainer, module = fit(kind, OffloadOptimizer(), **args)
    assert losses == plain[(kind, tuple(args))][0] and len(losses) == STEPS
    configured = trainer.optimizers[0]  # given back at the end, with the state (on the host)
    assert type(configured) is type(plain[(kind, tuple(args))][1].optimizers[0])
    assert configured.state.keys() == {p for p in module.parameters() if p.requires_grad}


def test_gradients_offloaded_in_backward_give_the_same_losses(plain):
    losses, _, module = fit("tiny_lm", OffloadOptimizer(offload_gradients=True))
    assert losses == plain[("tiny_lm", ())][0]
    assert all(not p._post_accumulate_grad_hooks for p in module.parameters())  # the hooks are removed


@pytest.mark.parametrize("offload_gradients", [False, True])
def test_no_state_on_the_device_and_the_host_bytes_exact(offload_gradients, plain):
    bytes_ = FitBytes()
    _, _, module = fit("tiny_lm", bytes_, OffloadOptimizer(offload_gradients))
    params = sum(p.numel() * p.element_size() for p in module.parameters())
    plain_peak, plain_live, plain_host = plain[("tiny_lm", ())][1].callbacks[0].fit_bytes
    peak, live, host = bytes_.fit_bytes
    assert plain_host == 0 and plain_live >= 3 * params  # moments and gradients on the device
    assert live < 64  # a logged scalar or two: no state, no gradient
    # each parameter's copy, gradient buffer, exp_avg and exp_avg_sq (LivePeak does not see AdamW's float32 steps,
    # made from a Python number by torch.tensor)
    assert host == 4 * params
    assert plain_peak - peak >= 2 * params  # at least the moments


def test_a_checkpoint_resumes_with_or_without_it(tmp_path, plain):
    straight = plain[("tiny_lm", ())][0]
    assert resumed(tmp_path / "with", "tiny_lm", [OffloadOptimizer()], []) == straight
    assert resumed(tmp_path / "without", "tiny_lm", [], [OffloadOptimizer()]) == straight


@pytest.mark.parametrize(("kind", "trainer_args", "reason"), [
    ("tiny_lm", {"accumulate_grad_batches": 2}, "accumulate_grad_batches=2: gradients cannot accumulate on the host"),
    ("tiny_lm", {"gradient_clip_val": 1.0}, r"gradient clipping \(gradient_clip_val=1.0\) needs the gradients, "
                                            "which offload_gradients=True moves"),
    ("ClippingLM", {}, "ClippingLM overrides configure_gradient_clipping"),
])
def test_refusals_with_gradients_offloaded(kind, trainer_args, reason):
    lever = OffloadOptimizer(offload_gradients=True)
    with pytest.raises(ValueError, match=f"^OffloadOptimizer: {reason}"):
        fit(kind, lever, **trainer_args)
    assert lever.optimizer is None


@pytest.mark.parametrize(("kind", "reason"), [
    ("TwoOptimizersLM", "it replaces one optimizer; configure_optimizers returned 2"),
    ("LBFGSLM", "HostOffloadOptimizer: LBFGS is not supported"),
])
def test_refusals(kind, reason):
    with pytest.raises(ValueError, match=f"^OffloadOptimizer: {reason}") as raised:
        fit(kind, OffloadOptimizer())
    assert "\n" not in str(raised.value)


def test_manual_optimization_steps_it():
    losses, _, _ = fit("ManualLM", OffloadOptimizer(), steps=3)
    assert losses == fit("ManualLM", steps=3)[0]


def test_bad_arguments_and_yaml():
    from lightning.pytorch.cli import LightningCLI
    from lightning.pytorch.demos.boring_classes import BoringModel

    with pytest.raises(TypeError, match=r"OffloadOptimizer\(offload_gradients='yes'\)"):
        OffloadOptimizer(offload_gradients="yes")
    cli = LightningCLI(BoringModel, run=False, args={"trainer": {"logger": False, "callbacks": [{
        "class_path": "lightning_memkit.callbacks.OffloadOptimizer", "init_args": {"offload_gradients": True}}]}})
    lever = next(c for c in cli.trainer.callbacks if isinstance(c, OffloadOptimizer))
    assert lever.offload_gradients is True
    assert isinstance(lever.wrap(cli.model.configure_optimizers()[0][0]), HostOffloadOptimizer)
