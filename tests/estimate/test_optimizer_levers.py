"""The optimizer-state levers' planning side: which runs may pull them, which plans they refuse, their fake step."""

from __future__ import annotations

import torch

from lightning_memkit.estimate.levers import StepSpec
from lightning_memkit.estimate.levers.offload_optimizer import OFFLOAD_OPTIMIZER
from lightning_memkit.estimate.levers.optimizer_8bit import OPTIMIZER_8BIT
from lightning_memkit.estimate.levers.optimizer_in_backward import OPTIMIZER_IN_BACKWARD
from lightning_memkit.estimate.step import estimate_training_memory

LEVERS = (OPTIMIZER_IN_BACKWARD, OFFLOAD_OPTIMIZER, OPTIMIZER_8BIT)


class _Run:
    batch_size = 8

    def __init__(self, optimizer="AdamW", accumulate=1, refusals=None):
        self.optimizer_name, self.accumulate, self.refusals = optimizer, accumulate, refusals or {}

    def allows(self, name):
        return True


def test_which_runs_may_pull_them():
    assert [x.options(False, _Run()) for x in LEVERS] == [[False, True]] * 3
    assert OPTIMIZER_8BIT.unavailable(_Run("SGD")) == "it wraps Adam, AdamW, not SGD"
    assert OPTIMIZER_IN_BACKWARD.unavailable(_Run("LBFGS")).startswith("it wraps SGD, Adam, AdamW")
    assert OPTIMIZER_IN_BACKWARD.unavailable(_Run(accumulate=4)) == (
        "accumulate_grad_batches=4: each backward would step the parameters at once")
    assert OFFLOAD_OPTIMIZER.unavailable(_Run(accumulate=4)) is None  # the gradients accumulate on the device
    why = "gradient clipping (gradient_clip_val=1.0) needs the gradients"
    assert OPTIMIZER_IN_BACKWARD.unavailable(_Run(refusals={"optimizer_in_backward": why})) == why
    assert OPTIMIZER_IN_BACKWARD.options(False, _Run(accumulate=2)) == [False]
    assert OPTIMIZER_IN_BACKWARD.options(True, _Run(accumulate=2)) == [True]  # the run as given stays


def test_one_optimizer_callback_per_plan_and_no_step_in_backward_with_micro_batches():
    plan = {"micro_batch": 8, "optimizer_in_backward": True, "offload_optimizer": False, "optimizer_8bit": False}
    assert not OPTIMIZER_IN_BACKWARD.conflicts(plan, _Run())
    assert OPTIMIZER_IN_BACKWARD.conflicts({**plan, "micro_batch": 4}, _Run())
    # the two go together as OffloadOptimizer(offload_gradients=True); neither with 8 bits, nor with micro-batches
    assert not OPTIMIZER_IN_BACKWARD.conflicts({**plan, "offload_optimizer": True}, _Run())
    assert OPTIMIZER_IN_BACKWARD.conflicts({**plan, "optimizer_8bit": True}, _Run())
    assert OPTIMIZER_IN_BACKWARD.conflicts({**plan, "offload_optimizer": True, "micro_batch": 4}, _Run())
    # the host offload alone takes micro-batches: the gradients accumulate on the device until the step
    assert not OFFLOAD_OPTIMIZER.conflicts({**plan, "optimizer_in_backward": False, "offload_optimizer": True,
                                            "micro_batch": 4}, _Run())
    assert not OPTIMIZER_8BIT.conflicts(plan, _Run())  # off: nothing to refuse


def test_the_fake_step_wraps_the_optimizer():
    """In the fake step the step in backward leaves no gradient alive at once: a lower peak than AdamW's."""
    spec = StepSpec()
    OPTIMIZER_IN_BACKWARD.to_step(True, spec)
    OFFLOAD_OPTIMIZER.to_step(False, spec)
    assert len(spec.optimizer) == 1

    def model():
        return torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])

    def adamw(m):
        return torch.optim.AdamW(m.parameters(), lr=1e-3)

    batch = lambda: torch.randn(8, 256)  # noqa: E731
    plain = estimate_training_memory(model, batch, loss_fn=lambda m, b: m(b).square().mean(), optimizer=adamw)
    wrapped = estimate_training_memory(model, batch, loss_fn=lambda m, b: m(b).square().mean(),
                                       optimizer=spec.optimizer[0](adamw))
    assert wrapped.optimizer == "in_backward(adamw)"
    assert wrapped.peak_bytes < plain.peak_bytes
    assert all(p.gradients <= 256 * 256 * 4 + 256 * 4 for p in wrapped.phases)  # one layer's at most
