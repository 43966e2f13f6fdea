"""Which parts of a model ``torch.compile`` runs: what decides how a step's bytes can be counted.

A compiled step's ops go through the dispatcher only where its backend runs them there (``eager``,
``aot_eager``); inductor's kernels fill buffers that inductor allocates itself, which a dispatch mode such
as :class:`~lightning_memkit.memory.LivePeak` never sees. The allocator sees them
(:class:`~lightning_memkit.measure.allocator_peak.AllocatorPeak`), so the measuring objects pick their
counter with :func:`runs_compiled`.

Example::

    >>> import torch
    >>> from lightning_memkit.measure.compiled import compiled_parts, runs_compiled
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    >>> runs_compiled(model)
    False
    >>> model[0].compile()
    >>> compiled_parts(model)
    ['0']
"""

from __future__ import annotations

from torch import nn

__all__ = ["compiled_parts", "runs_compiled"]

_STEP_METHODS = ("forward", "training_step")


def compiled_parts(module: nn.Module) -> list[str]:
    """Names of the submodules that run compiled (``""``: the module itself).

    A submodule counts when it is a ``torch.compile(module)`` wrapper, was compiled in place with
    ``module.compile()``, or has a compiled ``forward``/``training_step`` set on the instance (as Lightning
    does for a compiled LightningModule passed to ``Trainer.fit``). A compiled function called from a
    ``forward`` cannot be seen from outside and is not listed.
    """
    from torch._dynamo.eval_frame import OptimizedModule

    names = []
    for name, m in module.named_modules():
        steps = (vars(m).get(method) for method in _STEP_METHODS)
        if (isinstance(m, OptimizedModule) or getattr(m, "_compiled_call_impl", None) is not None
                or any(hasattr(step, "_torchdynamo_orig_callable") for step in steps)):
            names.append(name)
    return names


def runs_compiled(module: nn.Module) -> bool:
    """Whether ``torch.compile`` runs (part of) ``module``'s step: :func:`compiled_parts` is not empty."""
    return bool(compiled_parts(module))
