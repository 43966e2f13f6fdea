"""What the optimizer-state levers share: an optimizer that stands in for the configured one, and copies of an
optimizer over other parameters.

A lever replaces the optimizer a Trainer (or a plain loop) steps, but not the configured one: LR schedulers hold that
one and edit its ``param_groups``. :class:`StandInOptimizer` therefore shows the configured optimizer's groups as its
own (``lr``, ``betas``... read from them before each step) and keeps its ``state_dict()`` format, so a checkpoint
moves between runs with and without the lever.

Example::

    >>> import torch
    >>> w = torch.nn.Parameter(torch.ones(4))
    >>> adamw = torch.optim.AdamW([w], lr=0.1, weight_decay=0.0)
    >>> copy = same_class(adamw, [{**adamw.param_groups[0], "params": [torch.zeros(4, requires_grad=True)]}])
    >>> type(copy).__name__, copy.param_groups[0]["lr"]
    ('AdamW', 0.1)
"""

from __future__ import annotations

import inspect
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["SEPARABLE", "StandInOptimizer", "check_separable", "copy_hyperparameters", "lever_factory", "same_class"]

#: torch's optimizers whose update of a parameter reads only that parameter, its gradient and its own state (no
#: closure, no quantity summed over parameters): one optimizer per parameter, or one over host copies, does the math
#: of the configured one
SEPARABLE: tuple[type[torch.optim.Optimizer], ...] = tuple(
    getattr(torch.optim, name) for name in ("SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "Adamax", "ASGD", "NAdam",
                                            "RAdam", "RMSprop", "Rprop", "Adafactor") if hasattr(torch.optim, name))
_HOOKS = ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks", "_optimizer_state_dict_pre_hooks",
          "_optimizer_state_dict_post_hooks", "_optimizer_load_state_dict_pre_hooks",
          "_optimizer_load_state_dict_post_hooks")


def check_separable(optimizer: Any, owner: str) -> torch.optim.Optimizer:
    """``optimizer`` if it is one of :data:`SEPARABLE` (the class itself, not a subclass, which may do more), else a
    ``TypeError``/``ValueError`` naming it and what is allowed."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"{owner}(optimizer=...) must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if type(optimizer) not in SEPARABLE:
        allowed = ", ".join(c.__name__ for c in SEPARABLE)
        raise ValueError(f"{owner}: {type(optimizer).__name__} is not supported (it needs a closure, sums over "
                         f"parameters or is unknown); allowed: torch.optim {allowed}")
    return optimizer


def copy_hyperparameters(source: dict[str, Any], target: dict[str, Any]) -> None:
    """Set ``target``'s hyperparameters (every key but ``"params"``) that ``source`` has to ``source``'s values."""
    for key in target.keys() & source.keys():
        if key != "params":
            target[key] = source[key]


def same_class(optimizer: torch.optim.Optimizer, groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    """An optimizer of ``optimizer``'s class over ``groups`` (dicts with their ``"params"`` and hyperparameters),
    built with ``optimizer``'s constructor arguments (the ``defaults`` its constructor takes: ``fused``...)."""
    cls = type(optimizer)
    accepted = inspect.signature(cls.__init__).parameters
    kwargs = {k: v for k, v in optimizer.defaults.items() if k in accepted and k != "params"}
    return cls(groups, **kwargs)


class StandInOptimizer(torch.optim.Optimizer):
    """Base of the levers' optimizers: stands in for ``optimizer`` (the configured one, :attr:`configured`), whose
    ``param_groups`` (the ones LR schedulers edit) and ``defaults`` it shows as its own. Subclasses do the stepping.

    ``Optimizer.__init__`` is not called (it would make groups of its own); ``add_param_group`` is refused.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.configured = optimizer
        self.defaults = optimizer.defaults
        for name in _HOOKS:
            setattr(self, name, OrderedDict())

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.configured.param_groups

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise NotImplementedError(f"{type(self).__name__}: add parameter groups to the optimizer before wrapping it")

    def mark_stepped(self) -> None:
        """Tell LR schedulers attached to the configured optimizer that a step happened (torch's ``_opt_called``
        flag, which their ``step()`` reads to warn about a wrong call order)."""
        self.configured._opt_called = True  # type: ignore[attr-defined]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({type(self.configured).__name__}, {len(self.param_groups)} groups)"


def lever_factory(factory: Callable[[torch.nn.Module], torch.optim.Optimizer], wrap: Callable[..., Any], name: str,
                  **kwargs: Any) -> Callable[[torch.nn.Module], Any]:
    """``model -> wrap(factory(model), **kwargs)`` (an optimizer factory with a lever), named
    ``name(<factory's name>)``."""
    if not callable(factory) or isinstance(factory, type):
        raise TypeError(f"{name}(factory=...) must be a callable model -> optimizer, got {type(factory).__name__}")

    def make(model: torch.nn.Module) -> Any:
        return wrap(factory(model), **kwargs)

    make.__name__ = f"{name}({getattr(factory, '__name__', type(factory).__name__)})"
    return make
