"""The precision plugin: ``NoSaveBitsandbytesPrecision`` (bitsandbytes 4-bit/8-bit layers whose backward keeps
only the packed weight, with LoRA), and the packed layers that stand in for them on fake tensors."""

from lightning_memkit import register_pipeline_strategy
from lightning_memkit.plugins.nosave_bitsandbytes import NoSaveBitsandbytesPrecision  # noqa: F401

register_pipeline_strategy()  # strategy="memkit_pipeline" works once Lightning is imported with this
