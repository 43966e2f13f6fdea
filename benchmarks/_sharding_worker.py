"""One rank of the FSDP2 estimate checks (benchmarks/bench_sharding.py, tests/sharding/test_fsdp2_estimate.py): each
case of ``benchmarks.sharding_cases`` built as the estimate builds it, sharded over the gloo ranks as ``memkit_fsdp2``
shards it, four AdamW steps in Lightning's order; the per-phase live-byte peaks of a steady step (the median of steps 2
to 4 per phase: a gloo worker thread that frees a collective's buffer a moment early or late moves one step's peak by a
unit's bytes; ``LivePeak`` from before the model is built, FSDP2's resizes counted) and its host peak written to
``OUT/rank{r}.json``; the Llama cases again with FSDP2's CPU offload, its host bytes placed as on a GPU; the Llama and
the Qwen3-MoE again with their MLPs tiled (``tiled_mlps``, as the ``TiledMLP`` callback runs them).

    LOCAL_RANK=r WORLD_SIZE=N MASTER_ADDR=127.0.0.1 MASTER_PORT=p python -m benchmarks._sharding_worker OUT
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parents[1]))
from benchmarks import sharding_cases as fsdp2_cases  # noqa: E402
from lightning_memkit.estimate.levers.sharding import shard_transform  # noqa: E402
from lightning_memkit.estimate.step import build_model, default_dtype, precision_dtype  # noqa: E402
from lightning_memkit.memory import LivePeak  # noqa: E402
from lightning_memkit.recompute.tiled_mlp import tiled_mlps  # noqa: E402
from lightning_memkit.sharding import visible_resizes  # noqa: E402
from lightning_memkit.sharding.offload import offloaded_like_a_gpu_run, steps_on_host  # noqa: E402

warnings.filterwarnings("ignore")
torch.set_num_threads(1)


def steady_step(model: torch.nn.Module, live: LivePeak, precision: str, offload: bool = False) -> dict[str, int]:
    def adamw(m: torch.nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-3)

    optim = (steps_on_host(adamw) if offload else adamw)(model)
    steps: list[dict[str, int]] = []

    def mark(phase: str) -> None:
        steps[-1][phase] = live.peak_bytes
        steps[-1]["host"] = max(steps[-1]["host"], live.host_peak_bytes)
        live.reset_peak()

    for _ in range(4):
        steps.append({"host": 0})
        live.reset_peak()
        batch = fsdp2_cases.batch()  # alive through the step, as Lightning's loop keeps it
        with default_dtype(precision_dtype(precision)):  # as Lightning's forward context
            loss = model(**batch).loss
        mark("forward")
        optim.zero_grad(set_to_none=True)
        loss.backward()
        del loss
        mark("backward")
        optim.step()
        mark("optimizer step")
    del optim
    return {key: sorted(step[key] for step in steps[1:])[1] for key in steps[0]}


def _measured(case: str, mesh: Any, variant: str = "") -> dict[str, int]:
    """:func:`steady_step` of ``case`` sharded over ``mesh``: as given (``""``), with FSDP2's CPU offload, its host
    bytes placed as a GPU run places them (``"offloaded"``), or with its MLPs tiled (``"tiled"``)."""
    precision, offload = fsdp2_cases.CASES[case][1], variant == "offloaded"
    with visible_resizes(), LivePeak() as live:
        model = shard_transform(build_model(fsdp2_cases.model_factory(case), precision), mesh=mesh, offload=offload)
        around = (offloaded_like_a_gpu_run(model) if offload
                  else tiled_mlps(model, fsdp2_cases.TILE) if variant == "tiled" else contextlib.nullcontext())
        with around:
            result = steady_step(model, live, precision, offload=offload)
        del model, around
    return result


def main(out: Path) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    rank, world = int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", 0))), int(os.environ["WORLD_SIZE"])
    os.environ["RANK"] = str(rank)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    results = {case: _measured(case, mesh) for case in fsdp2_cases.CASES}
    results |= {f"{case} offloaded": _measured(case, mesh, "offloaded") for case in fsdp2_cases.OFFLOADED}
    results |= {f"{case} tiled": _measured(case, mesh, "tiled") for case in fsdp2_cases.TILED}
    (out / f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
