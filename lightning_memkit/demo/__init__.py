"""Small models and data made in code (TinyLM, a mixture-of-experts LM, tiny transformers models, bytes of Python's
own sources): the demo, the examples and the tests train them with nothing to download."""

from lightning_memkit.demo.byte_text import ByteTextDataModule
from lightning_memkit.demo.hf_causal_lm import HFCausalLM
from lightning_memkit.demo.moe import TinyMoE
from lightning_memkit.demo.tiny_lm import TinyLM
from lightning_memkit.demo.variable_text import VariableLengthDataModule

__all__ = [
    "ByteTextDataModule",
    "HFCausalLM",
    "TinyLM",
    "TinyMoE",
    "VariableLengthDataModule",
]
