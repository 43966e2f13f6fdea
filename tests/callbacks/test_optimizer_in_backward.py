"""OptimizerInBackward in real fits: the losses of the fit without it, bitwise (TinyLM, an LR scheduler, SGD, a tiny
Llama, peft-wrapped too); a lower step peak with no gradient left after the step (LivePeak); checkpoints resume with
or without it; each refusal's one line, before anything changes; the configured optimizer given back."""

from __future__ import annotations

import pytest
from optimizer_fits import STEPS, FitBytes, fit, resumed

from lightning_memkit.callbacks import OptimizerInBackward
from lightning_memkit.optim import InBackwardOptimizer

KINDS = ["tiny_lm", "llama", "peft", "ScheduledLM", "SGDLM"]


@pytest.fixture(scope="module")
def plain() -> dict:
    return {kind: fit(kind) for kind in KINDS}


@pytest.mark.parametrize("kind", KINDS)
def test_the_losses_of_the_fit_without_it(kind, plain):
    losses, trainer, module = fit(kind, OptimizerInBackward())
    assert losses == plain[kind][0] and len(losses) == STEPS
    configured = trainer.optimizers[0]  # given back at the end, with the state
    assert type(configured) is type(plain[kind][1].optimizers[0])
    assert configured.state.keys() == {p for p in module.parameters() if p.requires_grad}
    assert all(not p._post_accumulate_grad_hooks for p in module.parameters())


def test_the_peak_is_lower_and_no_gradient_outlives_backward():
    plain_bytes, bytes_ = FitBytes(), FitBytes()
    fit("wide_lm", plain_bytes)
    _, _, module = fit("wide_lm", bytes_, OptimizerInBackward())
    grads = sum(p.numel() * p.element_size() for p in module.parameters())
    largest = max(p.numel() * p.element_size() for p in module.parameters())
    assert plain_bytes.step_bytes[1] - bytes_.step_bytes[1] == grads  # the plain fit keeps them to the next step
    # the plain fit's peak is in a forward, with the last step's gradients alive; the lever's in a backward, with
    # one gradient and the temporaries of one parameter's AdamW update
    assert plain_bytes.fit_bytes[0] - bytes_.fit_bytes[0] >= grads - 2 * largest


def test_a_checkpoint_resumes_with_or_without_it(tmp_path, plain):
    straight = plain["tiny_lm"][0]
    assert resumed(tmp_path / "with", "tiny_lm", [OptimizerInBackward()], []) == straight
    assert resumed(tmp_path / "without", "tiny_lm", [], [OptimizerInBackward()]) == straight


@pytest.mark.parametrize(("kind", "trainer_args", "reason"), [
    ("tiny_lm", {"accumulate_grad_batches": 2}, "accumulate_grad_batches=2: each backward steps"),
    ("tiny_lm", {"gradient_clip_val": 1.0}, r"gradient clipping \(gradient_clip_val=1.0\) needs the gradients"),
    ("ClippingLM", {}, "ClippingLM overrides configure_gradient_clipping"),
    ("ManualLM", {}, "it needs automatic optimization; ManualLM sets automatic_optimization=False"),
    ("TwoOptimizersLM", {}, "it replaces one optimizer; configure_optimizers returned 2"),
    ("LBFGSLM", {}, "InBackwardOptimizer: LBFGS is not supported .*allowed: torch.optim SGD"),
])
def test_refusals_name_the_reason_before_anything_changes(kind, trainer_args, reason):
    lever = OptimizerInBackward()
    with pytest.raises(ValueError, match=f"^OptimizerInBackward: {reason}") as raised:
        fit(kind, lever, **trainer_args)
    assert "\n" not in str(raised.value)
    assert lever.optimizer is None


def test_the_trainer_steps_the_replacement_during_the_fit():
    class Check(FitBytes):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            assert isinstance(trainer.optimizers[0], InBackwardOptimizer)
            assert all(p.grad is None for p in pl_module.parameters())

    fit("tiny_lm", OptimizerInBackward(), Check(), steps=1)
