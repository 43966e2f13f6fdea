"""Triton kernels, imported lazily by the ops (only on CUDA or under TRITON_INTERPRET=1)."""
