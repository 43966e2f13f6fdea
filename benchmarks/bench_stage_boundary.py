"""Stage-boundary release on a mixture-of-experts layer, and the padded row gather it dispatches with.

* MoE layer forward+backward peak with and without ``stage_boundary`` release (``LivePeak`` on CPU,
  ``max_memory_allocated`` on CUDA), for fine-grained experts (Qwen3-30B-A3B ratios: expert hidden 3/8
  of the width, 8 of the experts per token) and coarse ones (Mixtral ratios: hidden 3.5x, top-2), with
  the expert-parallel exchange (a new buffer; "plain": the stage tensors die with the forward's locals,
  "held": a stage-wise schedule keeps them until backward) and with expert parallelism off (identity
  exchange: the check refuses, nothing is released). Time is a ratio against no release (CPU: process
  CPU time, see ``_paired_times``).
* Whole TinyMoE forward+backward peak with and without release.
* Input bytes a row gather keeps for backward, and its fwd+bwd time against ``torch.gather``.
* Allocation sizes requested across microbatches with varying routed-token counts (CUDA: the allocator's
  own trace and ``cudaMalloc`` count; CPU: the storage sizes only).
"""

from __future__ import annotations

import contextlib
import time

import torch

from benchmarks.common import mib, peak_of, record, sync
from lightning_memkit.demo import TinyMoE
from lightning_memkit.demo.moe import MoEFeedForward
from lightning_memkit.memory import LivePeak, release_stage_boundaries
from lightning_memkit.ops import padded_index_gather

CONFIGS = {
    # name: (tokens, d_model, n_experts, top_k, d_expert)
    "fine-grained": (1024, 128, 32, 8, 48),
    "coarse": (2048, 128, 8, 2, 448),
}


def _paired_times(fns: dict, device: str, repeat: int) -> dict:
    """Median time of each function, runs interleaved so that load changes hit all of them alike.

    CUDA: wall time. CPU: the process's CPU time, which other processes on a shared machine do not inflate.
    """
    clock = time.perf_counter if device.startswith("cuda") else time.process_time
    for fn in fns.values():
        fn()
    samples: dict = {k: [] for k in fns}
    for _ in range(repeat):
        for k, fn in fns.items():
            sync(device)
            t0 = clock()
            fn()
            sync(device)
            samples[k].append(clock() - t0)
    return {k: sorted(v)[len(v) // 2] for k, v in samples.items()}


def _layer_step(cfg, exchange: str, held: bool, release: bool, device: str):
    t, d, e, k, h = cfg
    torch.manual_seed(0)
    layer = MoEFeedForward(d, n_experts=e, top_k=k, d_expert=h, exchange=exchange, pad_to_multiple=1024).to(device)
    x = torch.randn(t, d, device=device, requires_grad=True)
    g = torch.randn(t, d, device=device)

    def step():
        ctx = release_stage_boundaries() if release else contextlib.nullcontext()
        with ctx:
            keep = [] if held else None
            y = layer(x, keep=keep)
            ((y * g).sum() + layer.aux_loss).backward()
            del y, keep
        layer.zero_grad(set_to_none=True)
        x.grad = None

    return step


def _moe_layer(device: str, quick: bool) -> list[dict]:
    out = []
    cases = [("fine-grained", "copy", False), ("fine-grained", "copy", True), ("coarse", "copy", False),
             ("coarse", "copy", True), ("fine-grained", "identity", False)]
    for name, exchange, held in cases:
        cfg = CONFIGS[name]
        if quick:
            cfg = (cfg[0] // 2, *cfg[1:])
        steps = {r: _layer_step(cfg, exchange, held, r, device) for r in (False, True)}
        peaks = {r: peak_of(steps[r], device=device) for r in (False, True)}
        times = _paired_times(steps, device, repeat=3 if quick else 5)
        reduction = 1 - peaks[True] / peaks[False]
        rows = [
            {"impl": impl, "peak_bytes": peaks[r], "peak_mib": mib(peaks[r]),
             "peak_ratio": round(peaks[r] / peaks[False], 3), "time_ratio": round(times[r] / times[False], 3)}
            for impl, r in (("no release", False), ("stage_boundary release", True))
        ]
        t, d, e, k, h = cfg
        case = (f"MoE layer fwd+bwd, {name} (tokens={t}, d={d}, experts={e}, top_k={k}, d_expert={h}), "
                f"exchange={exchange}, stage tensors {'held until backward' if held else 'plain'}")
        if name == "fine-grained" and exchange == "copy":
            out.append(record("stage_boundary", case, "same layer without release", rows,
                              goal="peak reduced by >= 25%", met=reduction >= 0.25))
        else:
            out.append(record("stage_boundary", case, "same layer without release", rows))
    return out


def _tiny_moe(device: str, quick: bool) -> dict:
    batch = 8 if quick else 16
    rows, peaks, steps = [], {}, {}
    for release in (False, True):
        torch.manual_seed(0)
        model = TinyMoE(exchange="copy").to(device)
        x = torch.randint(0, 256, (batch, 128), device=device)

        def step(model=model, x=x, release=release):
            ctx = release_stage_boundaries() if release else contextlib.nullcontext()
            with ctx:
                loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten()) + 0.01 * model.aux_loss()
                loss.backward()
            model.zero_grad(set_to_none=True)

        peaks[release] = peak_of(step, device=device)
        steps[release] = step
    times = _paired_times(steps, device, repeat=3)
    for impl, r in (("no release", False), ("stage_boundary release", True)):
        rows.append({"impl": impl, "peak_bytes": peaks[r], "peak_mib": mib(peaks[r]),
                     "peak_ratio": round(peaks[r] / peaks[False], 3), "time_ratio": round(times[r] / times[False], 3)})
    return record("stage_boundary", f"TinyMoE (defaults, exchange=copy) fwd+bwd, batch {batch}x128",
                  "same model without release", rows)


def _retained(fn, n: int, d: int, device: str) -> int:
    """Bytes of its input that a gather keeps alive for backward (input created in the block, then dropped)."""
    idx = torch.randint(0, n, (2 * n,), device=device)
    if device.startswith("cuda"):
        x = torch.randn(n, d, device=device, requires_grad=True) * 1
        y = fn(x, idx)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        del x
        kept = n * d * 4 - (before - torch.cuda.memory_allocated())
        del y
        return kept
    with LivePeak() as lp:
        x = torch.randn(n, d, device=device, requires_grad=True) * 1
        y = fn(x, idx)
        before = lp.live_bytes
        del x
        kept = n * d * 4 - (before - lp.live_bytes)
        del y
    return kept


def _gather(device: str, quick: bool) -> list[dict]:
    n, d = (4096, 128) if quick else (16384, 256)
    fns = {
        "torch.gather": lambda x, i: torch.gather(x, 0, i[:, None].expand(-1, x.shape[1])),
        "x[index]": lambda x, i: x[i],
        "padded_index_gather": lambda x, i: padded_index_gather(x, i, 1024),
    }
    x = torch.randn(n, d, device=device, requires_grad=True)
    idx = torch.randint(0, n, (2 * n,), device=device)
    g = torch.randn(2 * n, d, device=device)

    def fwd_bwd(fn):
        def run():
            fn(x, idx).backward(g)
            x.grad = None
        return run

    times = _paired_times({k: fwd_bwd(f) for k, f in fns.items()}, device, repeat=5)
    rows = [{"impl": k, "input_bytes": n * d * 4, "retained_input_bytes": _retained(f, n, d, device),
             "time_ratio": round(times[k] / times["torch.gather"], 3)} for k, f in fns.items()]
    ours = rows[-1]
    goal = (f"padded_index_gather retains 0 input bytes ({ours['retained_input_bytes']:,}) and takes <= 1.1x "
            f"torch.gather's time ({ours['time_ratio']}x)")
    return [record("stage_boundary", f"row gather fwd+bwd, input {n}x{d} fp32, {2 * n} rows gathered",
                   "torch.gather (time)", rows, goal=goal,
                   met=ours["retained_input_bytes"] == 0 and ours["time_ratio"] <= 1.1)]


def _allocator(device: str, quick: bool) -> list[dict]:
    d = 256
    x = torch.randn(8192, d, device=device)
    counts = [4096 + 97 * i for i in range(24 if not quick else 12)]
    rows = []
    for multiple in (1, 1024):
        sizes, allocs, reserved = set(), None, None
        if device.startswith("cuda"):
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            start = torch.cuda.memory_stats().get("num_device_alloc", 0)
            torch.cuda.memory._record_memory_history(max_entries=100_000)
        for n in counts:
            idx = torch.randint(0, 8192, (n,), device=device)
            y = padded_index_gather(x, idx, multiple)
            sizes.add(y.untyped_storage().nbytes())
            del y
        row = {"impl": f"pad_to_multiple={multiple}", "microbatches": len(counts), "distinct_storage_sizes": len(sizes)}
        if device.startswith("cuda"):
            torch.cuda.synchronize()
            snap = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
            trace = snap["device_traces"][torch.cuda.current_device()]
            requested = {e["size"] for e in trace if e["action"] == "alloc" and e["size"] >= counts[0] * d * 4}
            allocs = torch.cuda.memory_stats().get("num_device_alloc", 0) - start
            reserved = torch.cuda.memory_reserved()
            row.update({"distinct_requested_sizes": len(requested), "cudaMalloc_calls": allocs,
                        "reserved_bytes": reserved})
        rows.append(row)
    return [record("stage_boundary", f"output allocations over {len(counts)} microbatches, {counts[0]}..{counts[-1]} "
                   f"routed rows of {d} fp32", "pad_to_multiple=1 (exact sizes)", rows)]


def run(device: str = "cpu", quick: bool = False) -> list[dict]:
    torch.manual_seed(0)
    return [*_moe_layer(device, quick), _tiny_moe(device, quick), *_gather(device, quick), *_allocator(device, quick)]
