"""Fine-tune your own model: a pretrained transformers causal LM as a LightningModule, and its adapters exported in
peft's format with what rebuilds the base as trained."""

from lightning_memkit.finetune.export import ExportAdapters, export_adapters
from lightning_memkit.finetune.pretrained import PretrainedCausalLM

__all__ = ["ExportAdapters", "PretrainedCausalLM", "export_adapters"]
