"""Compute each decoder layer's MLP in tiles of tokens for the whole fit
(:func:`~lightning_memkit.recompute.tiled_mlp.tiled_mlps`): its ``tokens x intermediate`` activations never exist for
the whole sequence, in forward or in backward; the same losses and, to float32 rounding, the same gradients.

Example::

    from lightning import Trainer
    from lightning_memkit.callbacks import ActivationCheckpointing, TiledMLP

    trainer = Trainer(callbacks=[ActivationCheckpointing(), TiledMLP(tile_tokens=4096)])

YAML (LightningCLI)::

    trainer:
      callbacks:
        - class_path: lightning_memkit.callbacks.TiledMLP
          init_args: {tile_tokens: auto}
"""

from __future__ import annotations

import contextlib

from lightning.pytorch import LightningModule, Trainer

from lightning_memkit.callbacks.fit_scoped import FitScopedCallback
from lightning_memkit.common.validation import check_int

__all__ = ["TiledMLP"]

_OWNER = "TiledMLP"


class TiledMLP(FitScopedCallback):
    """Tiles the MLPs of the module's decoder layers (dense MLPs over every token, a mixture-of-experts block's
    experts over the tokens routed to them) from ``on_fit_start`` to the fit's teardown.

    Args:
        tile_tokens: tokens per tile, or ``"auto"``: the model's hidden size
            (:func:`~lightning_memkit.recompute.tiled_mlp.default_tile_tokens`).

    Attributes:
        tiled: the names of the modules tiled in the current fit; ``tokens``: the tile size used.
    """

    def __init__(self, tile_tokens: int | str = "auto") -> None:
        self.tile_tokens = check_int(tile_tokens, "tile_tokens", minimum=1, also=("auto",), owner=_OWNER)
        self.tiled: list[str] = []
        self.tokens = 0
        self._stack: contextlib.ExitStack | None = None

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        from lightning_memkit.recompute.tiled_mlp import default_tile_tokens, tiled_mlps

        self._restore()
        self.tokens = default_tile_tokens(pl_module) if self.tile_tokens == "auto" else self.tile_tokens
        stack = contextlib.ExitStack()
        try:
            self.tiled = stack.enter_context(tiled_mlps(pl_module, self.tokens))
        except ValueError as err:
            raise ValueError(f"{_OWNER}: {err}") from None
        self._stack = stack

    def _restore(self) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.close()
