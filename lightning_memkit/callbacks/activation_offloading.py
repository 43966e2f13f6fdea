"""Move what backward needs from the model's repeated blocks to host memory during fit (activation offload).

Example::

    from lightning import Trainer
    from lightning_memkit.callbacks import ActivationCheckpointing, ActivationOffloading

    Trainer(callbacks=[ActivationOffloading()])                             # every saved activation of the blocks
    Trainer(callbacks=[ActivationCheckpointing(), ActivationOffloading()])  # only the blocks' inputs (any order)

Before a fit::

    >>> ActivationOffloading(min_bytes=4096).memory_effect()
    'ActivationOffloading: no block offloaded'
    >>> ActivationOffloading(min_bytes=-1)
    Traceback (most recent call last):
    ...
    ValueError: ActivationOffloading(min_bytes=-1): must be an int >= 0
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch import LightningModule, Trainer

from lightning_memkit.callbacks.fit_scoped import FitScopedCallback
from lightning_memkit.common.validation import check_bool, check_int
from lightning_memkit.hf.layers import decoder_layers
from lightning_memkit.measure.storage import format_bytes
from lightning_memkit.offload.activations import OffloadHandle, offload_activations
from lightning_memkit.recompute.activation_recompute import PolicyLike, repeated_blocks, resolve_policy
from lightning_memkit.recompute.blocks import AUTO, choose_blocks

__all__ = ["ActivationOffloading"]

_OWNER = "ActivationOffloading"


class ActivationOffloading(FitScopedCallback):
    """Offload the tensors each chosen block saves for backward to host memory; they come back ahead of backward.

    ``policy`` picks the blocks as :class:`~lightning_memkit.callbacks.ActivationCheckpointing` does: ``"auto"``
    takes every Hugging Face decoder layer (peft-wrapped models too), else the blocks of the model's longest
    ``nn.ModuleList`` of same-class modules; or module classes / class paths, or a callable ``(name, module) ->
    bool``. At ``on_fit_start`` :func:`~lightning_memkit.offload.activations.offload_activations` hooks them
    (the model's parameters and buffers are never offloaded), at ``teardown`` and on an exception it unhooks them.
    Gradients are bitwise those without the callback. Alone, every activation a block saves goes to host memory;
    with ``ActivationCheckpointing`` (in either order in the callbacks list) a checkpointed block saves only its
    inputs, and those go. Validation and other ``no_grad`` loops are left alone. On CUDA the copies run on a side
    stream into pinned memory; ``prefetch`` brings the next block's tensors back while backward runs this one.

    Args:
        policy: ``"auto"``, module classes / class paths, or a callable ``(name, module) -> bool``.
        min_bytes: tensors smaller than this stay on the device (their copies would cost more than they save).
        prefetch: on CUDA, fetch the next block's tensors ahead of backward (else each when backward asks for it).

    Attributes:
        offloaded: names of the blocks hooked in the current (or last) fit.
        step_bytes, step_tensors: bytes and tensors moved to host memory in the last training batch.
        host_peak_bytes: the most bytes of offloaded tensors in host memory at once, over the batches of the fit.
    """

    def __init__(self, policy: PolicyLike = AUTO, min_bytes: int = 1024, prefetch: bool = True):
        if policy != AUTO:
            resolve_policy(policy)  # validates and imports class paths now
        check_int(min_bytes, "min_bytes", minimum=0, owner=_OWNER)
        check_bool(prefetch, "prefetch", owner=_OWNER)
        self.policy = policy
        self.min_bytes = min_bytes
        self.prefetch = prefetch
        self.offloaded: list[str] = []
        self.step_bytes: int | None = None
        self.step_tensors: int | None = None
        self.host_peak_bytes = 0
        self._handle: OffloadHandle | None = None

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        chosen = choose_blocks(pl_module, self.policy, owner=_OWNER, verb="offload",
                               finders=(decoder_layers, repeated_blocks))
        self._restore()
        self._handle = offload_activations(chosen, min_bytes=self.min_bytes, prefetch=self.prefetch, root=pl_module)
        self.offloaded = [name for name, _ in chosen]
        self.step_bytes = self.step_tensors = None
        self.host_peak_bytes = 0

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self._handle is not None:
            self._handle.reset_stats()

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._handle is None:
            return
        stats = self._handle.stats()
        self.step_bytes, self.step_tensors = stats.bytes, stats.tensors
        self.host_peak_bytes = max(self.host_peak_bytes, stats.host_peak_bytes)

    def memory_effect(self) -> str:
        """One line: the blocks, the bytes moved to host memory in the last batch, the host peak."""
        if not self.offloaded:
            return f"{_OWNER}: no block offloaded"
        shown = ", ".join(self.offloaded[:4]) + (", ..." if len(self.offloaded) > 4 else "")
        head = f"{_OWNER}: {len(self.offloaded)} blocks ({shown})"
        if self.step_bytes is None:
            return f"{head}; no training batch run yet"
        return (f"{head}; {self.step_bytes:,} bytes ({format_bytes(self.step_bytes)}) in {self.step_tensors} tensors "
                f"moved to host memory in the last batch; host peak {self.host_peak_bytes:,} bytes")

    def _restore(self) -> None:
        if self._handle is not None:
            self._handle.restore()
            self._handle = None
