"""One rank of the FSDP2 estimate checks (benchmarks/bench_sharding.py, tests/sharding/test_fsdp2_estimate.py): each
case of ``benchmarks.sharding_cases`` built
as the estimate builds it, sharded over the gloo ranks as ``memkit_fsdp2`` shards it, two AdamW steps in Lightning's
order; the per-phase live-byte peaks of the second step (``LivePeak`` from before the model is built, FSDP2's resizes
counted) written to ``OUT/rank{r}.json``.

    LOCAL_RANK=r WORLD_SIZE=N MASTER_ADDR=127.0.0.1 MASTER_PORT=p python -m benchmarks._sharding_worker OUT
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parents[1]))
from benchmarks import sharding_cases as fsdp2_cases  # noqa: E402
from lightning_memkit.estimate.levers.sharding import shard_transform  # noqa: E402
from lightning_memkit.estimate.step import build_model, default_dtype, precision_dtype  # noqa: E402
from lightning_memkit.memory import LivePeak  # noqa: E402
from lightning_memkit.sharding import visible_resizes  # noqa: E402

warnings.filterwarnings("ignore")
torch.set_num_threads(1)


def second_step(model: torch.nn.Module, live: LivePeak, precision: str) -> dict[str, int]:
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    phases = {}
    for step in range(2):
        record = step == 1
        if record:
            live.reset_peak()
        with default_dtype(precision_dtype(precision)):  # as Lightning's forward context
            loss = model(**fsdp2_cases.batch()).loss
        phases["forward"] = live.peak_bytes
        optim.zero_grad(set_to_none=True)
        live.reset_peak()
        loss.backward()
        del loss
        phases["backward"] = live.peak_bytes
        live.reset_peak()
        optim.step()
        phases["optimizer step"] = live.peak_bytes
    del optim
    return phases


def main(out: Path) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    rank, world = int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", 0))), int(os.environ["WORLD_SIZE"])
    os.environ["RANK"] = str(rank)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    results = {}
    for case, (_, precision, _) in fsdp2_cases.CASES.items():
        with visible_resizes(), LivePeak() as live:
            model = shard_transform(build_model(fsdp2_cases.model_factory(case), precision), mesh=mesh)
            results[case] = second_step(model, live, precision)
            del model
    (out / f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
