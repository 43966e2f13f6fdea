"""Compute the HF causal-LM loss without materializing the logits, for the whole of ``fit``.

Example::

    from lightning import Trainer
    from lightning_memkit.callbacks import FusedLinearCrossEntropy

    trainer = Trainer(callbacks=[FusedLinearCrossEntropy()])
    trainer.fit(module)   # module (or an attribute of it) is a transformers causal LM called with labels

YAML (LightningCLI)::

    trainer:
      callbacks:
        - class_path: lightning_memkit.callbacks.FusedLinearCrossEntropy
          init_args: {chunk_size: auto}
"""

from __future__ import annotations

import contextlib
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback

from lightning_memkit.common.validation import check_choice, check_int
from lightning_memkit.hf.fused_loss import find_causal_lms
from lightning_memkit.hf.peft_models import head_parts

__all__ = ["FusedLinearCrossEntropy"]


class FusedLinearCrossEntropy(Callback):
    """Applies :func:`~lightning_memkit.hf.fused_linear_cross_entropy` from ``on_fit_start`` to ``on_fit_end``.

    The HF model is the LightningModule itself if it is a ``PreTrainedModel``, else each of its direct
    child modules that is a ``PreTrainedModel`` with an ``lm_head``, or a peft model around one (the causal
    LM inside is patched; a LoRA adapter on ``lm_head`` joins the fused head). Calls with ``labels`` then
    return ``logits=None``; calls without ``labels`` are unchanged.

    Args:
        chunk_size: tokens per chunk, or ``"auto"``.
        backend: ``"auto"``, ``"torch"`` or ``"triton"``.
    """

    def __init__(self, chunk_size: int | str = "auto", backend: str = "auto") -> None:
        self.chunk_size = check_int(chunk_size, "chunk_size", minimum=1, also=("auto",),
                                    owner="FusedLinearCrossEntropy")
        self.backend = check_choice(backend, "backend", ("auto", "torch", "triton"), owner="FusedLinearCrossEntropy")
        self._stack: contextlib.ExitStack | None = None
        self.fused_calls = 0
        self.logits_bytes_avoided = 0
        self.max_logits_bytes = 0

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        from lightning_memkit.hf import fused_linear_cross_entropy

        self._exit()
        models = find_causal_lms(pl_module)
        stack = contextlib.ExitStack()
        self.fused_calls = self.logits_bytes_avoided = self.max_logits_bytes = 0
        try:
            for model in models:
                stack.enter_context(fused_linear_cross_entropy(model, chunk_size=self.chunk_size,
                                                               backend=self.backend))
                stack.callback(model.register_forward_hook(self._count, with_kwargs=True).remove)
        except BaseException:
            stack.close()
            raise
        self._stack = stack

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

    def memory_effect(self) -> str:
        """One line: the logits bytes the fused loss did not materialize (tokens x vocab in the head's dtype)."""
        if not self.fused_calls:
            return "FusedLinearCrossEntropy: no forward call with labels ran fused during this fit"
        return (f"FusedLinearCrossEntropy: logits not materialized in {self.fused_calls} forward calls, "
                f"{self.max_logits_bytes:,} bytes per call at most ({self.logits_bytes_avoided:,} bytes in all; "
                "tokens x vocab x the lm_head's element size)")

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._exit()

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._exit()

    def _exit(self) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.close()
