"""Predicting a training step's peak memory on fake tensors (nothing allocated), and searching the feature plans
that fit a byte budget: a library (the ``memkit estimate`` command is a thin layer over it).

Its names are imported on first access (PEP 562), so importing one of its modules (``estimate.step``, pure
torch) does not import the config readers, which need Lightning.
"""

from __future__ import annotations

from lightning_memkit.common.lazy import lazy_exports

_HOMES = {
    "MemoryEstimate": ".step", "PhaseEstimate": ".step", "estimate_training_memory": ".step",
    "estimate_from_hf_config": ".hf", "estimate_hf_pipeline": ".hf", "PipelineEstimate": ".hf",
    "estimate_from_config": ".config", "estimate_parsed_config": ".config",
    "search_plans": ".plans", "HFRun": ".hf_run", "ConfigRun": ".config_run", "ModuleRun": ".module",
    "Plan": ".levers", "LEVERS": ".levers", "Lever": ".levers", "Run": ".runs",
    "InputWarning": ".inputs", "read_hf_config": ".inputs",
}
__all__ = sorted(_HOMES)
__getattr__, __dir__ = lazy_exports(__name__, _HOMES, globals())

