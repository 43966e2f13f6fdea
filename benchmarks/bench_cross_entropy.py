"""LM head + cross-entropy, forward and backward: peak bytes and time.

Case 1 (``linear_cross_entropy``): ours against ``F.cross_entropy`` on materialized logits and
``F.linear_cross_entropy`` without and with ``options=LinearCrossEntropyOptions()`` (the chunked path,
the baseline), plus Liger-Kernel's fused linear cross-entropy on CUDA when it is installed. The
unavoidable bytes are the gradients ``dW + dx``; "overhead" is the peak above them.

Case 2 (``cross_entropy`` on materialized logits): ours (saved logits, and ``inplace_backward``)
against ``F.cross_entropy``; every row allocates the logits and ``dW`` of the head.

Case 3 (Hugging Face causal LMs): a tiny random Llama, Qwen3-MoE and GPT-OSS (hidden 64, 2 layers,
vocabulary 32768, batch 2 x 256; 8192 and 2 x 128 with ``--quick``) called with ``labels``: HF's own
loss on materialized logits (the baseline) against the same call inside
``lightning_memkit.hf.fused_linear_cross_entropy(model)``. Whole-model forward+backward peak and time.

    python -m benchmarks.run --only cross_entropy [--quick] [--device cuda]
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from benchmarks.common import mib, peak_of, record, time_once
from lightning_memkit.demo.hf_models import HF_FAMILIES, tiny_hf_causal_lm
from lightning_memkit.hf import fused_linear_cross_entropy
from lightning_memkit.ops import cross_entropy, linear_cross_entropy

BASELINE = "F.linear_cross_entropy(options=LinearCrossEntropyOptions())"
OURS = "memkit linear_cross_entropy"


def _shapes(device: str, quick: bool) -> tuple[tuple[int, int, int], torch.dtype]:
    if device.startswith("cuda"):
        return ((2048, 1024, 32000) if quick else (8192, 4096, 128256)), torch.bfloat16
    return ((512, 128, 8000) if quick else (4096, 512, 32000)), torch.float32


def _liger_loss():
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except ImportError:
        return None
    loss_fn = LigerFusedLinearCrossEntropyLoss()

    def fn(x, w, t):
        out = loss_fn(w, x, t)
        return out[0] if isinstance(out, tuple) else out

    return fn


def _measure(impls: dict[str, Callable[[], torch.Tensor]], leaves, device: str, rounds: dict[str, int]):
    """Peak bytes (one run each, also the warm-up) and min wall time over interleaved rounds."""

    def step(fn):
        for t in leaves:
            t.grad = None
        fn().backward()

    peaks, times = {}, {name: [] for name in impls}
    for name, fn in impls.items():
        for t in leaves:
            t.grad = None
        peaks[name] = peak_of(lambda fn=fn: fn().backward(), device=device)
    for r in range(max(rounds.values())):
        for name, fn in impls.items():
            if r < rounds[name]:
                times[name].append(time_once(lambda fn=fn: step(fn), device))
    for t in leaves:
        t.grad = None
    return peaks, {name: min(ts) for name, ts in times.items()}


def _linear_case(device: str, quick: bool) -> dict:
    torch.manual_seed(0)
    (n, h, v), dtype = _shapes(device, quick)
    x = torch.randn(n, h, device=device, dtype=dtype, requires_grad=True)
    w = (torch.randn(v, h, device=device) / h**0.5).to(dtype).requires_grad_()
    t = torch.randint(0, v, (n,), device=device)
    impls: dict[str, Callable[[], torch.Tensor]] = {
        "F.cross_entropy(F.linear(...))": lambda: F.cross_entropy(F.linear(x, w), t),
    }
    baseline = BASELINE
    if hasattr(torch.nn, "LinearCrossEntropyOptions"):
        chunked = torch.nn.LinearCrossEntropyOptions()
        impls["F.linear_cross_entropy(options=None)"] = lambda: F.linear_cross_entropy(x, w, t)
        impls[BASELINE] = lambda: F.linear_cross_entropy(x, w, t, options=chunked)
    else:  # torch < 2.13 has no fused head + loss: compare with the materialized reference
        baseline = "F.cross_entropy(F.linear(...))"
    impls[OURS] = lambda: linear_cross_entropy(x, w, t)
    cuda = device.startswith("cuda")
    liger = _liger_loss() if cuda else None
    if liger is not None:
        impls["liger FusedLinearCrossEntropy"] = lambda: liger(x, w, t)
    if cuda:
        impls["memkit linear_cross_entropy(chunk_size=1024)"] = lambda: linear_cross_entropy(x, w, t, chunk_size=1024)
        if dtype != torch.float32:  # Liger accumulates dW in the weight's dtype: the like-for-like memory row
            impls[f"memkit linear_cross_entropy(accum_dtype={str(dtype).removeprefix('torch.')})"] = (
                lambda: linear_cross_entropy(x, w, t, accum_dtype=dtype)
            )
        rounds = dict.fromkeys(impls, 5)
    elif quick:
        rounds = dict.fromkeys(impls, 3)
    else:  # ~10 s per step on a 2-core CPU: the goal's two rows twice, the reference rows once
        rounds = {name: 2 if name in (baseline, OURS) else 1 for name in impls}
    peaks, times = _measure(impls, (x, w), device, rounds)
    unavoidable = (x.numel() + w.numel()) * x.element_size()
    rows = []
    for name in impls:
        rows.append({
            "impl": name, "peak_bytes": peaks[name], "peak_mib": mib(peaks[name]),
            "overhead_mib": mib(peaks[name] - unavoidable), "time_s": round(times[name], 3),
            "time_vs_baseline": round(times[name] / times[baseline], 3),
        })
    over_ours, over_base = peaks[OURS] - unavoidable, peaks[baseline] - unavoidable
    ratio = times[OURS] / times[baseline]
    met = over_ours <= over_base / 4 and ratio <= 1.0
    case = f"N={n} H={h} V={v} {str(dtype).removeprefix('torch.')}, forward+backward, dW+dx = {mib(unavoidable)} MiB"
    goal = (f"overhead above dW+dx <= 1/4 of the baseline's ({mib(over_ours)} vs {mib(over_base)} MiB) "
            f"and time <= the baseline's (ratio {ratio:.3f})")
    return record("linear_cross_entropy", case, baseline, rows, goal=goal, met=met)


def _logits_case(device: str, quick: bool) -> dict:
    torch.manual_seed(0)
    (_, h, v), dtype = _shapes(device, quick)
    n = 256 if quick else (4096 if device.startswith("cuda") else 1024)
    x = torch.randn(n, h, device=device, dtype=dtype)
    w = (torch.randn(v, h, device=device) / h**0.5).to(dtype).requires_grad_()
    t = torch.randint(0, v, (n,), device=device)
    base = "F.cross_entropy"
    impls = {
        base: lambda: F.cross_entropy(x @ w.t(), t),
        "memkit cross_entropy": lambda: cross_entropy(x @ w.t(), t),
        "memkit cross_entropy(inplace_backward=True)": lambda: cross_entropy(x @ w.t(), t, inplace_backward=True),
    }
    peaks, times = _measure(impls, (w,), device, dict.fromkeys(impls, 3))
    logits = n * v * x.element_size()
    unavoidable = logits + w.numel() * w.element_size()
    rows = [{
        "impl": name, "peak_bytes": peaks[name], "peak_mib": mib(peaks[name]),
        "above_logits_and_dW_mib": mib(peaks[name] - unavoidable),
        "time_s": round(times[name], 3), "time_vs_baseline": round(times[name] / times[base], 3),
    } for name in impls]
    inplace_over = peaks["memkit cross_entropy(inplace_backward=True)"] - unavoidable
    case = (f"head + loss on materialized logits, N={n} H={h} V={v} {str(dtype).removeprefix('torch.')}, "
            f"logits = {mib(logits)} MiB")
    goal = "with inplace_backward=True no (N, V) tensor besides the logits: peak above logits + dW < 1/10 of the logits"
    return record("cross_entropy", case, base, rows, goal=goal, met=inplace_over < logits / 10)


def _hf_case(device: str, quick: bool, family: str) -> dict:
    vocab, (bs, seq) = (8192, (2, 128)) if quick else (32768, (2, 256))
    model = tiny_hf_causal_lm(family, seed=0, vocab_size=vocab).to(device)
    ids = torch.randint(0, vocab, (bs, seq), device=device, generator=torch.Generator(device).manual_seed(0))

    def hf():
        return model(input_ids=ids, labels=ids).loss

    def fused():
        with fused_linear_cross_entropy(model):
            return model(input_ids=ids, labels=ids).loss

    impls = {"HF loss on logits": hf, "memkit fused_linear_cross_entropy": fused}
    peaks, times = _measure(impls, list(model.parameters()), device, {name: 5 if quick else 10 for name in impls})
    logits = bs * seq * vocab * 4
    base = "HF loss on logits"
    rows = [{"impl": name, "peak_bytes": peaks[name], "peak_MiB": mib(peaks[name]),
             "saved_vs_logits_bytes": round((peaks[base] - peaks[name]) / logits, 2),
             "time_vs_baseline": round(times[name] / times[base], 3)} for name in impls]
    saved = peaks[base] - peaks["memkit fused_linear_cross_entropy"]
    case = (f"tiny {type(model).__name__} (hidden 64, 2 layers, vocab {vocab}) batch {bs}x{seq} fp32 on {device}: "
            f"whole-model forward+backward; logits {logits:,} B")
    return record("cross_entropy", case, base, rows, goal="peak lower by at least the logits' bytes",
                  met=bool(saved >= logits))


def run(device: str = "cpu", quick: bool = False) -> list[dict]:
    return [_linear_case(device, quick), _logits_case(device, quick),
            *(_hf_case(device, quick, family) for family in HF_FAMILIES)]


if __name__ == "__main__":
    import json
    import sys

    print(json.dumps(run(quick="--quick" in sys.argv), indent=2))
