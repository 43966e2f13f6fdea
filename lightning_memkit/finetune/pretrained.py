"""A transformers causal LM loaded with ``from_pretrained`` (a local directory or a hub name), trained the HF way.

``training_step`` is ``self.model(**batch).loss``, so every feature of the package (the QLoRA plugin, the fused
loss, checkpointing, ``MemoryBudget``) applies to it unchanged; an optional peft ``LoraConfig`` wraps the model.

Example (LightningCLI YAML)::

    model:
      class_path: lightning_memkit.finetune.PretrainedCausalLM
      init_args: {model: /path/to/llama, dtype: bfloat16,
                  peft_lora: {r: 16, lora_alpha: 32, target_modules: [q_proj, k_proj, v_proj, o_proj]}}
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch

from lightning_memkit.common.causal_lm import CausalLMSteps, lora_config
from lightning_memkit.common.validation import check_choice, check_number

__all__ = ["DTYPES", "PretrainedCausalLM"]

DTYPES = ("bfloat16", "float16", "float32")


class PretrainedCausalLM(CausalLMSteps, pl.LightningModule):
    """``AutoModelForCausalLM.from_pretrained(model, dtype=..., attn_implementation=...)`` as a LightningModule.

    The model trains in training mode, its config's dropout on, as transformers' ``Trainer`` trains it
    (``from_pretrained`` returns it in eval mode, and Lightning does not change a module's mode). Inside an estimate
    (on fake tensors: ``memkit estimate --config``) the model is built from its config in ``dtype`` and no weight
    is read.

    Args:
        model: a local directory written by ``save_pretrained`` or a hub name (read from the local cache; nothing
            is downloaded where the machine is offline).
        dtype: the dtype the weights are loaded in (``bfloat16``, ``float16`` or ``float32``); the adapters'
            export records it, since the base must be loaded the same way to reproduce the trained model.
        attn_implementation: transformers' attention (``sdpa``, ``eager``, ...; ``None``: its default).
        peft_lora: keyword arguments of ``peft.LoraConfig`` (``task_type`` defaults to ``CAUSAL_LM``);
            ``None``: no peft (full fine-tune, or the QLoRA plugin's own adapters).
        lr, weight_decay: AdamW over the trainable parameters.

    Example::

        >>> import tempfile
        >>> from lightning_memkit.demo.hf_models import tiny_hf_causal_lm
        >>> path = tempfile.mkdtemp()
        >>> tiny_hf_causal_lm("llama", seed=0).save_pretrained(path)
        >>> lm = PretrainedCausalLM(path, dtype="float32", peft_lora={"r": 4, "target_modules": ["q_proj"]})
        >>> batch = {"input_ids": torch.randint(0, 256, (2, 8))}
        >>> bool(lm.training_step({**batch, "labels": batch["input_ids"]}, 0) > 0)
        True
    """

    def __init__(self, model: str, dtype: str = "bfloat16", attn_implementation: str | None = "sdpa",
                 peft_lora: dict[str, Any] | None = None, lr: float = 2e-4, weight_decay: float = 0.0):
        super().__init__()
        owner = "PretrainedCausalLM"
        if not isinstance(model, str) or not model:
            raise ValueError(f"{owner}(model={model!r}): give a directory written by save_pretrained or a hub name")
        check_choice(dtype, "dtype", DTYPES, owner=owner)
        check_number(lr, "lr", minimum=0, min_inclusive=False, owner=owner)
        check_number(weight_decay, "weight_decay", minimum=0, owner=owner)
        lora = lora_config(peft_lora, owner, task_type="CAUSAL_LM")
        self.save_hyperparameters()
        from transformers import AutoConfig, AutoModelForCausalLM

        kwargs = {"dtype": getattr(torch, dtype)}
        if attn_implementation is not None:
            kwargs["attn_implementation"] = attn_implementation
        try:
            if _on_fake_tensors():  # an estimate: the architecture from its config, in its dtype; no weight read
                self.model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model), **kwargs)
            else:
                self.model = AutoModelForCausalLM.from_pretrained(model, **kwargs)
        except OSError as err:
            raise ValueError(f"{owner}(model={model!r}): cannot load it: {err}") from None
        # from_pretrained leaves the model in eval mode, which Lightning keeps: its dropout would be off in training
        self.model.train()
        if lora is not None:
            from peft import get_peft_model

            self.model = get_peft_model(self.model, lora)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        params = [p for p in self.parameters() if p.requires_grad]
        return torch.optim.AdamW(params, lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)


def _on_fake_tensors() -> bool:
    """Whether tensors made now are fake (inside an estimate, ``memkit estimate --config``): the weights are then
    not read, only their shapes and dtypes matter."""
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(torch.empty(0))
