"""Fine-tune your own model: a pretrained transformers causal LM as a LightningModule, your text as batches, and
the adapters exported in peft's format with what rebuilds the base as trained."""

from lightning_memkit.finetune.export import ExportAdapters, export_adapters, export_merged
from lightning_memkit.finetune.pretrained import PretrainedCausalLM
from lightning_memkit.finetune.text_data import TextDataModule, train_tokenizer

__all__ = ["ExportAdapters", "PretrainedCausalLM", "TextDataModule", "export_adapters", "export_merged",
           "train_tokenizer"]
