"""Reference computations for the cross-entropy tests: PyTorch composed in a given dtype, and the
same composition in fp64 as the oracle (Cut Cross-Entropy's testing style)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

OPTION_SETS = {
    "plain": {},
    "smoothing": {"label_smoothing": 0.3},
    "zloss_softcap": {"z_loss": 0.05, "softcap": 4.0},
    "all": {"label_smoothing": 0.2, "z_loss": 0.02, "softcap": 3.0},
}


def reference_loss(logits, target, *, ignore_index=-100, label_smoothing=0.0, z_loss=0.0, softcap=None,
                   reduction="mean"):
    """The loss composed from PyTorch ops in ``logits``' dtype (class dimension last)."""
    v = logits.shape[-1]
    z = logits.reshape(-1, v)
    t = target.reshape(-1)
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    loss = F.cross_entropy(z, t, ignore_index=ignore_index, label_smoothing=label_smoothing, reduction="none")
    valid = t != ignore_index
    if z_loss:
        loss = loss + z_loss * torch.logsumexp(z, -1) ** 2 * valid
    if reduction == "mean":
        return loss.sum() / valid.sum()
    if reduction == "sum":
        return loss.sum()
    return loss.reshape(target.shape)


def make_target(n: int, v: int, *shape, ignore_frac: float = 0.2, generator=None) -> torch.Tensor:
    t = torch.randint(0, v, (n,), generator=generator)
    t[torch.rand(n, generator=generator) < ignore_frac] = -100
    return t.reshape(*shape) if shape else t


def max_err(x: torch.Tensor, oracle: torch.Tensor) -> float:
    return (x.double() - oracle).abs().max().item() if x.numel() else 0.0


def assert_within(ours, ref, oracle, rel_tol: float, what: str) -> None:
    """Our error against the fp64 oracle is at most PyTorch's same-dtype error plus ``rel_tol`` times
    the oracle's largest magnitude."""
    scale = oracle.abs().max().item() if oracle.numel() else 0.0
    e_ours, e_ref = max_err(ours, oracle), max_err(ref, oracle)
    bound = e_ref + rel_tol * scale
    assert e_ours <= bound, f"{what}: error {e_ours:.3e} > torch's {e_ref:.3e} + {rel_tol * scale:.1e}"


def check_against_oracle(loss_fn, base, target, reduction, opts, rel_tol):
    """Run ``loss_fn(logits, target, reduction=..., **opts)`` forward and backward on a copy of ``base`` and
    assert its loss and gradient are within ``rel_tol`` of PyTorch's same-dtype error against an fp64 oracle.

    Returns the logits leaf ``loss_fn`` was given (its ``.grad`` holds our gradient).
    """
    oracle_in = base.double().requires_grad_()
    oracle = reference_loss(oracle_in, target, reduction=reduction, **opts)
    grad_out = torch.rand_like(oracle) + 0.5
    oracle.backward(grad_out)

    ref_in = base.clone().requires_grad_()
    ref = reference_loss(ref_in, target, reduction=reduction, **opts)
    ref.backward(grad_out.to(base.dtype))

    ours_in = base.clone().requires_grad_()
    ours = loss_fn(ours_in * 1, target, reduction=reduction, **opts)
    assert ours.dtype == base.dtype and ours.shape == oracle.shape
    ours.backward(grad_out.to(base.dtype))
    assert_within(ours.detach(), ref.detach(), oracle.detach(), rel_tol, "loss")
    assert_within(ours_in.grad, ref_in.grad, oracle_in.grad, rel_tol, "grad")
    return ours_in


class NoHostSync(TorchDispatchMode):
    """Fail on any op that copies a device value to the host (``.item()``, ``bool(tensor)``)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default):
            raise AssertionError(f"host sync through {func}")
        return func(*args, **(kwargs or {}))
