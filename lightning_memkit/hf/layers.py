"""Which submodules of a model are Hugging Face decoder layers, the KV-cache switch of its configs, and the functions
its family's modeling module defines.

Both look at ``transformers`` only if it is already imported: a model that holds transformers modules
has imported it, so a model without any costs nothing.

Example::

    >>> from lightning_memkit.demo.hf_models import tiny_hf_causal_lm
    >>> from lightning_memkit.hf.layers import decoder_layers, kv_cache_off
    >>> model = tiny_hf_causal_lm("llama", num_layers=3)
    >>> [name for name, _ in decoder_layers(model)]
    ['model.layers.0', 'model.layers.1', 'model.layers.2']
    >>> with kv_cache_off(model) as configs:
    ...     model.config.use_cache, len(configs)
    (False, 1)
    >>> model.config.use_cache
    True
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

from torch import nn

__all__ = ["decoder_layers", "kv_cache_configs", "kv_cache_off", "modeling_function"]


def decoder_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every ``transformers`` ``GradientCheckpointingLayer`` in ``model``, outermost only.

    All HF decoder layers derive from that class. Empty when transformers is not imported or has no such
    class (older versions), or when the model holds none.
    """
    layers_mod = sys.modules.get("transformers.modeling_layers")
    if layers_mod is None and "transformers" in sys.modules:
        with contextlib.suppress(ImportError):
            import transformers.modeling_layers as layers_mod
    base = getattr(layers_mod, "GradientCheckpointingLayer", None)
    if base is None:
        return []
    found: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if isinstance(module, base) and not any(name.startswith(outer + ".") for outer, _ in found):
            found.append((name, module))
    return found


def kv_cache_configs(model: nn.Module) -> list[Any]:
    """The distinct ``transformers`` configs in ``model`` whose ``use_cache`` is on (shared configs once)."""
    if "transformers" not in sys.modules:
        return []
    from transformers import PretrainedConfig

    configs: dict[int, Any] = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if isinstance(config, PretrainedConfig):
            for cfg in (config, *(getattr(config, key, None) for key in config.sub_configs)):
                if isinstance(cfg, PretrainedConfig) and getattr(cfg, "use_cache", False):
                    configs[id(cfg)] = cfg
    return list(configs.values())


@contextlib.contextmanager
def kv_cache_off(model: nn.Module) -> Iterator[list[Any]]:
    """Set ``use_cache = False`` on every config of ``model`` that has it on; restore on exit (errors included).

    Yields the configs it switched off. Training keeps no KV cache: with it on, each layer's keys and values
    stay alive in the cache object for the whole step, recomputed layers included.
    """
    configs = kv_cache_configs(model)
    try:
        for cfg in configs:
            cfg.use_cache = False
        yield configs
    finally:
        for cfg in configs:
            cfg.use_cache = True


def modeling_function(model: nn.Module, name: str) -> Any:
    """The function ``name`` of ``model``'s modeling module (``load_balancing_loss_func``: the family's router aux
    loss), or ``None``: looked up along the class's bases, since a wrapper may subclass the model's class in a module
    of its own (FSDP2's ``fully_shard`` does).

    >>> from lightning_memkit.demo.hf_models import tiny_hf_causal_lm
    >>> from lightning_memkit.hf.layers import modeling_function
    >>> modeling_function(tiny_hf_causal_lm("qwen3_moe", num_layers=1), "load_balancing_loss_func").__name__
    'load_balancing_loss_func'
    """
    for cls in type(model).__mro__:
        found = getattr(sys.modules.get(cls.__module__), name, None)
        if found is not None:
            return found
    return None
