"""The dtype the logits of :func:`~lightning_memkit.ops.linear_cross_entropy` are computed in, and its CPU GEMMs.

Two numerics (``logits_dtype``):

* ``torch.float32`` (``"float32"``; the default of :func:`~lightning_memkit.ops.linear_cross_entropy`): the logits
  and their gradient stay float32, bias, ``softcap`` and the log-sum-exp included (Cut Cross-Entropy's numerics;
  Liger-Kernel also applies softcap and the log-sum-exp in float32);
* ``"head"`` (or the inputs' dtype; the default of the transformers path): each logit is formed with fp32
  accumulation and rounded once to the head's dtype, ``softcap`` runs in that dtype (divide, ``tanh``, multiply,
  each rounded, as transformers' Gemma models do), the loss is float32, and the gradient with respect to the
  logits is rounded to the head's dtype before the head's backward products: what
  ``F.cross_entropy(F.linear(h, W).float(), t)`` computes (transformers' ``ForCausalLMLoss``).

Example::

    >>> import torch
    >>> from lightning_memkit.ops._head_numerics import head_softcap
    >>> z = torch.tensor([[40.0, -3.0]], dtype=torch.bfloat16)
    >>> keep = torch.empty_like(z)
    >>> head_softcap(z, 30.0, keep)  # in place: 30 * tanh(z / 30), each step rounded to bf16
    >>> z
    tensor([[26.1250, -2.9844]], dtype=torch.bfloat16)
"""

from __future__ import annotations

import functools

import torch

__all__ = ["HALF", "check_logits_dtype", "head_softcap", "head_softcap_backward", "native_half_matmul"]

HALF = (torch.float16, torch.bfloat16)


@functools.cache
def native_half_matmul(dtype: torch.dtype) -> bool:
    """Whether this CPU multiplies ``dtype`` matrices in hardware (AMX or AVX512-BF16 for bf16, AMX-FP16 for fp16).

    Elsewhere bf16/fp16 GEMMs are emulated, 4x to 100x slower than fp32 ones, so the fused loss multiplies
    fp32 copies instead.
    """
    cpu = getattr(torch, "cpu", None)
    checks = {torch.bfloat16: ("_is_amx_tile_supported", "_is_avx512_bf16_supported"),
              torch.float16: ("_is_amx_fp16_supported",)}.get(dtype, ())
    for name in checks:
        probe = getattr(cpu, name, None)
        try:
            if probe is not None and probe():
                return True
        except RuntimeError:
            continue
    return False


def check_logits_dtype(logits_dtype, input_dtype: torch.dtype, owner: str) -> torch.dtype | None:
    """The dtype the logits are rounded to (``None``: kept in float32) for ``logits_dtype`` (module doc) and the
    inputs' dtype; anything else is refused in one line naming the accepted values."""
    if logits_dtype in (torch.float32, "float32"):
        return None
    if logits_dtype == "head" or logits_dtype == input_dtype:
        return input_dtype if input_dtype in HALF else None
    raise ValueError(f"{owner}: logits_dtype must be torch.float32 or 'float32' (float32 logits, the default) or "
                     f"'head' (or the inputs' dtype, {input_dtype}: each logit rounded to the head's dtype, as "
                     f"transformers computes them), got {logits_dtype!r}")


def head_softcap(z: torch.Tensor, cap: float, keep: torch.Tensor) -> None:
    """``z = cap * tanh(z / cap)`` in place in ``z``'s dtype, as transformers computes it; ``keep`` gets the
    ``tanh`` (for :func:`head_softcap_backward`)."""
    z.div_(cap).tanh_()
    keep.copy_(z)
    z.mul_(cap)


def head_softcap_backward(g: torch.Tensor, cap: float, keep: torch.Tensor) -> None:
    """The gradient of :func:`head_softcap` in place in ``g`` (its dtype): autograd's own ops in its order."""
    g.mul_(cap)
    torch.ops.aten.tanh_backward.grad_input(g, keep, grad_input=g)
    g.div_(cap)

