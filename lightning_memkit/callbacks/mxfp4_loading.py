"""Lightning callback: stream an MXFP4 safetensors checkpoint into the model when the run starts."""

from __future__ import annotations

import logging
import os

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

from lightning_memkit.loading.safetensors_loader import LoadResult, load_mxfp4_into
from lightning_memkit.validation import check_bool, check_int

__all__ = ["MXFP4CheckpointLoader"]

log = logging.getLogger("lightning_memkit")


class MXFP4CheckpointLoader(Callback):
    """Load ``path`` into the LightningModule (or one of its submodules) with :func:`load_mxfp4_into`.

    Loads once, at the start of the first stage (``on_fit_start``, or ``on_{validation,test,predict}_start``
    for those entry points): after ``configure_model`` built the model and the strategy moved it to its
    device, so MXFP4 weights are dequantized chunk by chunk straight into the device parameters, in place
    (optimizers created by then keep their references). Skipped when the run resumes from a Lightning
    checkpoint (``ckpt_path``), whose weights win. The model must be materialized by then; to load into a
    meta-device model, call ``load_mxfp4_into(self, path, device=...)`` at the end of ``configure_model``.

    Args:
        path: a ``.safetensors`` file or a directory of shards (with or without an index json).
        submodule: attribute path of the module to load into (``"model"`` for ``self.model``); ``""`` is the
            LightningModule itself.
        strict: every checkpoint entry must map to a module tensor and the reverse.
        rows_per_chunk: packed rows dequantized per chunk (default: automatic, bounded).
        progress: show a rich progress bar on rank 0.

    Example::

        Trainer(callbacks=[MXFP4CheckpointLoader("gpt-oss-20b/", submodule="model")]).fit(model)

    or in LightningCLI YAML::

        trainer:
          callbacks:
            - class_path: lightning_memkit.callbacks.MXFP4CheckpointLoader
              init_args: {path: gpt-oss-20b/, submodule: model, progress: true}
    """

    def __init__(
        self,
        path: str,
        submodule: str = "",
        strict: bool = True,
        rows_per_chunk: int | None = None,
        progress: bool = False,
    ):
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
        if not os.path.exists(path):
            raise ValueError(f"path={str(path)!r} does not exist; expected a .safetensors file or a directory")
        if not isinstance(submodule, str):
            raise TypeError(f"submodule must be a str attribute path such as 'model', got {type(submodule).__name__}")
        check_int(rows_per_chunk, "rows_per_chunk", minimum=1, allow_none=True, owner="MXFP4CheckpointLoader")
        check_bool(strict, "strict", owner="MXFP4CheckpointLoader")
        check_bool(progress, "progress", owner="MXFP4CheckpointLoader")
        self.path = os.fspath(path)
        self.submodule = submodule
        self.strict = strict
        self.rows_per_chunk = rows_per_chunk
        self.progress = progress
        self.result: LoadResult | None = None
        self._done = False

    def _load(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._done:
            return
        self._done = True
        if trainer.ckpt_path:
            log.info("MXFP4CheckpointLoader: resuming from %s, %s not loaded", trainer.ckpt_path, self.path)
            return
        try:
            target = pl_module.get_submodule(self.submodule) if self.submodule else pl_module
        except AttributeError as err:
            raise ValueError(f"submodule={self.submodule!r} is not a submodule of "
                             f"{type(pl_module).__name__} ({err})") from err
        self.result = load_mxfp4_into(target, self.path, strict=self.strict, rows_per_chunk=self.rows_per_chunk,
                                      progress=self.progress and trainer.is_global_zero)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._load(trainer, pl_module)

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._load(trainer, pl_module)

    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._load(trainer, pl_module)

    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._load(trainer, pl_module)
