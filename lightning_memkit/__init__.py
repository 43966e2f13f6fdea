"""lightning_memkit: Lightning callbacks, a precision plugin and a pipeline strategy that cut peak memory.

The public names below are imported on first access (PEP 562), so ``import lightning_memkit`` and the
pure-torch subpackages (``lightning_memkit.ops``, ``lightning_memkit.memory``) never import Lightning.

``strategy="memkit_pipeline"`` and ``strategy="memkit_fsdp2"`` are registered with Lightning's
``StrategyRegistry`` (factories that import a strategy when a Trainer asks for it) whichever of this package and
``lightning.pytorch`` is imported first: at once if Lightning is already imported, else right after
``lightning.pytorch`` finishes importing (a one-shot import hook that leaves ``sys.meta_path`` at that import and
gives the module its own loader back), and by every part of the package that imports Lightning
(``lightning_memkit.callbacks``, ``.plugins``, ``.strategies``, ``memkit``'s configs). Importing the package, or its
pure-torch parts, never imports Lightning.

Example::

    >>> import lightning_memkit
    >>> "cross_entropy" in dir(lightning_memkit)
    True
    >>> lightning_memkit.cross_entropy.__module__  # imported here, on first access
    'lightning_memkit.ops.cross_entropy'
"""

from __future__ import annotations

import functools
import importlib.abc
import sys
from typing import Any

from lightning_memkit.common.bitsandbytes_log import drop_cpu_kernel_notice
from lightning_memkit.common.lazy import lazy_exports

__version__ = "0.1.0"

drop_cpu_kernel_notice()  # bitsandbytes' import-time notice about an optional CPU kernel, on every import

_HOMES: dict[str, tuple[str, ...]] = {
    "lightning_memkit.loading": ("dequantize_mxfp4", "load_mxfp4_into", "stream_dequantize"),
    "lightning_memkit.memory": (
        "DeferredFree",
        "LivePeak",
        "SavedTensorReport",
        "active_device_index",
        "device_total_memory",
        "effective_device_memory",
        "empty_device_cache",
        "estimate_training_memory",
        "find_referrers",
        "free_device_memory",
        "guard_allocator_warmup",
        "profile_saved_tensors",
        "release_optimizer_state",
        "release_storage",
        "warmup_decision",
    ),
    "lightning_memkit.ops": ("cross_entropy", "linear_cross_entropy", "lm_head_loss", "padded_index_gather"),
    "lightning_memkit.pipeline": ("LayerCost", "Partition", "partition_layers"),
    # the Lightning adapters: importing any of these imports lightning.pytorch
    "lightning_memkit.callbacks": (
        "ActivationCheckpointing",
        "ActivationOffloading",
        "AllocatorWarmupGuard",
        "MemoryBudget",
        "MicroBatchSplit",
        "OffloadOptimizer",
        "Optimizer8bit",
        "OptimizerInBackward",
        "PeakMemoryMonitor",
        "PhaseMemoryRelease",
        "SavedTensorProfiler",
        "StageBoundaryRelease",
    ),
    "lightning_memkit.plugins": ("NoSaveBitsandbytesPrecision",),
    "lightning_memkit.strategies": ("MemkitFSDP2Strategy", "MemkitPipelineStrategy"),
}
_LAZY: dict[str, str] = {name: module for module, names in _HOMES.items() for name in names}

__all__ = sorted(["__version__", "register_pipeline_strategy", *_LAZY])

def _registered(name: str) -> None:
    if any(path.endswith(f".{name}") for path, _ in _STRATEGIES.values()):
        register_pipeline_strategy()


__getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals(), after=_registered)


def register_pipeline_strategy() -> None:
    """Register the package's strategies in Lightning's ``StrategyRegistry``: ``"memkit_pipeline"`` and
    ``"memkit_fsdp2"`` (idempotent; a strategy's module is imported when a Trainer asks for it).

    Example::

        >>> from lightning_memkit import register_pipeline_strategy
        >>> register_pipeline_strategy()
        >>> from lightning.pytorch.strategies import StrategyRegistry
        >>> "memkit_pipeline" in StrategyRegistry, "memkit_fsdp2" in StrategyRegistry
        (True, True)
    """
    from lightning.pytorch.strategies import StrategyRegistry

    for name, (path, description) in _STRATEGIES.items():
        if name not in StrategyRegistry:
            StrategyRegistry.register(name, functools.partial(_strategy, path), description=description)


#: the strategies by the name a Trainer takes: their class path (imported when a Trainer asks for one) and the
#: description Lightning's registry shows
_STRATEGIES = {
    "memkit_pipeline": ("lightning_memkit.strategies.pipeline.MemkitPipelineStrategy",
                        "Pipeline parallelism with memory-balanced stages (lightning_memkit)"),
    "memkit_fsdp2": ("lightning_memkit.strategies.fsdp2.MemkitFSDP2Strategy",
                     "FSDP2 over every rank, each repeated block one unit (lightning_memkit)"),
}


def _strategy(path: str, **kwargs: Any) -> Any:
    from lightning_memkit.common.class_paths import import_object

    return import_object(path)(**kwargs)


class _RegisterAfterImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """One-shot ``sys.meta_path`` hook: once ``lightning.pytorch`` has executed, register the strategy.

    It leaves ``sys.meta_path`` as soon as ``lightning.pytorch`` is looked up, finds its spec with the other finders,
    stands in as its loader for the one ``exec_module`` call and gives the module its own loader back.
    """

    target = "lightning.pytorch"

    def __init__(self) -> None:
        self._loader: Any = None

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != self.target or self._loader is not None:
            return None
        self.uninstall()
        for finder in list(sys.meta_path):
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec  # not a loader that can be stood in for: the import goes on as it would
        self._loader, spec.loader = spec.loader, self
        return spec

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        loader = self._loader
        module.__loader__ = module.__spec__.loader = loader  # the module keeps its own loader
        loader.exec_module(module)
        register_pipeline_strategy()

    def uninstall(self) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)


if "lightning.pytorch" in sys.modules:
    register_pipeline_strategy()
elif not any(type(f).__name__ == "_RegisterAfterImport" for f in sys.meta_path):  # one hook per interpreter
    sys.meta_path.insert(0, _RegisterAfterImport())
