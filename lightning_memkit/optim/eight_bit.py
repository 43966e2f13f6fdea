"""8-bit AdamW: the configured Adam/AdamW's moments kept in 8 bits (one byte each, plus a float32 scale per block
of 256 values) instead of float32: about 2 bytes of state per parameter instead of 8. It changes the numerics (opt in).

:class:`EightBitAdamW` steps bitsandbytes' ``AdamW8bit`` (block-wise dynamic quantization) with the configured
optimizer's hyperparameters, read from its groups (which LR schedulers edit) before each step. Parameters smaller than
``min_8bit_size`` keep float32 moments (bitsandbytes' rule: their scales would cost more than they save).
:func:`eight_bit_state_bytes` gives the state's bytes in advance (exact: what ``LivePeak`` counts).

Why bitsandbytes and not torchao's ``AdamW8bit``: bitsandbytes is a dependency already, its 8-bit optimizers run
on CPU (plain torch kernels, so the tests and a CPU run use them) and on CUDA (its own kernels), and they run on fake
tensors (an estimate) once their quantization maps are made for real (this module does that). torchao's compiles
its step with ``torch.compile`` (a C++ toolchain and seconds of compilation per parameter shape on CPU) and would be
a new dependency for the same format (block-wise dynamic 8-bit, blocks of 256).

Its ``state_dict()`` is bitsandbytes' format (``state1``, ``state2``, ``absmax1``...): a checkpoint of an 8-bit run
resumes with it only, and loading a float32 Adam/AdamW checkpoint into it is refused (no silent restart of the
moments).

Example::

    >>> import torch
    >>> w = torch.nn.Parameter(torch.zeros(4096))
    >>> opt = EightBitAdamW(torch.optim.AdamW([w], lr=1e-3))
    >>> w.grad = torch.ones(4096)
    >>> _ = opt.step()
    >>> eight_bit_state_bytes([w])       # 2 x 4096 bytes + 2 x 16 block scales + 2 quantization maps of 256 floats
    10368
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from lightning_memkit.common.validation import check_int
from lightning_memkit.optim.wrapper import StandInOptimizer, copy_hyperparameters, lever_factory

__all__ = ["BLOCK_SIZE", "MIN_8BIT_SIZE", "EightBitAdamW", "eight_bit", "eight_bit_state_bytes"]

_OWNER = "EightBitAdamW"
BLOCK_SIZE = 256  #: values per float32 scale (bitsandbytes' block-wise quantization)
MIN_8BIT_SIZE = 4096  #: bitsandbytes' default: smaller parameters keep float32 moments
_MAPS = 2 * 256 * 4  # the signed and unsigned quantization maps, 256 float32 each, one pair per optimizer


def eight_bit_state_bytes(params: Iterable[torch.Tensor], min_8bit_size: int = MIN_8BIT_SIZE) -> int:
    """The bytes of :class:`EightBitAdamW`'s state over ``params``: per parameter of ``n >= min_8bit_size`` elements
    two moments of ``n`` bytes and two float32 scales per block of 256; smaller ones two float32 moments; plus the
    two quantization maps (2 KiB). The parameters' dtype does not matter.

    Example::

        >>> eight_bit_state_bytes([torch.empty(1000, 1000), torch.empty(1000)])   # 2e6 + 2*4*3907 + 8000 + 2048
        2041304
    """
    check_int(min_8bit_size, "min_8bit_size", minimum=0, owner="eight_bit_state_bytes")
    total = _MAPS
    for p in params:
        n = p.numel()
        total += 2 * n + 8 * math.ceil(n / BLOCK_SIZE) if n >= min_8bit_size else 8 * n
    return total


def _check_adam(optimizer: Any) -> None:
    """Refuse what AdamW8bit does not compute: other optimizers, AMSGrad, maximize, Adam's L2 weight decay."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"{_OWNER}(optimizer=...) must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        raise ValueError(f"{_OWNER}: only torch.optim.Adam and AdamW have an 8-bit replacement, got "
                         f"{type(optimizer).__name__}")
    for i, group in enumerate(optimizer.param_groups):
        for key in ("amsgrad", "maximize", "differentiable"):
            if group.get(key):
                raise ValueError(f"{_OWNER}: param group {i} sets {key}=True, which the 8-bit AdamW does not compute")
        if type(optimizer) is torch.optim.Adam and group["weight_decay"] and not group.get("decoupled_weight_decay"):
            raise ValueError(f"{_OWNER}: param group {i} of torch.optim.Adam has weight_decay={group['weight_decay']} "
                             "(L2, added to the gradient); the 8-bit AdamW decays the weights (decoupled): use AdamW")


class EightBitAdamW(StandInOptimizer):
    """bitsandbytes' ``AdamW8bit`` with ``optimizer``'s parameters, groups and hyperparameters (lr, betas, eps,
    weight decay), read from its groups before each step.

    Args:
        optimizer: the configured ``torch.optim.AdamW`` or ``Adam`` (without L2 weight decay, AMSGrad, maximize), with
            no state yet.
        min_8bit_size: parameters with fewer elements keep float32 moments.

    Attributes:
        eight_bit: the bitsandbytes optimizer (its ``state`` is this optimizer's).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, min_8bit_size: int = MIN_8BIT_SIZE) -> None:
        _check_adam(optimizer)
        check_int(min_8bit_size, "min_8bit_size", minimum=0, owner=_OWNER)
        if optimizer.state:
            raise ValueError(f"{_OWNER}: {type(optimizer).__name__} has float32 state already; the 8-bit AdamW starts "
                             "from none (replace the optimizer before its first step)")
        import bitsandbytes as bnb

        super().__init__(optimizer)
        keys = ("lr", "betas", "eps", "weight_decay")
        groups = [{"params": g["params"], **{k: g[k] for k in keys}} for g in optimizer.param_groups]
        with unset_fake_temporarily():  # its quantization maps are real values, also in a fake-tensor estimate
            self.eight_bit = bnb.optim.AdamW8bit(groups, min_8bit_size=min_8bit_size)

    def _sync(self) -> None:
        for source, target in zip(self.param_groups, self.eight_bit.param_groups):
            copy_hyperparameters(source, target)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """One step of the 8-bit AdamW (after ``closure``, if given); returns the closure's result."""
        self._sync()
        loss = self.eight_bit.step(closure)
        self.mark_stepped()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.eight_bit.zero_grad(set_to_none=set_to_none)

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.eight_bit.state

    def state_dict(self) -> dict[str, Any]:
        """bitsandbytes' format (8-bit moments, block scales, maps) with the configured groups' hyperparameters."""
        self._sync()
        return self.eight_bit.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a ``state_dict()`` of an 8-bit run; a float32 Adam/AdamW one (``exp_avg``...) is refused."""
        if any(isinstance(s, dict) and "exp_avg" in s for s in state_dict.get("state", {}).values()):
            raise ValueError(f"{_OWNER}: the state to load is a float32 Adam/AdamW's (exp_avg, exp_avg_sq); an 8-bit "
                             "run resumes from an 8-bit checkpoint only (or train on without the 8-bit optimizer)")
        self.eight_bit.load_state_dict(state_dict)
        for source, target in zip(self.eight_bit.param_groups, self.param_groups):
            copy_hyperparameters(source, target)


def eight_bit(factory: Callable[[torch.nn.Module], torch.optim.Optimizer], *, min_8bit_size: int = MIN_8BIT_SIZE
              ) -> Callable[[torch.nn.Module], EightBitAdamW]:
    """``factory`` (``model -> Adam/AdamW``, as ``estimate_training_memory(optimizer=...)`` takes) with 8-bit
    moments: ``model -> EightBitAdamW(factory(model), min_8bit_size=...)``.

    Example::

        >>> def adamw(model):
        ...     return torch.optim.AdamW(model.parameters())
        >>> eight_bit(adamw).__name__
        'eight_bit(adamw)'
    """
    check_int(min_8bit_size, "min_8bit_size", minimum=0, owner="eight_bit")
    return lever_factory(factory, EightBitAdamW, "eight_bit", min_8bit_size=min_8bit_size)
