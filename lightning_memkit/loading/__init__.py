"""Loading weights with a bounded peak: streaming MXFP4 dequantization into a model built on ``meta``, its
non-persistent buffers recomputed, and the guard against transformers' allocator warmup. Pure torch."""

from lightning_memkit.loading.meta_buffers import initialize_meta_buffers
from lightning_memkit.loading.mxfp4 import dequantize_mxfp4
from lightning_memkit.loading.safetensors_loader import LoadResult, load_mxfp4_into
from lightning_memkit.loading.stream import stream_dequantize

__all__ = ["dequantize_mxfp4", "stream_dequantize", "load_mxfp4_into", "LoadResult", "initialize_meta_buffers"]
