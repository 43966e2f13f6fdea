"""The ops of a fake step that create no storage, answered without the fake-tensor machinery; and the FLOP count.

A step on fake tensors spends most of its time dispatching ops through Python: every op passes the FLOP
counter, the tracker, :class:`~lightning_memkit.estimate.trace.FakeKernelGaps` and ``FakeTensorMode``, about
a hundred microseconds each. Many ops create no storage at all, and nothing below the tracker needs them:
the CPU ``bfloat16`` path of the fused loss, for one, copies and multiplies its weight slab by slab into
buffers it allocated before the loop, ~20 such ops per slab and ~150 slabs per chunk of tokens.
:class:`FastOps`, the outermost mode of an estimate, answers these itself when all their tensors are fake:

- ``device`` queries (``prim.device``): the fake tensor's device, as ``FakeTensorMode`` answers them;
- view ops (one fake input, one output aliasing it): the meta kernel on the fake tensor, wrapped as a fake
  tensor on the same storage, as ``FakeTensorMode`` does for them (without its cache and checks);
- in-place arithmetic (``copy_``, ``add_``, ``sub_``, ``mul_``, ``div_``, ``addmm_``, ``zero_``, ``fill_``; the
  optimizers' ``lerp_``, ``addcmul_``, ``addcdiv_`` with operands of the written tensor's dtype) whose operands
  broadcast to the written tensor: that tensor, unchanged (autograd, above the modes, has already bumped its
  version);
- ``mm(..., out=)`` into an output of the right shape and dtype whose rows or columns are contiguous (a slice of
  columns of a wider buffer, as the CPU kernel writes it in place): that output.

Each op overload is answered the long way the first time and compared with the short answer (sizes, strides,
offset, storage, dtype, device): an overload whose answers differ is never shortened. Everything else (every
op that allocates, and any op with a real tensor) goes down to the tracker unchanged. With :attr:`counting`
on, the matmul, convolution and attention FLOPs of every op are added to :attr:`flops` by torch's own formulas
(``FlopCounterMode``'s registry), shortened ones included, as :class:`~lightning_memkit.estimate.trace.FlopCount`
counts them.

Example::

    >>> import torch
    >>> from lightning_memkit.estimate.fast_ops import FastOps
    >>> from lightning_memkit.estimate.trace import CategoryTracker, fake_tensors
    >>> with fake_tensors(), CategoryTracker() as tracker, FastOps() as fast:
    ...     fast.counting = True
    ...     w, x, out = torch.empty(64, 32), torch.empty(8, 64), torch.empty(8, 32)
    ...     for i in range(4):
    ...         _ = torch.mm(x, w[:, 8 * i: 8 * i + 8], out=out[:, 8 * i: 8 * i + 8])
    >>> tracker.peak_bytes == 4 * (64 * 32 + 8 * 64 + 8 * 32), fast.flops == 2 * 8 * 64 * 32
    (True, True)
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_memkit.measure.fake_repeat import repeat_factor

__all__ = ["FastOps"]

_aten = torch.ops.aten
_DEVICE = torch.ops.prim.device.default
#: in-place ops whose result is their first argument with its metadata unchanged, and the shape each of their
#: other tensor operands must broadcast to it from (``None``: the operand's own shape; ``"same dtype"``: its own,
#: in the written tensor's dtype)
_IN_PLACE = {
    _aten.copy_.default: None, _aten.add_.Tensor: None, _aten.add_.Scalar: None, _aten.sub_.Tensor: None,
    _aten.sub_.Scalar: None, _aten.mul_.Tensor: None, _aten.mul_.Scalar: None, _aten.div_.Tensor: None,
    _aten.div_.Scalar: None, _aten.zero_.default: None, _aten.fill_.Scalar: None,
    _aten.addmm_.default: "matmul", _aten.lerp_.Scalar: "same dtype", _aten.lerp_.Tensor: "same dtype",
    _aten.addcmul_.default: "same dtype", _aten.addcdiv_.default: "same dtype",
}
_OUT = (_aten.mm.out,)


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors have the same metadata on the same storage."""
    return (a.shape == b.shape and a.stride() == b.stride() and a.storage_offset() == b.storage_offset()
            and a.dtype == b.dtype and a.fake_device == b.fake_device
            and a.untyped_storage()._cdata == b.untyped_storage()._cdata)


class FastOps(TorchDispatchMode):
    """The outermost mode of an estimate: storage-free ops on fake tensors answered directly (module doc), and the
    FLOP count of the ops run while :attr:`counting` is on."""

    def __init__(self) -> None:
        super().__init__()
        from torch._subclasses.fake_tensor import FakeTensor, in_kernel_invocation_manager

        from lightning_memkit.estimate.flops import flop_registry

        self._fake = FakeTensor
        self._in_kernel = _InKernel if _InKernel.available() else in_kernel_invocation_manager
        self.registry = flop_registry()
        self.counting = False
        self.flops = 0
        self._kind: dict[Any, str | None] = {}  # op overload -> "view", "in place", "out" or None
        self._trusted: dict[Any, bool] = {}  # op overload -> short answer checked against the long one

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps a mode's __torch_dispatch__ in a dynamo-disabling trampoline per call, a few microseconds each:
        # this mode's calls are the most frequent of a fake step (every device query), and nothing compiles in it
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _DEVICE:
            t = args[0]
            if type(t) is self._fake and not t.fake_mode.in_kernel_invocation:
                return t.fake_device
            return func(*args)
        kwargs = kwargs or {}
        kind = self._kind.get(func, "?")
        if kind == "?":
            kind = self._kind[func] = _classify(func)
        out = None
        if kind is not None and self._trusted.get(func, True):
            out = self._short(kind, func, args, kwargs)
            if out is not None and func not in self._trusted:
                self._trusted[func] = self._check(func, args, kwargs, out)
        if out is None:
            out = func(*args, **kwargs)
        if self.counting:
            formula = self.registry.get(func.overloadpacket)
            if formula is not None:
                self.flops += int(formula(*args, **kwargs, out_val=out)) * repeat_factor()
        return out

    def _check(self, func: Any, args: tuple, kwargs: dict, short: torch.Tensor) -> bool:
        """The long answer of ``func`` (fake mode's) compared with ``short``; the first call of each overload."""
        long = func(*args, **kwargs)
        return isinstance(long, self._fake) and _same_view(long, short)

    def _short(self, kind: str, func: Any, args: tuple, kwargs: dict) -> torch.Tensor | None:
        """The short answer of a storage-free op, or ``None`` where it does not apply (then the op goes down)."""
        first = args[0] if args else None
        if not self._plain_fake(first) or _has_tensor_list(args):
            return None
        if kind == "view":
            return self._short_view(func, args, kwargs)
        others = [a for a in (*args[1:], *kwargs.values()) if isinstance(a, torch.Tensor)]
        if not self._fake_on(others, first.fake_device):
            return None
        if kind == "in place":
            return _short_in_place(func, args, first, others)
        return self._short_out(args, kwargs)

    def _plain_fake(self, t: Any) -> bool:
        """Whether ``t`` is a fake tensor with no constant behind it, of the strided layout."""
        return type(t) is self._fake and t.constant is None and t.layout == torch.strided

    def _fake_on(self, tensors: list[torch.Tensor], device: torch.device) -> bool:
        """Whether all ``tensors`` are fake tensors on ``device``."""
        return all(type(t) is self._fake and t.fake_device == device for t in tensors)

    def _short_view(self, func: Any, args: tuple, kwargs: dict) -> torch.Tensor | None:
        """A view op's output: its meta kernel run on the fake input, wrapped as a fake tensor on the same storage."""
        if any(isinstance(a, torch.Tensor) for a in (*args[1:], *kwargs.values())):
            return None
        first = args[0]
        mode = first.fake_mode
        with self._in_kernel(mode):
            meta = func(*args, **kwargs)
        # a fresh meta tensor: wrapped as fake mode wraps it (its meta-to-fake memo is for tensors seen again)
        return self._fake(mode, meta, first.fake_device) if isinstance(meta, torch.Tensor) else None

    def _short_out(self, args: tuple, kwargs: dict) -> torch.Tensor | None:
        """The ``out=`` tensor of a matmul that writes into it in place, else ``None``."""
        out = kwargs.get("out")
        a, b = args[0], args[1] if len(args) > 1 else None
        if (type(out) is not self._fake or not isinstance(b, torch.Tensor) or not _multipliable(a, b)
                or tuple(out.shape) != (a.shape[0], b.shape[1])
                or not a.dtype == b.dtype == out.dtype or not _gemm_writable(out)):
            return None
        return out


def _has_tensor_list(args: tuple) -> bool:
    """Whether an argument is a list or tuple holding a tensor."""
    return any(isinstance(a, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in a) for a in args)


def _multipliable(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a @ b`` is a product of two matrices: both 2-D, the inner sizes equal."""
    return a.dim() == 2 and b.dim() == 2 and a.shape[1] == b.shape[0]


def _short_in_place(func: Any, args: tuple, first: torch.Tensor, others: list[torch.Tensor]) -> torch.Tensor | None:
    """The written tensor of an in-place op whose operands broadcast to it, else ``None``."""
    shapes = [t.shape for t in others]
    if _IN_PLACE[func] == "matmul":
        a, b = args[1], args[2]
        if not _multipliable(a, b) or a.dtype != b.dtype:
            return None
        shapes = [(a.shape[0], b.shape[1])]
    elif _IN_PLACE[func] == "same dtype" and any(t.dtype != first.dtype for t in others):
        return None  # the kernel refuses (lerp_) or promotes: the long way decides
    if not all(_broadcasts_to(s, first.shape) for s in shapes):
        return None
    return first


def _gemm_writable(out: torch.Tensor) -> bool:
    """Whether a BLAS matmul writes into ``out`` in place: rows or columns contiguous (a slice of columns of a wider
    buffer is); any other layout goes the long way."""
    rows, cols = out.shape
    s0, s1 = out.stride()
    return (s1 == 1 and s0 >= max(1, cols)) or (s0 == 1 and s1 >= max(1, rows))


class _InKernel:
    """``torch._subclasses.fake_tensor.in_kernel_invocation_manager`` as a plain class (its generator-based context
    manager costs as much as the meta kernel of a view): torch dispatch off, the fake mode in kernel invocation, meta
    in the TLS dispatch include set, all restored on exit."""

    __slots__ = ("_dispatch", "_keys", "_mode", "_previous")

    @staticmethod
    def available() -> bool:
        return all(hasattr(torch._C, name) for name in ("_DisableTorchDispatch", "_PreserveDispatchKeyGuard",
                                                        "_set_meta_in_tls_dispatch_include"))

    def __init__(self, mode: Any):
        self._mode = mode

    def __enter__(self) -> None:
        self._previous = self._mode.in_kernel_invocation
        self._dispatch = torch._C._DisableTorchDispatch()
        self._dispatch.__enter__()
        self._mode.in_kernel_invocation = True
        self._keys = torch._C._PreserveDispatchKeyGuard()
        self._keys.__enter__()
        torch._C._set_meta_in_tls_dispatch_include(True)

    def __exit__(self, *exc: Any) -> None:
        self._mode.in_kernel_invocation = self._previous
        self._keys.__exit__(*exc)
        self._dispatch.__exit__(*exc)


def _classify(func: Any) -> str | None:
    """``"view"``, ``"in place"``, ``"out"`` or ``None`` (an op that goes down unchanged)."""
    if func in _IN_PLACE:
        return "in place"
    if func in _OUT:
        return "out"
    schema = func._schema
    if (func.is_view and len(schema.returns) == 1 and str(schema.returns[0].type) == "Tensor"
            and not any(str(a.type).startswith(("Tensor[]", "List[Tensor]")) for a in schema.arguments)):
        return "view"
    return None


def _broadcasts_to(shape: Any, target: Any) -> bool:
    """Whether a tensor of ``shape`` broadcasts to ``target`` without changing it."""
    if len(shape) > len(target):
        return False
    return all(s == t or s == 1 for s, t in zip(reversed(tuple(shape)), reversed(tuple(target)), strict=False))
