"""The ``optimizer_8bit`` lever: Adam/AdamW's two moments in 8 bits (bitsandbytes' ``AdamW8bit``,
:class:`~lightning_memkit.callbacks.Optimizer8bit`): about a quarter of their bytes. It changes the numerics, so
``MemoryBudget`` and ``memkit estimate --budget`` pull it only when ``allow`` (``--allow``) names it.

    >>> from lightning_memkit.estimate.levers.optimizer_8bit import OPTIMIZER_8BIT
    >>> OPTIMIZER_8BIT.takes("AdamW"), OPTIMIZER_8BIT.takes("SGD"), OPTIMIZER_8BIT.keeps_math
    (True, False, False)
"""

from __future__ import annotations

from typing import Any

from lightning_memkit.estimate.levers.optimizer_state import OptimizerStateLever

__all__ = ["OPTIMIZER_8BIT", "Optimizer8bitLever"]


class Optimizer8bitLever(OptimizerStateLever):
    name, kind, keeps_math, opt_in = "optimizer_8bit", "free", False, True
    callback = "lightning_memkit.callbacks.Optimizer8bit"
    label = "8-bit AdamW state"
    accepts = ("Adam", "AdamW")

    def wrap(self, factory: Any) -> Any:
        from lightning_memkit.optim.eight_bit import eight_bit

        return eight_bit(factory)


OPTIMIZER_8BIT = Optimizer8bitLever()
