"""MXFP4 dequantization and checkpoint loading: peak bytes and time against transformers' loader path.

Part 1 dequantizes one GPT-OSS expert tensor (blocks ``[E, R, G, 16]`` -> ``[E, 32 G, R]`` bf16) with
``transformers.integrations.mxfp4.convert_moe_packed_tensors`` (baseline), with
:func:`lightning_memkit.loading.dequantize_mxfp4` returning a new tensor, and with it writing into an
existing parameter (``out=``). Part 2 loads a synthetic multi-layer MoE checkpoint (written to a temporary
directory) into a model created on the meta device: naive (``safetensors.torch.load_file`` of everything,
dequantize every pair, ``load_state_dict(assign=True)``), the same file dict consumed by
:func:`stream_dequantize`, and :func:`load_mxfp4_into` reading one tensor at a time, with its default memory
report (``measure=True``: a ``LivePeak`` and a ``HostRSS`` around the load) and without it.

    python -m benchmarks.run --only mxfp4 [--quick] [--device cuda]
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from benchmarks.common import mib, peak_of, record, sync
from lightning_memkit.loading import dequantize_mxfp4, load_mxfp4_into, stream_dequantize
from lightning_memkit.loading.mxfp4 import chunk_transient_bytes, default_rows_per_chunk

try:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    BASELINE = "transformers convert_moe_packed_tensors"
except ImportError:  # transformers is optional: fall back to the same whole-tensor method, written here
    convert_moe_packed_tensors = None
    BASELINE = "whole-tensor dequantize (int64 nibble indices, transformers not installed)"

FP4 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def whole_tensor(blocks: torch.Tensor, scales: torch.Tensor, dtype=torch.bfloat16) -> torch.Tensor:
    """The baseline: transformers' function when installed, else the same whole-tensor method."""
    if convert_moe_packed_tensors is not None:
        return convert_moe_packed_tensors(blocks, scales, dtype=dtype)
    lut = torch.tensor(FP4, dtype=dtype, device=blocks.device)
    *lead, rows, groups, nb = blocks.shape
    out = torch.empty(*lead, rows, groups, nb * 2, dtype=dtype, device=blocks.device)
    out[..., 0::2] = lut[(blocks & 0x0F).long()]
    out[..., 1::2] = lut[(blocks >> 4).long()]
    torch.ldexp(out, (scales.int() - 127).unsqueeze(-1), out=out)
    return out.reshape(*lead, rows, groups * nb * 2).transpose(-1, -2).contiguous()


def _interleaved(fns: dict[str, callable], device: str, repeat: int) -> dict[str, tuple[float, float]]:
    """Median (wall, process CPU) seconds per function, run in turn each round (fairer on a busy machine)."""
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in fns}
    for fn in fns.values():  # warm-up
        fn()
    for _ in range(repeat):
        for name, fn in fns.items():
            sync(device)
            w0, c0 = time.perf_counter(), time.process_time()
            fn()
            sync(device)
            times[name].append((time.perf_counter() - w0, time.process_time() - c0))
    median = lambda xs: sorted(xs)[len(xs) // 2]
    return {name: (median([w for w, _ in ts]), median([c for _, c in ts])) for name, ts in times.items()}


def _time_columns(seconds: dict[str, tuple[float, float]], name: str, baseline: str) -> dict[str, float]:
    (wall, cpu), (base_wall, base_cpu) = seconds[name], seconds[baseline]
    return {"wall_time_vs_baseline": round(wall / base_wall, 3), "cpu_time_vs_baseline": round(cpu / base_cpu, 3)}


# -- part 1: one expert tensor -----------------------------------------------------------------------------
def one_tensor(device: str, quick: bool) -> dict:
    experts, rows, groups = (2, 512, 16) if quick else (4, 2880, 90)
    repeat = 3
    torch.manual_seed(0)
    blocks = torch.randint(0, 256, (experts, rows, groups, 16), dtype=torch.uint8, device=device)
    scales = torch.randint(110, 140, (experts, rows, groups), dtype=torch.uint8, device=device)
    param = torch.empty(experts, groups * 32, rows, dtype=torch.bfloat16, device=device)
    out_bytes = param.numel() * param.element_size()
    fns = {
        BASELINE: lambda: whole_tensor(blocks, scales),
        "memkit dequantize_mxfp4": lambda: dequantize_mxfp4(blocks, scales),
        "memkit dequantize_mxfp4(out=param)": lambda: dequantize_mxfp4(blocks, scales, out=param),
    }
    assert torch.equal(fns[BASELINE](), fns["memkit dequantize_mxfp4"]())  # same bits before timing anything
    seconds = _interleaved(fns, device, repeat)
    rows_out = []
    for name, fn in fns.items():
        peak = peak_of(fn, device=device)
        rows_out.append({"impl": name, "peak_bytes": peak, "peak_MiB": mib(peak),
                         "peak_vs_output": round(peak / out_bytes, 3), **_time_columns(seconds, name, BASELINE)})
    rpc = default_rows_per_chunk(blocks.shape, torch.bfloat16)
    rpc_out = default_rows_per_chunk(blocks.shape, torch.bfloat16, into_out=True)
    chunk = chunk_transient_bytes(rpc_out, groups, torch.bfloat16)
    met = rows_out[1]["peak_vs_output"] <= 1.1 and rows_out[2]["peak_bytes"] <= chunk + 64 * 1024
    case = (f"{experts} x {groups * 32} x {rows} bf16 output ({mib(out_bytes)} MiB) from blocks "
            f"[{experts}, {rows}, {groups}, 16]; default chunks of {rpc} rows (new tensor), {rpc_out} rows (out=)")
    goal = "memkit standalone peak <= 1.1x output bytes; into a parameter <= one chunk's temporaries"
    return record("mxfp4 dequantize one expert tensor", case, BASELINE, rows_out, goal, met)


# -- part 2: a whole checkpoint ------------------------------------------------------------------------------
class _Experts(nn.Module):
    def __init__(self, e: int, h: int, i: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(e, h, 2 * i, dtype=torch.bfloat16))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(e, 2 * i, dtype=torch.bfloat16))
        self.down_proj = nn.Parameter(torch.empty(e, i, h, dtype=torch.bfloat16))
        self.down_proj_bias = nn.Parameter(torch.empty(e, h, dtype=torch.bfloat16))


class _Layer(nn.Module):
    def __init__(self, e: int, h: int, i: int):
        super().__init__()
        self.router = nn.Linear(h, e, dtype=torch.bfloat16)
        self.experts = _Experts(e, h, i)


class _MoE(nn.Module):
    def __init__(self, layers: int, e: int, h: int, i: int):
        super().__init__()
        self.layers = nn.ModuleList(_Layer(e, h, i) for _ in range(layers))


def _write_checkpoint(path: Path, layers: int, e: int, h: int, i: int) -> None:
    tensors = {}
    for n in range(layers):
        p = f"layers.{n}"
        tensors[f"{p}.router.weight"] = torch.randn(e, h).bfloat16()
        tensors[f"{p}.router.bias"] = torch.randn(e).bfloat16()
        for name, (inp, outp) in {"gate_up_proj": (h, 2 * i), "down_proj": (i, h)}.items():
            tensors[f"{p}.experts.{name}_blocks"] = torch.randint(0, 256, (e, outp, inp // 32, 16), dtype=torch.uint8)
            tensors[f"{p}.experts.{name}_scales"] = torch.randint(118, 134, (e, outp, inp // 32), dtype=torch.uint8)
            tensors[f"{p}.experts.{name}_bias"] = torch.randn(e, outp).bfloat16()
    save_file(tensors, path)


def whole_checkpoint(device: str, quick: bool) -> dict:
    layers, e, h, i = (3, 2, 256, 256) if quick else (4, 4, 1024, 1024)
    repeat = 2
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.safetensors"
        _write_checkpoint(path, layers, e, h, i)

        def meta_model() -> _MoE:
            with torch.device("meta"):
                return _MoE(layers, e, h, i)

        def naive():
            sd = load_file(path, device=device)
            for key in [k for k in sd if k.endswith("_blocks")]:
                base = key[: -len("_blocks")]
                sd[base] = whole_tensor(sd[key], sd[base + "_scales"])
            for key in [k for k in sd if k.endswith(("_blocks", "_scales"))]:
                del sd[key]
            model = meta_model()
            model.load_state_dict(sd, assign=True)
            return model

        def streamed():
            model = meta_model()
            sd = load_file(path, device=device)
            model.load_state_dict(dict(stream_dequantize(sd)), assign=True)
            return model

        def memkit(measure: bool = True):
            model = meta_model()
            load_mxfp4_into(model, path, device=device, measure=measure)
            return model

        fns = {"naive load_file + dequantize all": naive, "memkit load_file + stream_dequantize": streamed,
               "memkit load_mxfp4_into": memkit,
               "memkit load_mxfp4_into(measure=False)": lambda: memkit(measure=False)}
        reference = naive().state_dict()
        for fn in list(fns.values())[1:]:
            assert all(torch.equal(reference[k], v) for k, v in fn().state_dict().items())
        model_bytes = sum(t.numel() * t.element_size() for t in reference.values())
        del reference
        seconds = _interleaved(fns, device, repeat)
        rows = []
        for name, fn in fns.items():
            peak = peak_of(fn, device=device)
            rows.append({"impl": name, "peak_bytes": peak, "peak_MiB": mib(peak),
                         "peak_vs_model": round(peak / model_bytes, 3),
                         **_time_columns(seconds, name, "naive load_file + dequantize all")})
        packed = (2 * i * (h // 32) + h * (i // 32)) * e * 17  # largest layer's blocks + scales, both weights
        largest = max(e * 2 * i * (h // 32) * 17, e * h * (i // 32) * 17)
        groups = max(h, i) // 32
        rpc = default_rows_per_chunk((e, 2 * i, groups, 16), torch.bfloat16, into_out=True)
        bound = model_bytes + largest + chunk_transient_bytes(rpc, groups, torch.bfloat16, moved=True) + 64 * 1024
        met = rows[2]["peak_bytes"] <= bound and rows[3]["peak_bytes"] <= bound
    case = (f"{layers} layers x {e} experts, hidden {h}, intermediate {i}: {mib(model_bytes)} MiB of bf16 "
            f"weights, {mib(packed * layers)} MiB packed expert tensors, one .safetensors file")
    goal = "memkit load peak <= model bytes + the largest single blocks/scales pair + one chunk (+ 64 KiB tables)"
    return record("mxfp4 whole-checkpoint load", case, "naive load_file + dequantize all", rows, goal, met)


def run(device: str = "cpu", quick: bool = False) -> list[dict]:
    return [one_tensor(device, quick), whole_checkpoint(device, quick)]
