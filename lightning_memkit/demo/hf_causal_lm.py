"""HFCausalLM: a LightningModule that trains a tiny random Hugging Face causal LM built from its config.

Its ``training_step`` is the plain HF idiom, ``self.model(**batch).loss``: every memkit feature must work
on it with nothing added but the feature object on the ``Trainer``. With ``peft_lora`` the model is wrapped by
peft (``get_peft_model`` with a ``LoraConfig``): only the adapters train.

Example::

    >>> import torch
    >>> from lightning_memkit.demo import HFCausalLM
    >>> module = HFCausalLM(family="gpt_oss", seed=0)
    >>> ids = torch.randint(0, 256, (2, 8))
    >>> module.training_step({"input_ids": ids, "labels": ids}, 0).ndim
    0
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch

from lightning_memkit.common.causal_lm import CausalLMSteps, lora_config
from lightning_memkit.common.validation import check_choice, check_int, check_number
from lightning_memkit.demo.hf_models import HF_FAMILIES, tiny_hf_causal_lm

__all__ = ["HFCausalLM"]


class HFCausalLM(CausalLMSteps, pl.LightningModule):
    """A ``transformers`` causal LM (``self.model``) trained with its own shifted-label loss.

    Args:
        family: ``"llama"``, ``"qwen3_moe"`` or ``"gpt_oss"``.
        hidden_size: width of the residual stream (4 query heads, 2 key/value heads).
        num_layers: decoder layers.
        vocab_size: vocabulary (256 fits :class:`~lightning_memkit.demo.ByteTextDataModule`'s bytes).
        num_experts: experts per MoE layer (MoE families only), 2 routed per token.
        lr: AdamW learning rate over the trainable parameters.
        seed: seed of the random initialisation (``None``: the global RNG as it is).
        config_overrides: more keyword arguments for the config class, e.g. ``{"use_cache": false}``.
        peft_lora: keyword arguments of ``peft.LoraConfig``, e.g. ``{"r": 8, "target_modules": ["q_proj",
            "v_proj"]}``: ``self.model`` becomes ``peft.get_peft_model(model, LoraConfig(**peft_lora))``, whose
            adapters are the only trainable parameters; ``None`` (default): no peft.
        dtype: the dtype the model is built in (``"float32"``, default; ``"bfloat16"`` or ``"float16"``), as a
            checkpoint loads in it: ``NoSaveBitsandbytesPrecision`` keeps what it does not quantize in this dtype.

    Example (LightningCLI YAML)::

        model:
          class_path: lightning_memkit.demo.HFCausalLM
          init_args: {family: qwen3_moe, hidden_size: 64, num_layers: 2,
                      peft_lora: {r: 8, lora_alpha: 16, target_modules: [q_proj, v_proj]}}
        data:
          class_path: lightning_memkit.demo.ByteTextDataModule
          init_args: {batch_size: 8, seq_len: 64, batch_format: hf}
    """

    def __init__(self, family: str = "llama", hidden_size: int = 64, num_layers: int = 2, vocab_size: int = 256,
                 num_experts: int = 4, lr: float = 3e-3, seed: int | None = 0,
                 config_overrides: dict[str, Any] | None = None, peft_lora: dict[str, Any] | None = None,
                 dtype: str = "float32"):
        super().__init__()
        owner = "HFCausalLM"
        check_choice(family, "family", HF_FAMILIES, owner=owner)
        for name, value in (("num_layers", num_layers), ("vocab_size", vocab_size), ("num_experts", num_experts)):
            check_int(value, name, minimum=1, owner=owner)
        check_int(hidden_size, "hidden_size", minimum=8, owner=owner)
        if hidden_size % 8:
            raise ValueError(f"HFCausalLM(hidden_size={hidden_size}) must be a multiple of 8 (4 heads of even size)")
        check_number(lr, "lr", minimum=0, min_inclusive=False, owner=owner)
        check_choice(dtype, "dtype", ("float32", "bfloat16", "float16"), owner=owner)
        lora = lora_config(peft_lora, owner)
        self.save_hyperparameters()
        model = tiny_hf_causal_lm(family, seed=seed, hidden_size=hidden_size, num_layers=num_layers,
                                  vocab_size=vocab_size, num_experts=num_experts, dtype=getattr(torch, dtype),
                                  **(config_overrides or {}))
        if lora is not None:
            from peft import get_peft_model

            try:
                model = get_peft_model(model, lora)
            except (TypeError, ValueError) as err:
                raise ValueError(f"HFCausalLM(peft_lora={peft_lora!r}): peft cannot apply it to the {family} "
                                 f"model: {err}") from None
        self.model = model

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=self.hparams.lr)
