"""InBackwardOptimizer: the configured optimizer's math, bitwise, for every separable class (LR scheduler and two
groups included); one gradient alive at a time (LivePeak, exact on CPU); the configured optimizer's checkpoint format
both ways; refusals; the fake-tensor estimate drops by the gradients no longer alive at once."""

from __future__ import annotations

import pytest
import torch
from loops import assert_same_state, batches, chain, estimates, mlp, resumes_both_ways, run, sgd, train, two_groups

from lightning_memkit.measure.live_peak import LivePeak
from lightning_memkit.optim import SEPARABLE, InBackwardOptimizer, in_backward

KWARGS = {"SGD": {"momentum": 0.9, "nesterov": True}}


@pytest.mark.parametrize("cls", SEPARABLE, ids=lambda c: c.__name__)
def test_the_same_steps_as_the_configured_optimizer_bitwise(cls):
    kwargs = KWARGS.get(cls.__name__, {})
    plain_losses, plain_state, plain_model = run(None, cls, **kwargs)
    losses, state, model = run(InBackwardOptimizer, cls, **kwargs)
    assert losses == plain_losses
    assert_same_state(state, plain_state)
    for p, q in zip(model.parameters(), plain_model.parameters()):
        assert torch.equal(p, q)


def _step_bytes(wrap, cls, **kwargs) -> tuple[int, int]:
    """LivePeak's peak and live bytes over the second step of :func:`_chain` (a batch of one row)."""
    model = chain(256, 4)
    configured = cls(model.parameters(), lr=1e-3, **kwargs)
    optimizer = wrap(configured) if wrap else configured
    data = torch.randn(2, 1, 256)
    train(model, optimizer, [data[0]])
    with LivePeak() as lp:
        train(model, optimizer, [data[1]])
    return lp.peak_bytes, lp.live_bytes


@pytest.mark.parametrize("cls", [torch.optim.SGD, torch.optim.AdamW], ids=lambda c: c.__name__)
def test_one_gradient_is_alive_at_a_time(cls):
    grad = 256 * 256 * 4  # each of the 4 layers' weight gradient
    kwargs = {"momentum": 0.9} if cls is torch.optim.SGD else {}
    plain_peak, plain_live = _step_bytes(None, cls, **kwargs)
    peak, live = _step_bytes(InBackwardOptimizer, cls, **kwargs)
    assert plain_live == 4 * grad and live == 0  # the plain step keeps its gradients until the next zero_grad
    assert plain_peak >= 4 * grad
    if cls is torch.optim.SGD:  # SGD's update makes no temporaries: one gradient and the backward's few KiB
        assert grad <= peak < grad + 8192
    assert plain_peak - peak >= 3 * grad - 8192  # AdamW: its temporaries are alike in both


def test_a_checkpoint_moves_between_runs_with_and_without_it():
    assert resumes_both_ways(InBackwardOptimizer)


def test_restore_gives_the_state_back_and_removes_the_hooks():
    model = mlp()
    configured = two_groups(model)
    with InBackwardOptimizer(configured) as opt:
        train(model, opt, batches(1))
        assert not configured.state and len(opt.state) == 4
    assert sorted(configured.state[model[0].weight]) == ["exp_avg", "exp_avg_sq", "step"]
    before = model[0].weight.detach().clone()
    model(batches(1)[0]).sum().backward()  # no hook steps it now
    assert torch.equal(model[0].weight, before) and model[0].weight.grad is not None


def test_step_steps_gradients_set_by_hand_and_frees_them():
    model = mlp()
    opt = InBackwardOptimizer(two_groups(model, torch.optim.SGD))
    before = model[0].weight.detach().clone()
    model[0].weight.grad = torch.ones_like(before)
    opt.step()
    assert torch.allclose(model[0].weight, before * (1 - 1e-2 * 0.1) - 1e-2)  # weight decay 0.1, lr 1e-2
    assert model[0].weight.grad is None


def test_refusals():
    model = mlp()
    with pytest.raises(ValueError, match="LBFGS is not supported.*allowed: torch.optim SGD, Adam, AdamW"):
        InBackwardOptimizer(torch.optim.LBFGS(model.parameters()))

    class MyAdam(torch.optim.Adam):
        pass

    with pytest.raises(ValueError, match="MyAdam is not supported"):
        InBackwardOptimizer(MyAdam(model.parameters()))
    with pytest.raises(TypeError, match="must be a torch.optim.Optimizer, got list"):
        InBackwardOptimizer(list(model.parameters()))
    with pytest.raises(TypeError, match=r"in_backward\(factory=...\) must be a callable model -> optimizer"):
        in_backward(torch.optim.AdamW)


def test_the_estimate_drops_by_the_gradients_no_longer_alive_at_once():
    grad = 256 * 256 * 4
    plain, lever = estimates(sgd, in_backward, width=256, layers=4, rows=1)
    assert lever.optimizer == "in_backward(sgd)"
    assert all(p.gradients == 0 for p in lever.phases)
    assert [p.optimizer_state for p in lever.phases] == [p.optimizer_state for p in plain.phases]
    assert 3 * grad - 8192 <= plain.peak_bytes - lever.peak_bytes <= 3 * grad


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_the_same_losses():
    data = [x.cuda() for x in batches()]
    plain, model = mlp().cuda(), mlp().cuda()
    expected = train(plain, two_groups(plain), data)  # foreach over all parameters
    losses = train(model, InBackwardOptimizer(two_groups(model)), data)  # one parameter at a time
    assert max(abs(a - b) for a, b in zip(losses, expected)) < 1e-6
