"""What the package's LightningModules around a transformers causal LM (``self.model``) share: the steps in the
transformers idiom (``self.model(**batch).loss``, logged per loop; greedy predictions) and the peft LoRA config
made from a dict of its arguments.

Example::

    >>> lora_config({"r": 4, "target_modules": ["q_proj"]}, "MyLM").r
    4
    >>> lora_config(None, "MyLM") is None
    True
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["CausalLMSteps", "lora_config"]


class CausalLMSteps:
    """Mixed into a LightningModule whose ``self.model`` is a transformers causal LM (peft-wrapped or not)."""

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.model(**batch).loss
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.model(**batch).loss
        self.log("val_loss", loss, prog_bar=True)
        return loss

    def test_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.model(**batch).loss
        self.log("test_loss", loss)
        return loss

    def predict_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """Greedy next-token predictions: the argmax token after each position, int64 ``(batch, time)``.

        Only ``input_ids`` (and ``attention_mask`` if present) are used; ``labels`` are ignored.
        """
        inputs = {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask")}
        return self.model(**inputs).logits.argmax(dim=-1)


def lora_config(peft_lora: Any, owner: str, **defaults: Any) -> Any:
    """``peft.LoraConfig(**defaults, **peft_lora)``, or ``None``; a bad value raises naming ``owner(peft_lora=...)``."""
    if peft_lora is None:
        return None
    if not isinstance(peft_lora, dict) or not all(isinstance(k, str) for k in peft_lora):
        raise TypeError(f"{owner}(peft_lora=...) must be None or a dict of peft.LoraConfig arguments, e.g. "
                        f"{{'r': 8, 'target_modules': ['q_proj', 'v_proj']}}; got {peft_lora!r}")
    from peft import LoraConfig

    try:
        return LoraConfig(**{**defaults, **peft_lora})
    except (TypeError, ValueError) as err:
        raise ValueError(f"{owner}(peft_lora={peft_lora!r}): not valid peft.LoraConfig arguments: {err}") from None
