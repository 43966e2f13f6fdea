"""Resume (or validate, test, predict from) a checkpoint of a run trained with ``NoSaveBitsandbytesPrecision``.

Lightning restores a checkpoint's weights before the precision plugin converts the model, so the packed
weights, their quant state and the LoRA adapters of a QLoRA checkpoint would meet unconverted ``nn.Linear``
layers. :class:`QuantizedResume` asks the plugin to convert the model first whenever a converted state dict is
loaded into it (:meth:`~lightning_memkit.plugins.nosave_bitsandbytes.NoSaveBitsandbytesPrecision.convert_on_load`);
the layers then restore each packed weight bit for bit. It does nothing in a Trainer without that plugin.

Every ``Trainer`` gets it through Lightning's ``lightning.pytorch.callbacks_factory`` entry point (the package
registers :func:`callbacks_factory`), so ``trainer.fit(model, ckpt_path="last")`` needs no extra object.

Example::

    >>> from lightning.pytorch import Trainer
    >>> trainer = Trainer(accelerator="cpu", logger=False, enable_checkpointing=False)
    >>> any(isinstance(cb, QuantizedResume) for cb in trainer.callbacks)
    True
"""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

__all__ = ["QuantizedResume", "callbacks_factory"]


class QuantizedResume(Callback):
    """Converts the model before a ``NoSaveBitsandbytesPrecision`` checkpoint is loaded into it (see the module)."""

    def __init__(self) -> None:
        self._handle = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        from lightning_memkit.plugins.nosave_bitsandbytes import NoSaveBitsandbytesPrecision

        plugin = trainer.precision_plugin
        if isinstance(plugin, NoSaveBitsandbytesPrecision) and self._handle is None:
            self._handle = plugin.convert_on_load(pl_module)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None


def callbacks_factory() -> list[Callback]:
    """Lightning's entry point: one :class:`QuantizedResume` per ``Trainer``."""
    return [QuantizedResume()]
