"""Frozen quantized Linear layers: bytes the autograd graph keeps after forward, and a QLoRA stack's peak.

Three ways to run a frozen bitsandbytes layer, on the same packed weights:

- ``dequantize-then-linear``: ``F.linear(x, dequantize(W))`` with plain autograd (keeps the copy);
- ``bitsandbytes``: its own ``Linear4bit`` / ``Linear8bitLt`` (0.50) modules;
- ``memkit``: :func:`lightning_memkit.ops.nosave_matmul.nosave_linear`.

Part 1 measures, per layer, the bytes of new storage still alive after forward, output excluded (the
input is created before the layer and dropped after it, as an activation would be, so it counts only
when the layer keeps it), and the bytes that ``saved_tensors_hooks`` see. Part 2 runs forward +
backward of an 8-layer QLoRA MLP (``GELU(base(h) + lora(h))``, rank 16, alpha 32, dropout 0.05) and
reports the peak and the time relative to bitsandbytes.

    python -m benchmarks.run --only nosave_bnb [--quick] [--device cuda]
"""

from __future__ import annotations

import functools

import bitsandbytes as bnb
import torch
import torch.nn.functional as F

from benchmarks.common import mib, peak_of, record, sync, timed
from lightning_memkit.memory import LivePeak
from lightning_memkit.ops.lora import LoRAAdapter
from lightning_memkit.ops.nosave_matmul import dequantize_weight, nosave_linear

MODES = ("nf4", "nf4-dq", "fp4", "fp4-dq", "int8")
STACK_MODES = ("nf4", "int8")
IMPLS = ("dequantize-then-linear", "bitsandbytes", "memkit")
BASELINE = "bitsandbytes"


def _half(mode: str) -> torch.dtype:
    return torch.float16 if mode == "int8" else torch.bfloat16


def make_layer(mode: str, in_f: int, out_f: int, dtype: torch.dtype, device: str):
    """A bitsandbytes layer quantized by bitsandbytes from a ``dtype`` weight (quant state in ``dtype``)."""
    if mode == "int8":
        layer = bnb.nn.Linear8bitLt(in_f, out_f, bias=True, has_fp16_weights=False)
    else:
        layer = bnb.nn.Linear4bit(in_f, out_f, bias=True, compute_dtype=dtype, quant_type=mode[:3],
                                  compress_statistics=mode.endswith("-dq"))
        layer.weight.data = layer.weight.data.to(dtype)
    layer.bias.data = layer.bias.data.to(dtype)
    return layer.to(device)


def base_forward(impl: str, layer, h: torch.Tensor) -> torch.Tensor:
    if impl == "memkit":
        return nosave_linear(h, layer)
    if impl == "bitsandbytes":
        return layer(h)
    return F.linear(h, dequantize_weight(layer, h.dtype), layer.bias.to(h.dtype))


# -- part 1: what one layer keeps ------------------------------------------------------------------------
def _retained(impl: str, layer, base: torch.Tensor, device: str) -> tuple[int, int]:
    """(new bytes alive after forward, output and input excluded; bytes seen by saved-tensor hooks)."""
    seen: dict[int, int] = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    if device.startswith("cuda"):
        x = base * 1.0
        sync(device)
        before = torch.cuda.memory_allocated()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = base_forward(impl, layer, x)
        x_bytes = x.untyped_storage().nbytes()
        del x
        sync(device)
        retained = torch.cuda.memory_allocated() - before + x_bytes - out.untyped_storage().nbytes()
    else:
        with LivePeak() as lp:
            x = base * 1.0  # an activation born before the layer, dropped by the caller after it
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = base_forward(impl, layer, x)
            del x
            retained = lp.live_bytes - out.untyped_storage().nbytes()
    del out
    return retained, sum(seen.values())


def per_layer(device: str, quick: bool) -> list[dict]:
    tokens, width, out_f = (512, 256, 256) if quick else (4096, 2048, 1024)
    entries = []
    for mode in MODES:
        for dtype in (torch.float32, _half(mode)):
            layer = make_layer(mode, width, out_f, dtype, device)
            base = torch.randn(tokens, width, device=device, dtype=dtype, requires_grad=True)
            rows = []
            for impl in IMPLS:
                retained, visible = _retained(impl, layer, base, device)
                rows.append({"impl": impl, "retained_bytes": retained, "retained_MiB": mib(retained),
                             "hook_visible_bytes": visible})
            ours, theirs = rows[2]["retained_bytes"], rows[1]["retained_bytes"]
            goal = "memkit retains 0 new bytes" + (" and >= 8x less than Linear8bitLt" if mode == "int8" else "")
            met = ours == 0 and (mode != "int8" or theirs >= 8 * ours)
            case = f"{mode}, {str(dtype).removeprefix('torch.')}, input {tokens} x {width}, layer {width} -> {out_f}"
            entries.append(record("nosave_bnb retained per layer", case, BASELINE, rows, goal, met))
            del layer, base
    return entries


# -- part 2: an 8-layer QLoRA stack ----------------------------------------------------------------------
def stack_step(impl: str, layers: list, loras: list, x: torch.Tensor) -> None:
    """Forward + backward of ``h = GELU(base(h) + lora(h))`` over the layers; the LoRA grads are dropped after."""
    h = x
    for layer, lora in zip(layers, loras):
        h = F.gelu(base_forward(impl, layer, h) + lora(h))
    h.float().square().mean().backward()
    for lora in loras:
        lora.A.grad = lora.B.grad = None


def qlora_stack(device: str, quick: bool) -> list[dict]:
    tokens, width, depth, rank = (256, 256, 8, 16) if quick else (512, 512, 8, 16)
    repeat = 1 if quick else 3
    entries = []
    for mode in STACK_MODES:
        for dtype in (torch.float32, _half(mode)):
            torch.manual_seed(0)
            layers = [make_layer(mode, width, width, dtype, device) for _ in range(depth)]
            loras = [LoRAAdapter(width, width, rank, alpha=32, dropout=0.05, device=device) for _ in range(depth)]
            for lora in loras:
                torch.nn.init.normal_(lora.B, std=0.02)
            x = torch.randn(tokens, width, device=device, dtype=dtype)

            steps = {impl: functools.partial(stack_step, impl, layers, loras, x) for impl in IMPLS}
            peaks = {impl: peak_of(step, device=device) for impl, step in steps.items()}  # also the warm-up
            times: dict[str, list[float]] = {impl: [] for impl in IMPLS}
            for _ in range(repeat):  # interleaved, so that a change of machine load hits every impl alike
                for impl, step in steps.items():
                    times[impl].append(timed(step, device=device, repeat=1, warmup=0))
            rows = [{"impl": impl, "peak_bytes": peaks[impl], "peak_MiB": mib(peaks[impl]),
                     "seconds": sorted(times[impl])[len(times[impl]) // 2]} for impl in IMPLS]
            base_row = rows[1]
            base_peak, base_seconds = base_row["peak_bytes"], base_row["seconds"]
            for r in rows:
                r["peak_vs_bitsandbytes"] = round(r["peak_bytes"] / base_peak, 3)
                r["time_vs_bitsandbytes"] = round(r.pop("seconds") / base_seconds, 3)
            ours = rows[2]
            met = ours["peak_bytes"] < base_row["peak_bytes"] and ours["time_vs_bitsandbytes"] <= 1.10
            case = (f"{mode}, {str(dtype).removeprefix('torch.')}, {depth} layers {width} -> {width}, "
                    f"{tokens} tokens, LoRA rank {rank}, forward + backward")
            goal = "memkit peak < bitsandbytes peak and time <= 1.10x bitsandbytes"
            entries.append(record("nosave_bnb QLoRA stack", case, BASELINE, rows, goal, met))
            del layers, loras, x
    return entries


def run(device: str = "cpu", quick: bool = False) -> list[dict]:
    return per_layer(device, quick) + qlora_stack(device, quick)
