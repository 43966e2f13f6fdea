"""Compute the HF causal-LM loss without materializing the logits, in every loop: fit, validate, test, predict.

Whenever a step calls the causal LM with ``labels`` — training and fit's validation (sanity check included),
``trainer.validate``, ``trainer.test`` and ``trainer.predict`` — the loss is computed without the
``(B, T, V)`` logits, and the output's ``logits`` are ``None``. Calls without ``labels`` return the logits
as usual.

Example::

    from lightning import Trainer
    from lightning_memkit.callbacks import FusedLinearCrossEntropy

    trainer = Trainer(callbacks=[FusedLinearCrossEntropy()])
    trainer.fit(module)        # module (or an attribute of it) is a transformers causal LM called with labels
    trainer.validate(module)   # fused as well: no validation memory spike from the logits

YAML (LightningCLI)::

    trainer:
      callbacks:
        - class_path: lightning_memkit.callbacks.FusedLinearCrossEntropy
          init_args: {chunk_size: auto, logits_dtype: head, token_accuracy: true}
"""

from __future__ import annotations

import contextlib
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback

from lightning_memkit.common.validation import check_bool, check_choice, check_int
from lightning_memkit.hf.fused_loss import LOGITS_DTYPES, find_causal_lms
from lightning_memkit.hf.peft_models import head_parts

__all__ = ["FusedLinearCrossEntropy"]


class FusedLinearCrossEntropy(Callback):
    """Applies :func:`~lightning_memkit.hf.fused_linear_cross_entropy` in fit, validate, test and predict.

    Entered at the start of each top-level loop (``on_fit_start``, ``on_validation_start``, ``on_test_start``,
    ``on_predict_start``) and left at its end (the matching ``on_*_end``; ``on_exception`` and ``teardown`` as
    safety nets). Inside ``fit`` one entry covers training and fit's own validation loop (sanity check
    included): the validation hooks neither enter again nor leave.

    The HF model is the LightningModule itself if it is a ``PreTrainedModel``, else each of its direct
    child modules that is a ``PreTrainedModel`` with an ``lm_head``, or a peft model around one (the causal
    LM inside is patched; a LoRA adapter on ``lm_head`` joins the fused head). Calls with ``labels`` then
    return ``logits=None`` whichever loop runs them; calls without ``labels`` are unchanged (``predict``
    without labels still returns the logits).

    ``fused_calls``, ``logits_bytes_avoided`` and ``max_logits_bytes`` count the fused calls since the current
    (or last) loop started; they restart with each new top-level loop.

    Args:
        chunk_size: tokens per chunk, or ``"auto"``.
        backend: ``"auto"``, ``"torch"`` or ``"triton"``.
        logits_dtype: ``"head"`` (default): transformers' numerics (the logits rounded to a bf16/fp16 head's dtype,
            a float32 loss: the losses of the run without the callback, to float32 rounding); ``"float32"``:
            float32 logits, more exact but other numbers. See :func:`~lightning_memkit.hf.fused_linear_cross_entropy`.
        token_accuracy: log the token accuracy (the logits' argmax against the shifted labels, computed without
            logits) as ``train_token_accuracy``, ``val_token_accuracy`` or ``test_token_accuracy``; the last
            value is also ``last_token_accuracy`` (predict included) and each output's ``token_accuracy``.
    """

    def __init__(self, chunk_size: int | str = "auto", backend: str = "auto", logits_dtype: str = "head",
                 token_accuracy: bool = False) -> None:
        self.chunk_size = check_int(chunk_size, "chunk_size", minimum=1, also=("auto",),
                                    owner="FusedLinearCrossEntropy")
        self.backend = check_choice(backend, "backend", ("auto", "torch", "triton"), owner="FusedLinearCrossEntropy")
        self.logits_dtype = check_choice(logits_dtype, "logits_dtype", LOGITS_DTYPES,
                                         owner="FusedLinearCrossEntropy")
        self.token_accuracy = check_bool(token_accuracy, "token_accuracy", owner="FusedLinearCrossEntropy")
        self.last_token_accuracy: Any = None  # a 0-dim float32 tensor once a fused call reported one
        self._trainer: Trainer | None = None
        self._module: LightningModule | None = None
        self._stack: contextlib.ExitStack | None = None
        self._loop: str | None = None  # the top-level loop last entered ("fit", "validate", ...): the counters' loop
        self.fused_calls = 0
        self.logits_bytes_avoided = 0
        self.max_logits_bytes = 0

    # -- entering and leaving --------------------------------------------------------------------
    def _enter(self, loop: str, trainer: Trainer, pl_module: LightningModule) -> None:
        """Leave any open entry, then patch the causal LMs of ``pl_module`` for ``loop`` (counters restart)."""
        from lightning_memkit.hf import fused_linear_cross_entropy

        self._exit()
        models = find_causal_lms(pl_module)
        stack = contextlib.ExitStack()
        self.fused_calls = self.logits_bytes_avoided = self.max_logits_bytes = 0
        self._loop = loop
        self._trainer, self._module = trainer, pl_module
        try:
            for model in models:
                stack.enter_context(fused_linear_cross_entropy(
                    model, chunk_size=self.chunk_size, backend=self.backend, logits_dtype=self.logits_dtype,
                    token_accuracy=self.token_accuracy))
                stack.callback(model.register_forward_hook(self._count, with_kwargs=True).remove)
        except BaseException:
            stack.close()
            raise
        self._stack = stack

    def _leave(self, loop: str) -> None:
        """Leave the open entry if ``loop`` entered it (fit's validation does not leave fit's entry)."""
        if self._loop == loop:
            self._exit()

    def _inside_fit(self, trainer: Trainer | None) -> bool:
        """Whether a validation loop runs inside ``fit`` (sanity check or fit's validation): fit's entry covers it."""
        if self._stack is None or self._loop != "fit":
            return False
        fn = getattr(getattr(trainer, "state", None), "fn", None)
        return fn is None or fn == "fit"  # TrainerFn is a str enum; fn is None when called outside a Trainer run

    def _exit(self) -> None:
        stack, self._stack = self._stack, None
        self._trainer = self._module = None
        if stack is not None:
            stack.close()

    # -- counting ---------------------------------------------------------------------------------
    def _count(self, model: Any, args: tuple, kwargs: dict, output: Any) -> None:
        """After a fused call (``logits`` is ``None``): add the bytes the logits would have taken."""
        labels = kwargs.get("labels")
        if labels is None or getattr(output, "logits", 0) is not None:
            return
        keep = kwargs.get("logits_to_keep", 0)
        if not isinstance(keep, int):
            return  # index tensors: the logits' rows are not known here
        tokens = labels.numel() if keep == 0 else labels.shape[0] * keep
        head = head_parts(model.lm_head).weight
        nbytes = tokens * head.shape[0] * head.element_size()
        self.fused_calls += 1
        self.logits_bytes_avoided += nbytes
        self.max_logits_bytes = max(self.max_logits_bytes, nbytes)
        accuracy = getattr(output, "token_accuracy", None)
        if accuracy is not None:
            self._log_accuracy(accuracy.detach(), labels.shape[0])

    def _log_accuracy(self, accuracy, batch_size: int) -> None:
        """Keep the accuracy and log it under the running loop's name (Lightning logs nothing in predict)."""
        self.last_token_accuracy = accuracy
        trainer = self._trainer
        if trainer is None or self._module is None:
            return
        prefix = "train" if trainer.training else "val" if (trainer.validating or trainer.sanity_checking) else \
            "test" if trainer.testing else None
        if prefix is not None:
            self._module.log(f"{prefix}_token_accuracy", accuracy, batch_size=batch_size)

    def memory_effect(self) -> str:
        """One line: the logits bytes the fused loss did not materialize (tokens x vocab in the head's dtype) in
        the current (or last) top-level loop."""
        loop = self._loop or "run"
        if not self.fused_calls:
            return f"FusedLinearCrossEntropy: no forward call with labels ran fused during this {loop}"
        return (f"FusedLinearCrossEntropy: logits not materialized in {self.fused_calls} forward calls during "
                f"{loop}, {self.max_logits_bytes:,} bytes per call at most ({self.logits_bytes_avoided:,} bytes in "
                "all; tokens x vocab x the lm_head's element size)")

    # -- Lightning hooks --------------------------------------------------------------------------
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._enter("fit", trainer, pl_module)

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._exit()

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self._inside_fit(trainer):
            self._enter("validate", trainer, pl_module)

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._leave("validate")

    def on_test_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._enter("test", trainer, pl_module)

    def on_test_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._leave("test")

    def on_predict_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._enter("predict", trainer, pl_module)

    def on_predict_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._leave("predict")

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._exit()  # Lightning does not call the callbacks' teardown when a run raises

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._exit()
