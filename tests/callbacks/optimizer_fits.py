"""Short fits of TinyLM and a tiny transformers Llama (peft-wrapped too) for the optimizer levers' callbacks: the loss
of each step, the bytes LivePeak counts (over the fit and over its second step), a checkpoint resumed with or without
a lever, and modules whose optimizers a lever refuses."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from step_faults import StepLosses

from lightning_memkit.demo import ByteTextDataModule, HFCausalLM, TinyLM
from lightning_memkit.measure.live_peak import LivePeak

STEPS = 4
PER_EPOCH = 2  # a checkpoint after step 2 is an epoch's end: a resumed fit sees the uninterrupted fit's batches


class FitBytes(pl.Callback):
    """LivePeak over the fit (from before the levers' ``on_fit_start``: list it first) to the end of training, and
    over the second training step; their counts when they closed (a closed LivePeak still counts the frees):
    ``fit_bytes`` (peak, live, host live) and ``step_bytes`` (peak, live)."""

    def __init__(self) -> None:
        self._fit = LivePeak()
        self._step = LivePeak()
        self.fit_bytes: tuple[int, int, int] | None = None
        self.step_bytes: tuple[int, int] | None = None

    def on_fit_start(self, trainer, pl_module) -> None:
        self._fit.__enter__()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == 1 and self._step._mode is None and self.step_bytes is None:
            self._step.__enter__()  # its first micro-batch

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == 2 and self._step._mode is not None:
            self._close_step()

    def on_train_end(self, trainer, pl_module) -> None:
        if self._step._mode is not None:
            self._close_step()
        self._fit.__exit__(None, None, None)
        self.fit_bytes = (self._fit.peak_bytes, self._fit.live_bytes, self._fit.host_live_bytes)

    def _close_step(self) -> None:
        self._step.__exit__(None, None, None)
        self.step_bytes = (self._step.peak_bytes, self._step.live_bytes)


class SGDLM(TinyLM):
    """TinyLM with SGD (momentum 0.9)."""

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class ScheduledLM(TinyLM):
    """TinyLM's AdamW with an LR scheduler halving the lr each step."""

    def configure_optimizers(self):
        optimizer = super().configure_optimizers()
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class LBFGSLM(TinyLM):
    def configure_optimizers(self):
        return torch.optim.LBFGS(self.parameters())


class TwoOptimizersLM(TinyLM):
    def __init__(self) -> None:
        super().__init__(d_model=32, n_layers=1, n_heads=2, seq_len=32)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizers = self.optimizers()
        for opt in optimizers if isinstance(optimizers, list) else [optimizers]:
            opt.zero_grad()
            loss = self._loss(batch)
            self.manual_backward(loss)
            opt.step()
        return loss.detach()

    def configure_optimizers(self):
        return [torch.optim.SGD(self.blocks.parameters(), lr=0.1), torch.optim.AdamW(self.head.parameters())]


class ManualLM(TwoOptimizersLM):
    def configure_optimizers(self):
        return [torch.optim.AdamW(self.parameters())]


class ClippingLM(TinyLM):
    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        torch.nn.utils.clip_grad_norm_(self.parameters(), 1.0)


def model(kind: str) -> pl.LightningModule:
    """``"tiny_lm"`` (TinyLM), ``"wide_lm"`` (a wider one), ``"llama"``, ``"peft"`` (the Llama with LoRA on q and v),
    or a TinyLM subclass of this module by name."""
    torch.manual_seed(0)
    if kind in ("llama", "peft"):
        peft = {"r": 4, "target_modules": ["q_proj", "v_proj"]} if kind == "peft" else None
        return HFCausalLM("llama", hidden_size=64, num_layers=2, vocab_size=256, seed=0, peft_lora=peft)
    if kind == "wide_lm":  # its gradients outweigh its activations
        return TinyLM(d_model=128, n_layers=2, n_heads=2, seq_len=32)
    cls = {"tiny_lm": TinyLM}.get(kind) or globals()[kind]
    return cls() if cls in (TwoOptimizersLM, ManualLM) else cls(d_model=32, n_layers=1, n_heads=2, seq_len=32)


def fit(kind: str, *callbacks: pl.Callback, steps: int = STEPS, ckpt: Path | None = None, resume: bool = False,
        **trainer_args: Any) -> tuple[list[float], pl.Trainer, pl.LightningModule]:
    """``steps`` optimizer steps of :func:`model` ``(kind)``: the loss of each, the Trainer and the module. ``ckpt``:
    a checkpoint folder written after every step (``last.ckpt``), resumed from with ``resume``."""
    losses = StepLosses()
    module = model(kind)
    hf = kind in ("llama", "peft")
    data = ByteTextDataModule(batch_size=4, seq_len=32, max_bytes=20_000, samples_per_epoch=4 * PER_EPOCH,
                              batch_format="hf" if hf else "pairs")
    extra = [ModelCheckpoint(dirpath=ckpt, save_last=True, every_n_train_steps=1)] if ckpt is not None else []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = pl.Trainer(accelerator="cpu", max_steps=steps, logger=False, enable_checkpointing=ckpt is not None,
                             enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                             callbacks=[*callbacks, losses, *extra], **trainer_args)
        trainer.fit(module, data, ckpt_path=str(ckpt / "last.ckpt") if resume else None)
    return losses.steps, trainer, module


def resumed(tmp_path: Path, kind: str, first: list[pl.Callback], second: list[pl.Callback]) -> list[float]:
    """The losses of :data:`STEPS` steps: :data:`PER_EPOCH` with the ``first`` callbacks, the rest resumed from their
    checkpoint with the ``second``."""
    before, _, _ = fit(kind, *first, steps=PER_EPOCH, ckpt=tmp_path)
    after, _, _ = fit(kind, *second, ckpt=tmp_path, resume=True)
    return before + after
