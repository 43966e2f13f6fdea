"""What Lightning backpropagates from a ``training_step`` output: one home for reading the loss out of it.

Example::

    import torch
    from lightning_memkit.common.step_output import training_loss

    loss = torch.tensor(2.0)
    assert training_loss({"loss": loss, "logits": None}) is loss
    assert training_loss(loss) is loss
    assert training_loss({"logits": None}) is None
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["training_loss"]


def training_loss(output: Any) -> Any:
    """The loss of a ``training_step`` output, as Lightning takes it: its ``"loss"`` when it is a mapping (``None``
    without one), else the output itself. Callers check that it is the tensor they need."""
    if isinstance(output, Mapping):
        return output.get("loss")
    return output
