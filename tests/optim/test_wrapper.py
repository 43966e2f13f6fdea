"""What the levers share: each stands in for the configured optimizer (its groups, which an LR scheduler edits
without a warning about the call order, its defaults), copies of an optimizer keep its constructor arguments, the
allow-list of separable optimizers, factories named after what they wrap."""

from __future__ import annotations

import warnings

import pytest
import torch
from loops import batches, mlp, train, two_groups

from lightning_memkit.optim import EightBitAdamW, HostOffloadOptimizer, InBackwardOptimizer
from lightning_memkit.optim.wrapper import check_separable, copy_hyperparameters, lever_factory, same_class

LEVERS = [InBackwardOptimizer, HostOffloadOptimizer, EightBitAdamW]


@pytest.mark.parametrize("lever", LEVERS, ids=lambda c: c.__name__)
def test_it_stands_in_for_the_configured_optimizer(lever):
    model = mlp()
    configured = two_groups(model)
    scheduler = torch.optim.lr_scheduler.StepLR(configured, 1, gamma=0.5)
    opt = lever(configured)
    assert opt.param_groups is configured.param_groups and opt.defaults is configured.defaults
    assert isinstance(opt, torch.optim.Optimizer)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "lr_scheduler.step() before optimizer.step()" would fail here
        train(model, opt, batches(2), scheduler)
    assert configured.param_groups[0]["lr"] == 1e-2 / 4
    with pytest.raises(NotImplementedError, match="before wrapping"):
        opt.add_param_group({"params": [torch.zeros(1, requires_grad=True)]})
    assert repr(opt) == f"{lever.__name__}(AdamW, 2 groups)"


def test_a_copy_keeps_the_constructor_arguments_and_the_group_hyperparameters():
    w = torch.nn.Parameter(torch.ones(3))
    adamw = torch.optim.AdamW([w], lr=0.5, betas=(0.8, 0.9), foreach=False, maximize=True)
    copy = same_class(adamw, [{**adamw.param_groups[0], "params": [torch.zeros(3, requires_grad=True)]}])
    assert copy.defaults == adamw.defaults
    assert {k: v for k, v in copy.param_groups[0].items() if k != "params"} == \
        {k: v for k, v in adamw.param_groups[0].items() if k != "params"}
    target = {"params": [], "lr": 1.0, "eps": 1.0}
    copy_hyperparameters({"params": [w], "lr": 2.0, "momentum": 0.9}, target)
    assert target == {"params": [], "lr": 2.0, "eps": 1.0}


def test_the_allow_list():
    params = mlp().parameters()
    assert isinstance(check_separable(torch.optim.RMSprop(params), "X"), torch.optim.RMSprop)
    with pytest.raises(ValueError, match="^X: LBFGS is not supported"):
        check_separable(torch.optim.LBFGS(mlp().parameters()), "X")
    with pytest.raises(TypeError, match=r"^X\(optimizer=...\) must be a torch.optim.Optimizer, got str"):
        check_separable("adamw", "X")


def test_factories_are_named_after_what_they_wrap():
    def adamw(model):
        return torch.optim.AdamW(model.parameters())

    make = lever_factory(adamw, InBackwardOptimizer, "in_backward")
    assert make.__name__ == "in_backward(adamw)"
    assert isinstance(make(mlp()), InBackwardOptimizer)
    with pytest.raises(TypeError, match=r"^lever\(factory=...\) must be a callable model -> optimizer, got type"):
        lever_factory(torch.optim.AdamW, InBackwardOptimizer, "lever")


@pytest.mark.parametrize(("lever", "match"), [
    (InBackwardOptimizer, "completed twice before step"),
    (lambda o: HostOffloadOptimizer(o, offload_gradients=True), "gradients cannot accumulate on the host"),
], ids=["in_backward", "offload_gradients"])
def test_a_second_gradient_before_the_step_raises(lever, match):
    model = mlp()
    lever(two_groups(model))
    x = batches(1)[0]
    model(x).sum().backward()
    with pytest.raises(RuntimeError, match=match):
        model(x).sum().backward()
