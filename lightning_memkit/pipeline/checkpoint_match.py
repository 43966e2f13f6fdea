"""Whether a pipeline checkpoint's shard fits the model it is about to load into, said in one line.

Checked before anything is loaded, in this order: the number of pipeline layers (the manifest's stage sizes
against the model's layers), then the first entry, in the model's order, whose shape differs, then entries
the model does not have. Pure: the caller shares the answer between ranks.

Example::

    >>> import torch
    >>> from lightning_memkit.pipeline.checkpoint_match import model_mismatch
    >>> model = {"embed.weight": torch.zeros(10, 4), "head.weight": torch.zeros(10, 4)}
    >>> shard = {"embed.weight": torch.zeros(10, 8)}
    >>> model_mismatch({"sizes": [2, 1]}, shard, model, num_layers=3)
    "'embed.weight' has shape (10, 8) in the checkpoint and (10, 4) in this model"
    >>> model_mismatch({"sizes": [4, 3]}, shard, model, num_layers=8)
    'it holds a model of 7 pipeline layers (stages of [4, 3]); this model has 8'
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["model_mismatch"]


def _shape(value: Any) -> tuple[int, ...] | None:
    return tuple(value.shape) if torch.is_tensor(value) else None


def model_mismatch(meta: Mapping[str, Any], state_dict: Mapping[str, Any], model_state: Mapping[str, Any],
                   num_layers: int) -> str | None:
    """What keeps ``state_dict`` (one shard's) from loading into a model of ``num_layers`` pipeline layers whose
    state dict is ``model_state``, or ``None``. ``meta`` is the manifest's ``meta`` (its ``sizes``)."""
    sizes = meta.get("sizes")
    if isinstance(sizes, list) and sum(sizes) != num_layers:
        return f"it holds a model of {sum(sizes)} pipeline layers (stages of {sizes}); this model has {num_layers}"
    for key, value in model_state.items():
        if key in state_dict and _shape(state_dict[key]) != _shape(value):
            return (f"{key!r} has shape {_shape(state_dict[key])} in the checkpoint and {_shape(value)} in this "
                    "model")
    unexpected = [key for key in state_dict if key not in model_state]
    if unexpected:
        more = f" and {len(unexpected) - 3} more" if len(unexpected) > 3 else ""
        return f"it holds entries this model does not have: {', '.join(unexpected[:3])}{more}"
    return None
