"""lightning_memkit: Lightning callbacks, a precision plugin and a pipeline strategy that cut peak memory.

Importing the package registers ``strategy="memkit_pipeline"`` with Lightning (once).
"""

from lightning_memkit.memory import LivePeak

__version__ = "0.1.0"
__all__ = ["LivePeak", "__version__"]


def _register_pipeline_strategy() -> None:
    """Make ``Trainer(strategy="memkit_pipeline")`` resolve; a no-op when already registered or without Lightning."""
    try:
        from lightning.pytorch.strategies import StrategyRegistry

        from lightning_memkit.strategies.pipeline import MemkitPipelineStrategy
    except ImportError:  # Lightning missing: the pure-torch core still works
        return
    MemkitPipelineStrategy.register_strategies(StrategyRegistry)


_register_pipeline_strategy()
