"""Lightning callback: stream an MXFP4 safetensors checkpoint into the model when the run starts."""

from __future__ import annotations

import logging
import os

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

from lightning_memkit.common.progress import progress_enabled
from lightning_memkit.common.validation import check_bool, check_int
from lightning_memkit.loading.meta_buffers import meta_tensor_names
from lightning_memkit.loading.safetensors_loader import LoadResult, load_mxfp4_into
from lightning_memkit.measure.storage import format_bytes

__all__ = ["MXFP4CheckpointLoader"]

log = logging.getLogger("lightning_memkit")


class MXFP4CheckpointLoader(Callback):
    """Load ``path`` into the LightningModule (or one of its submodules) with :func:`load_mxfp4_into`.

    Loads once, at the start of the first stage (``on_fit_start``, or ``on_{validation,test,predict}_start``
    for those entry points): after ``configure_model`` built the model and the strategy moved it to its
    device, so MXFP4 weights are dequantized chunk by chunk straight into the device parameters, in place
    (optimizers created by then keep their references). Skipped when the run resumes from a Lightning
    checkpoint (``ckpt_path``), whose weights win.

    A module that is on the meta device when the run is set up (built under ``torch.device("meta")`` in
    ``__init__``) is loaded in ``setup`` instead, before the strategy moves it: every tensor is created on
    the strategy's root device, and its non-persistent buffers are recomputed with
    :func:`~lightning_memkit.hf.meta_init.init_hf_buffers` when it holds a transformers model
    (``load_mxfp4_into``'s default; other modules with meta non-persistent buffers are refused by name). That
    load also runs when resuming, so the checkpoint's weights have real tensors to go into. A model built on
    meta in ``configure_model`` cannot wait for a callback (the strategy would move meta tensors): call
    ``load_mxfp4_into`` at the end of ``configure_model`` there. The host RSS peak and LivePeak bytes of the
    load are logged and kept in ``result.memory``.

    Args:
        path: a ``.safetensors`` file or a directory of shards (with or without an index json).
        submodule: attribute path of the module to load into (``"model"`` for ``self.model``); ``""`` is the
            LightningModule itself.
        strict: every checkpoint entry must map to a module tensor and the reverse.
        rows_per_chunk: packed rows dequantized per chunk (default: automatic, bounded).
        progress: log one info line per tensor loaded, on global rank 0 while the trainer's progress bar is on
            (:class:`~lightning_memkit.common.progress.WorkProgress`).
        measure: record the host RSS peak and LivePeak's tensor bytes of the load in ``result.memory``
            (``LivePeak``'s dispatch mode adds some tens of microseconds per op to the load).

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
        measure: bool = True,
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
        check_bool(measure, "measure", owner="MXFP4CheckpointLoader")
        self.path = os.fspath(path)
        self.submodule = submodule
        self.strict = strict
        self.rows_per_chunk = rows_per_chunk
        self.progress = progress
        self.measure = measure
        self.result: LoadResult | None = None
        self._done = False

    def _target(self, pl_module: pl.LightningModule):
        try:
            return pl_module.get_submodule(self.submodule) if self.submodule else pl_module
        except AttributeError as err:
            raise ValueError(f"submodule={self.submodule!r} is not a submodule of "
                             f"{type(pl_module).__name__} ({err})") from err

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._done:
            return
        try:
            target = self._target(pl_module)
        except ValueError:  # built later, in configure_model: loaded at the start of the stage
            return
        if meta_tensor_names(target):
            self._run_load(trainer, target, device=trainer.strategy.root_device)

    def _load(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._done:
            return
        if trainer.ckpt_path:
            self._done = True
            log.info("MXFP4CheckpointLoader: resuming from %s, %s not loaded", trainer.ckpt_path, self.path)
            return
        self._run_load(trainer, self._target(pl_module), device=None)

    def _run_load(self, trainer: pl.Trainer, target, device) -> None:
        self._done = True
        if trainer.ckpt_path:
            log.info("MXFP4CheckpointLoader: %s is on the meta device; loading %s to create its tensors before "
                     "the weights of %s replace them", type(target).__name__, self.path, trainer.ckpt_path)
        self.result = load_mxfp4_into(target, self.path, strict=self.strict, rows_per_chunk=self.rows_per_chunk,
                                      progress=self.progress and progress_enabled(trainer, require_terminal=False),
                                      device=device, measure=self.measure)
        if trainer.is_global_zero and self.result.memory is not None:
            log.info("MXFP4CheckpointLoader: %s: %s", self.path, self.result.memory)

    def memory_effect(self) -> str:
        """One line: what the load wrote and its measured peak (tensor storage and host RSS), in bytes."""
        result = self.result
        if result is None:
            why = "the run resumed from a Lightning checkpoint" if self._done else "no stage has started"
            return f"MXFP4CheckpointLoader: nothing loaded ({why})"
        line = (f"MXFP4CheckpointLoader: {len(result.loaded)} tensors loaded from {self.path} "
                f"({len(result.dequantized)} dequantized from MXFP4)")
        memory = result.memory
        if memory is None:
            return line + "; load peak not measured (measure=False)"
        rss = "" if memory.rss_peak_bytes is None else f", host RSS peak {memory.rss_peak_bytes:,} bytes"
        return (f"{line}; load peak: tensor storage {memory.tensor_peak_bytes:,} bytes "
                f"({format_bytes(memory.tensor_peak_bytes)}){rss}")

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._load(trainer, pl_module)

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._load(trainer, pl_module)

    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._load(trainer, pl_module)

    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._load(trainer, pl_module)
