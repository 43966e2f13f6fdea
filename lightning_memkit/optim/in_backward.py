"""The optimizer step fused into backward: each parameter is stepped as soon as its gradient is complete, and the
gradient freed, so the gradients of the whole model are never alive at once.

:class:`InBackwardOptimizer` splits a configured optimizer (one of :data:`~lightning_memkit.optim.wrapper.SEPARABLE`)
into one optimizer of its class per parameter, stepped from the parameter's post-accumulate-grad hook
(``Tensor.register_post_accumulate_grad_hook``, torch's per-parameter optimizer pattern; torchtune's
``optimizer_in_bwd``). Each update is the one the configured optimizer makes (same class, hyperparameters read from
its groups, which LR schedulers edit, just before the step): the same math, bitwise on CPU. Its own ``step()`` runs
the closure and steps the parameters given gradients another way (set by hand); ``zero_grad()`` has nothing left
to free. ``state_dict()``/``load_state_dict()`` use the configured optimizer's format.

Not for gradient accumulation or clipping (each backward steps at once, on the gradient as it is), nor for
gradients reduced across processes after backward (DDP's all-reduce). A parameter whose gradient completes twice in
one backward (a reentrant checkpoint of a shared weight) raises rather than being stepped twice.

Example::

    >>> import torch
    >>> _ = torch.manual_seed(0)
    >>> model = torch.nn.Linear(8, 8)
    >>> opt = InBackwardOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    >>> before = model.weight.detach().clone()
    >>> model(torch.randn(4, 8)).square().mean().backward()     # stepped during backward
    >>> model.weight.grad is None, bool((model.weight != before).any())
    (True, True)
    >>> adamw = opt.restore()      # hooks off; the state back in the configured AdamW
    >>> sorted(adamw.state[model.weight])
    ['exp_avg', 'exp_avg_sq', 'step']
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from lightning_memkit.optim.wrapper import (
    StandInOptimizer,
    check_separable,
    copy_hyperparameters,
    lever_factory,
    same_class,
)

__all__ = ["InBackwardOptimizer", "in_backward"]

_OWNER = "InBackwardOptimizer"


class InBackwardOptimizer(StandInOptimizer):
    """Steps each parameter of ``optimizer`` in backward, as soon as its gradient is complete, and frees the gradient.

    Args:
        optimizer: the configured optimizer (torch's SGD, Adam, AdamW, Adagrad, RMSprop, ...: per-parameter
            separable ones); its state, if any, is taken over. :meth:`restore` gives it back, with the state.

    Raises:
        TypeError / ValueError: not an optimizer, or one that cannot be split per parameter (LBFGS, unknown classes).
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        check_separable(optimizer, _OWNER)
        super().__init__(optimizer)
        self._per_param: dict[torch.Tensor, torch.optim.Optimizer] = {}
        self._group_of: dict[torch.Tensor, int] = {}
        for index, group in enumerate(optimizer.param_groups):
            for p in group["params"]:
                self._per_param[p] = same_class(optimizer, [{**group, "params": [p]}])
                self._group_of[p] = index
        self._adopt_state()
        self._stepped: set[torch.Tensor] = set()
        self._handles = [p.register_post_accumulate_grad_hook(self._step_parameter)
                         for p in self._per_param if p.requires_grad]

    # -- stepping ------------------------------------------------------------------------------------------------
    def _step_parameter(self, p: torch.Tensor) -> None:
        if p in self._stepped:
            raise RuntimeError(f"{_OWNER}: a gradient of the {tuple(p.shape)} parameter completed twice before "
                               "step()/zero_grad() (a reentrant checkpoint of a shared weight, or a second backward): "
                               "stepping it again would apply two updates")
        optimizer = self._per_param[p]
        copy_hyperparameters(self.param_groups[self._group_of[p]], optimizer.param_groups[0])
        optimizer.step()
        p.grad = None
        self._stepped.add(p)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Run ``closure`` (forward and backward: the parameters are stepped in it), then step the parameters that
        hold a gradient given another way (and free it). Returns the closure's result."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for p in self._per_param:
            if p.grad is not None:
                self._step_parameter(p)
        self._stepped.clear()
        self.mark_stepped()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Free any gradient left (the ones stepped in backward are freed already)."""
        for p in self._per_param:
            p.grad = None
        self._stepped.clear()

    # -- state ---------------------------------------------------------------------------------------------------
    @property
    def state(self) -> dict[torch.Tensor, dict[str, Any]]:  # type: ignore[override]
        """Each parameter's state (the per-parameter optimizers' own dicts)."""
        return {p: opt.state[p] for p, opt in self._per_param.items() if p in opt.state}

    def state_dict(self) -> dict[str, Any]:
        """The configured optimizer's ``state_dict()`` with this state: it loads into a run without the lever."""
        self.configured.state.update(self.state)
        try:
            return self.configured.state_dict()
        finally:
            self.configured.state.clear()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a ``state_dict()`` of the configured optimizer's class (saved with or without the lever)."""
        self.configured.load_state_dict(state_dict)
        for optimizer in self._per_param.values():
            optimizer.state.clear()
        self._adopt_state()

    def _adopt_state(self) -> None:
        for p, optimizer in self._per_param.items():
            state = self.configured.state.pop(p, None)
            if state is not None:
                optimizer.state[p] = state
        self.configured.state.clear()

    def restore(self) -> torch.optim.Optimizer:
        """Remove the hooks and give the configured optimizer back, holding the state."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.configured.state.update(self.state)
        for optimizer in self._per_param.values():
            optimizer.state.clear()
        return self.configured

    def __enter__(self) -> InBackwardOptimizer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.restore()


def in_backward(factory: Callable[[torch.nn.Module], torch.optim.Optimizer]
                ) -> Callable[[torch.nn.Module], InBackwardOptimizer]:
    """``factory`` (``model -> optimizer``, as ``estimate_training_memory(optimizer=...)`` takes) with the step in
    backward: ``model -> InBackwardOptimizer(factory(model))``.

    Example::

        >>> def sgd(model):
        ...     return torch.optim.SGD(model.parameters(), lr=0.1)
        >>> make = in_backward(sgd)
        >>> make.__name__, type(make(torch.nn.Linear(2, 2))).__name__
        ('in_backward(sgd)', 'InBackwardOptimizer')
    """
    return lever_factory(factory, InBackwardOptimizer, "in_backward")

