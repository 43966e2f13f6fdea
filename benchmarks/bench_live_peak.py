"""LivePeak: are its byte counts exact, and what does it cost on a training step?

Case 1 (accuracy): tensors of known size (several dtypes and shapes, views, frees, op outputs) are
created inside a ``LivePeak``; the expected peak and live bytes are computed from shapes and dtypes
by hand (``numel * itemsize``) and compared with what LivePeak counted. Ratio 1.0 means exact. On
CUDA the same tensors live on the GPU and ``torch.cuda.max_memory_allocated`` is shown beside it
(the caching allocator rounds each block up to 512 bytes).

Case 2 (overhead): one TinyLM training step (forward, backward, AdamW step; the ``make demo``
model) with and without a ``LivePeak`` around it, interleaved step by step; the time ratio is the
median of the per-pair ratios. LivePeak's dispatch mode runs Python on every ATen op, so the cost is
per op, and the ops per step are counted too.

    python -m benchmarks.run --only live_peak [--quick] [--device cuda]
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.common import record, time_once
from lightning_memkit.demo import TinyLM
from lightning_memkit.memory import LivePeak

THREADS = 1  # one intra-op thread: stable ratios on a shared 2-core machine


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    n = 1
    for s in shape:
        n *= s
    return n * torch.empty((), dtype=dtype).element_size()


def _scenarios(device: str) -> list[tuple[str, Callable[[list], None], int, int]]:
    """``(name, fn(keep), expected_peak, expected_live)``: ``fn`` puts what must stay alive in ``keep``."""
    cases = []
    for shape, dtype in [((1024, 1024), torch.float32), ((3, 777), torch.bfloat16), ((10,), torch.float64),
                         ((1_000_003,), torch.int8), ((4096,), torch.bool), ((100, 100), torch.complex64),
                         ((7, 5, 3), torch.float16), ((257, 33), torch.int64)]:
        nb = _nbytes(shape, dtype)
        cases.append((f"empty{tuple(shape)} {str(dtype).removeprefix('torch.')}",
                      lambda keep, s=shape, d=dtype: keep.append(torch.empty(s, dtype=d, device=device)), nb, nb))

    def views(keep):
        a = torch.empty(1000, dtype=torch.float32, device=device)
        keep += [a.view(10, 100), a[::2], a.unsqueeze(0)]

    cases.append(("one storage, 3 views (counted once)", views, 4000, 4000))

    def frees(keep):
        a = torch.empty(1 << 20, dtype=torch.float32, device=device)  # 4 MiB
        del a
        keep.append(torch.empty(1 << 18, dtype=torch.float32, device=device))  # 1 MiB

    cases.append(("alloc 4 MiB, free, alloc 1 MiB", frees, 4 << 20, 1 << 20))

    def ops(keep):
        x = torch.randn(512, 512, device=device)
        y = x @ x
        y.add_(1)  # in place: no new storage
        keep.append(y)
        del x

    cases.append(("randn 512x512, matmul, add_, free input", ops, 2 * (512 * 512 * 4), 512 * 512 * 4))
    return cases


def _accuracy_case(device: str) -> dict:
    rows, exact = [], True
    for name, fn, want_peak, want_live in _scenarios(device):
        keep: list = []
        if device.startswith("cuda"):
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        with LivePeak() as lp:
            fn(keep)
        row = {"impl": name, "expected_peak_bytes": want_peak, "livepeak_peak_bytes": lp.peak_bytes,
               "expected_live_bytes": want_live, "livepeak_live_bytes": lp.live_bytes,
               "ratio": lp.peak_bytes / want_peak}
        if device.startswith("cuda"):
            torch.cuda.synchronize()
            row["cuda_max_allocated_delta"] = torch.cuda.max_memory_allocated() - base
        exact &= lp.peak_bytes == want_peak and lp.live_bytes == want_live
        rows.append(row)
        del keep
    return record("live_peak", f"accuracy on {device}: known tensors, expected bytes from shape x itemsize",
                  "bytes computed from shapes and dtypes", rows,
                  goal="measured peak and live bytes equal the expected ones (ratio 1.0) in every row", met=exact)


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def tiny_lm_step(device: str, quick: bool):
    """A closure running one TinyLM training step (the ``make demo`` shapes unless ``quick``)."""
    torch.manual_seed(0)
    if quick:
        model, (bs, seq) = TinyLM(d_model=64, n_layers=2, n_heads=2, seq_len=64), (8, 64)
    else:
        model, (bs, seq) = TinyLM(), (16, 128)
    model = model.to(device)
    opt = model.configure_optimizers()
    x = torch.randint(0, 256, (bs, seq), device=device)
    y = torch.randint(0, 256, (bs, seq), device=device)

    def step():
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, f"TinyLM d_model={model.hparams.d_model} n_layers={model.hparams.n_layers} batch {bs}x{seq}"


def _overhead_case(device: str, quick: bool) -> dict:
    step, label = tiny_lm_step(device, quick)
    for _ in range(2):
        step()
    with _CountOps() as counter:
        step()

    def tracked():
        with LivePeak():
            step()

    pairs = 6 if quick else 12
    base, with_lp = [], []
    for i in range(pairs):
        first, second = (step, tracked) if i % 2 == 0 else (tracked, step)
        a, b = time_once(first, device), time_once(second, device)
        base.append(a if first is step else b)
        with_lp.append(b if first is step else a)
    ratio = statistics.median(w / b for w, b in zip(with_lp, base))
    t_base, t_lp = statistics.median(base), statistics.median(with_lp)
    per_op_us = (ratio - 1.0) * t_base / counter.n * 1e6  # from the paired ratio, the less noisy figure
    rows = [
        {"impl": "no tracking", "time_s": round(t_base, 4), "time_vs_baseline": 1.0, "aten_ops_per_step": counter.n},
        {"impl": "LivePeak around the step", "time_s": round(t_lp, 4), "time_vs_baseline": round(ratio, 3),
         "aten_ops_per_step": counter.n, "overhead_us_per_op": round(per_op_us, 1)},
    ]
    threads = torch.get_num_threads()
    case = f"{label} on {device}, forward+backward+AdamW, {threads} thread(s), {pairs} interleaved pairs"
    return record("live_peak", case, "the same step without tracking", rows)


def run(device: str = "cpu", quick: bool = False) -> list[dict]:
    before = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    try:
        return [_accuracy_case(device), _overhead_case(device, quick)]
    finally:
        torch.set_num_threads(before)
