"""estimate_training_memory: exact bytes on small models, agreement with LivePeak in real Trainer steps, errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from benchmarks.bench_estimate import CASES, FAST_CASES, TOLERANCE, compare
from lightning_memkit.estimate.trace import balanced_routing
from lightning_memkit.memory import LivePeak, current_rss_bytes, estimate_training_memory


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 8))


def _batch() -> torch.Tensor:
    return torch.randn(32, 256)


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).square().mean()


def _real_peak(optimizer: str) -> int:
    """LivePeak over the same plain loop, from before the model is built; the peak of the second step."""
    with LivePeak() as lp:
        model = _mlp()
        params = list(model.parameters())
        opt = torch.optim.SGD(params, lr=1e-3, momentum=0.9) if optimizer == "sgd" else torch.optim.AdamW(params,
                                                                                                       lr=1e-3)
        peak = 0
        for step in range(2):
            x = _batch()
            if step == 1:
                lp.reset_peak()
            loss = _loss(model, x)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            del loss
            opt.step()
            peak = lp.peak_bytes
            del x
    return peak


PARAM_BYTES = 4 * (256 * 512 + 512 + 512 * 8 + 8)


@pytest.mark.parametrize("optimizer, state_per_param", [("sgd", 1), ("adamw", 2)])
def test_split_is_exact_and_peak_equals_livepeak(optimizer: str, state_per_param: int) -> None:
    est = estimate_training_memory(_mlp, _batch, loss_fn=_loss, optimizer=optimizer)
    load, forward, backward, step = est.phases
    assert load.weights == load.peak_bytes == PARAM_BYTES
    assert forward.gradients == PARAM_BYTES  # Lightning's order: the previous gradients live during forward
    assert step.weights == step.gradients == PARAM_BYTES
    assert step.optimizer_state == state_per_param * PARAM_BYTES  # AdamW step counts: torch.tensor(), uncounted
    assert forward.saved_activations > 0 and forward.peak_layer == "1"  # ReLU: its input and output alive
    assert est.peak_bytes == max(p.peak_bytes for p in (forward, backward, step))
    assert est.parameters == est.trainable_parameters == PARAM_BYTES // 4
    assert est.peak_bytes == _real_peak(optimizer)
    assert '"peak_bytes"' in est.to_json() and "optimizer step" in str(est)


def test_zero_grad_before_forward_drops_gradients_first() -> None:
    after = estimate_training_memory(_mlp, _batch, loss_fn=_loss, optimizer="sgd")
    before = estimate_training_memory(_mlp, _batch, loss_fn=_loss, optimizer="sgd", zero_grad="before_forward")
    assert before.phases[1].gradients == 0
    assert before.phases[1].peak_bytes == after.phases[1].peak_bytes - PARAM_BYTES


def test_checkpoint_lowers_saved_activations() -> None:
    def model() -> nn.Module:
        net = nn.Module()
        net.blocks = nn.ModuleList(nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256))
                                   for _ in range(4))
        net.forward = lambda x: [x := b(x) for b in net.blocks][-1]
        return net

    plain = estimate_training_memory(model, _batch, loss_fn=_loss, optimizer="sgd")
    ckpt = estimate_training_memory(model, _batch, loss_fn=_loss, optimizer="sgd", checkpoint="auto")
    assert ckpt.phases[1].saved_activations < plain.phases[1].saved_activations / 2
    assert ckpt.features == ["activation checkpointing (4 modules)"]


def test_nothing_real_is_allocated_for_a_large_model() -> None:
    def big() -> nn.Module:  # 4 GiB of float32 weights
        return nn.Sequential(*[nn.Linear(16384, 16384, bias=False) for _ in range(4)])

    rss = current_rss_bytes()
    with LivePeak() as lp:
        est = estimate_training_memory(big, lambda: torch.randn(2, 16384), loss_fn=_loss, optimizer="sgd")
    assert est.phases[0].weights == 4 * 16384 * 16384 * 4
    assert current_rss_bytes() - rss < 2**30  # weights, gradients and momentum would be 12 GiB
    assert lp.peak_bytes < 2**20  # an open LivePeak does not see the estimate's fake peak (unmeasured)


def test_a_fake_batch_gives_the_same_estimate() -> None:
    real = estimate_training_memory(_mlp, _batch, loss_fn=_loss, optimizer="sgd")
    fake = estimate_training_memory(_mlp, _batch, loss_fn=_loss, optimizer="sgd", fake_batch=True)
    assert [p.peak_bytes for p in fake.phases] == [p.peak_bytes for p in real.phases]
    with pytest.raises(TypeError, match="fake_batch"):
        estimate_training_memory(_mlp, _batch, fake_batch="yes")


class _KeepsATensor(nn.Module):
    """The MLP, keeping a tensor its first forward makes: a first step leaves more than gradients and state."""

    def __init__(self) -> None:
        super().__init__()
        self.net, self.kept = _mlp(), None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kept is None:
            self.kept = torch.empty(4096)
        return self.net(x)


def test_a_synthetic_warmup_gives_the_same_estimate() -> None:
    """``warmup="synthetic"`` makes the first step's gradients and optimizer state directly: the same bytes as a real
    first step; where the recorded step shows more kept (not a steady state) it is traced again after a real one."""
    from lightning_memkit.estimate.step import WarmupMismatch, resolve_optimizer, trace_training_step

    for factory in (_mlp, _KeepsATensor):
        real = estimate_training_memory(factory, _batch, loss_fn=_loss)
        assert estimate_training_memory(factory, _batch, loss_fn=_loss, warmup="synthetic").phases == real.phases
    with pytest.raises(WarmupMismatch, match="not a steady state"):
        trace_training_step(_KeepsATensor, _batch, resolve_optimizer("adamw", None)[0], loss_fn=_loss,
                            warmup="synthetic")
    with pytest.raises(ValueError, match="warmup"):
        estimate_training_memory(_mlp, _batch, warmup="none")


@pytest.mark.parametrize("lever", ["in_backward", "host_offload"])
def test_a_step_in_backward_after_a_synthetic_warmup_is_traced_once(lever) -> None:
    """An optimizer that steps in backward and frees each gradient (the step in backward, the host offload of the
    gradients) still shows the gradients its backward made: the synthetic warm-up is checked, not traced again,
    and gives a real first step's bytes."""
    from lightning_memkit.optim.host_offload import host_offload
    from lightning_memkit.optim.in_backward import in_backward

    adamw = lambda model: torch.optim.AdamW(model.parameters())  # noqa: E731
    make = in_backward(adamw) if lever == "in_backward" else host_offload(adamw, offload_gradients=True)
    built = []

    def factory() -> nn.Module:
        built.append(1)
        return _mlp()

    real = estimate_training_memory(factory, _batch, loss_fn=_loss, optimizer=make)
    assert len(built) == 1
    synthetic = estimate_training_memory(factory, _batch, loss_fn=_loss, optimizer=make, warmup="synthetic")
    assert len(built) == 2  # one model: no second trace after a real first step
    assert synthetic.phases == real.phases


def test_ops_of_real_tensors_that_expand_past_the_limit_are_fake() -> None:
    from torch._subclasses.fake_tensor import is_fake

    from lightning_memkit.estimate.trace import REAL_OP_BYTES, fake_tensors

    with fake_tensors():
        positions = torch.arange(8192)  # real: a model may read positions
        shifted = positions + 1  # as large as its input: real
        mask = positions[:, None] <= positions[None, :]  # 64 MiB from 128 KiB: fake
    assert not is_fake(positions) and not is_fake(shifted) and shifted[-1] == 8192
    assert is_fake(mask) and mask.shape == (8192, 8192) and mask.untyped_storage().nbytes() > REAL_OP_BYTES


def test_balanced_routing_loads_differ_by_at_most_one() -> None:
    routing = balanced_routing(7, 3, 4)
    loads = torch.bincount(routing.flatten(), minlength=4)
    assert loads.sum() == 21 and loads.max() - loads.min() <= 1
    assert all(len(set(row)) == 3 for row in routing.tolist())  # distinct experts per token


@pytest.mark.parametrize("kwargs, message", [
    ({"precision": "8-true"}, "precision"),
    ({"optimizer": "lion"}, "optimizer"),
    ({"zero_grad": "never"}, "zero_grad"),
    ({"expert_balance": "skewed"}, "expert_balance"),
    ({"checkpoint": 3}, "policy"),
    ({"patches": [None]}, "patches"),
    ({"loss_fn": "mse"}, "loss_fn"),
])
def test_bad_arguments_are_named(kwargs: dict, message: str) -> None:
    with pytest.raises((TypeError, ValueError), match=message):
        estimate_training_memory(_mlp, _batch, **kwargs)


def test_model_factory_must_build_a_module() -> None:
    with pytest.raises(TypeError, match="model_factory"):
        estimate_training_memory(lambda: torch.zeros(3), _batch)
    with pytest.raises(TypeError, match="batch_factory"):
        estimate_training_memory(_mlp, None)


@pytest.mark.parametrize("case", FAST_CASES, ids=lambda c: c.name)
def test_within_tolerance_of_a_real_trainer_step(case) -> None:
    r = compare(case)
    assert abs(r["error"]) <= TOLERANCE, r


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c in CASES if c not in FAST_CASES], ids=lambda c: c.name)
def test_every_case_within_tolerance(case) -> None:
    r = compare(case)
    assert abs(r["error"]) <= TOLERANCE, r


def test_cuda_target_swaps_in_the_foreach_step_temporaries() -> None:
    from lightning_memkit.pipeline.cost import optimizer_step_bytes

    cpu = estimate_training_memory(_mlp, _batch, loss_fn=_loss)
    cuda = estimate_training_memory(_mlp, _batch, loss_fn=_loss, target="cuda")
    params = list(_mlp().parameters())
    delta = optimizer_step_bytes(params, "adamw", foreach=True) - optimizer_step_bytes(params, "adamw", foreach=False)
    assert delta == PARAM_BYTES - 2 * 4 * 256 * 512  # all parameters at once, against twice the largest one
    assert cuda.phases[-1].peak_bytes == cpu.phases[-1].peak_bytes + delta
    assert [p.peak_bytes for p in cuda.phases[:-1]] == [p.peak_bytes for p in cpu.phases[:-1]]
    assert any("foreach" in a for a in cuda.assumptions)
    with pytest.raises(ValueError, match="target"):
        estimate_training_memory(_mlp, _batch, loss_fn=_loss, target="tpu")


def test_plugin_must_be_a_precision_plugin_and_owns_the_precision() -> None:
    with pytest.raises(TypeError, match="convert_module"):
        estimate_training_memory(_mlp, _batch, loss_fn=_loss, plugin=object())

    class Plugin:
        def convert_module(self, m):
            return m

        def forward_context(self):
            import contextlib

            return contextlib.nullcontext()

    with pytest.raises(ValueError, match="precision"):
        estimate_training_memory(_mlp, _batch, loss_fn=_loss, plugin=Plugin(), precision="bf16-true")
    est = estimate_training_memory(_mlp, _batch, loss_fn=_loss, plugin=Plugin())
    plain = estimate_training_memory(_mlp, _batch, loss_fn=_loss)
    assert est.precision == "Plugin" and est.peak_bytes == plain.peak_bytes
