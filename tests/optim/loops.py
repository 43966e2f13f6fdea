"""A small model, its two-group optimizer and a training loop in Lightning's order (``step(closure)``: forward,
``zero_grad``, backward), shared by the optimizer levers' tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

STEPS = 5


def mlp(seed: int = 0, width: int = 16) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.ReLU(), torch.nn.Linear(width, 4))


def two_groups(model: torch.nn.Module, cls: type = torch.optim.AdamW, **kwargs: Any) -> torch.optim.Optimizer:
    """``cls`` over the first layer (weight decay 0.1) and the last (the default), lr 1e-2."""
    first, last = model[0], model[-1]
    groups = [{"params": list(first.parameters()), "weight_decay": 0.1}, {"params": list(last.parameters())}]
    return cls(groups, lr=1e-2, **kwargs)


def batches(steps: int = STEPS, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(4, 8, generator=g) for _ in range(steps)]


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, data: list[torch.Tensor],
          scheduler: Any = None) -> list[float]:
    """One ``optimizer.step(closure)`` per batch (then ``scheduler.step()``); the losses."""
    losses = []
    for x in data:
        def closure(x: torch.Tensor = x) -> torch.Tensor:
            loss = model(x).square().mean()
            optimizer.zero_grad()
            loss.backward()
            return loss

        losses.append(float(optimizer.step(closure).detach()))
        if scheduler is not None:
            scheduler.step()
    return losses


def run(wrap: Callable[[torch.optim.Optimizer], Any] | None, cls: type = torch.optim.AdamW,
        **kwargs: Any) -> tuple[list[float], dict[str, Any], torch.nn.Module]:
    """:func:`train` of :func:`mlp` with ``wrap(two_groups(...))`` (``None``: the plain optimizer) and a StepLR
    halving the lr each step: the losses, the final ``state_dict()`` and the model."""
    model = mlp()
    configured = two_groups(model, cls, **kwargs)
    scheduler = torch.optim.lr_scheduler.StepLR(configured, 1, gamma=0.5)
    optimizer = wrap(configured) if wrap is not None else configured
    losses = train(model, optimizer, batches(), scheduler)
    return losses, optimizer.state_dict(), model


def assert_same_state(a: dict[str, Any], b: dict[str, Any]) -> None:
    """Two ``state_dict()``s hold the same groups and bitwise the same state (tensors compared on the CPU)."""
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for index, state in a["state"].items():
        assert state.keys() == b["state"][index].keys()
        for key, value in state.items():
            other = b["state"][index][key]
            if isinstance(value, torch.Tensor):
                assert torch.equal(value.cpu(), other.cpu()), (index, key)
            else:
                assert value == other, (index, key)


def resumes_both_ways(lever: Callable[[torch.optim.Optimizer], Any]) -> bool:
    """Whether 2 steps with ``lever`` (its ``state_dict()`` loaded into a new configured optimizer) and the rest
    without it, and the other way round, give the losses of a run without it, bitwise."""
    data = batches()
    straight_model = mlp()
    straight = train(straight_model, two_groups(straight_model), data)
    for first, second in ((lever, None), (None, lever)):
        model = mlp()
        configured = two_groups(model)
        opt = first(configured) if first else configured
        losses = train(model, opt, data[:2])
        saved = opt.state_dict()
        if first:
            opt.restore()  # hooks off: a new run
        resumed = two_groups(model)  # the weights as trained, the optimizer from the checkpoint
        opt = second(resumed) if second else resumed
        opt.load_state_dict(saved)
        if losses + train(model, opt, data[2:]) != straight:
            return False
    return True


def chain(width: int = 128, layers: int = 3) -> torch.nn.Module:
    """``layers`` square linear layers without bias."""
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])


def adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


def sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)


def estimates(factory: Callable[[torch.nn.Module], Any], lever: Callable[..., Any], width: int = 128,
              layers: int = 3, rows: int = 2) -> tuple[Any, Any]:
    """``estimate_training_memory`` of :func:`chain` on ``rows`` random rows with ``factory`` and with
    ``lever(factory)`` (a synthetic warm-up, the square of the output as the loss)."""
    from lightning_memkit.estimate.step import estimate_training_memory

    args = (lambda: chain(width, layers), lambda: torch.randn(rows, width))
    kwargs = {"loss_fn": lambda m, x: m(x).square().mean(), "warmup": "synthetic"}
    return (estimate_training_memory(*args, optimizer=factory, **kwargs),
            estimate_training_memory(*args, optimizer=lever(factory), **kwargs))
