"""Per-rank peak memory of a pipeline split by memkit, by equal layer counts and by equal parameters.

Model: a large embedding and LM head (``vocab x dim`` each) around narrow MLP blocks, trained with AdamW
under 1F1B on 4 stages with 8 microbatches. Three contiguous splits of the same layers:

* ``memkit``: :func:`lightning_memkit.pipeline.partition_layers` on costs measured on one microbatch;
* ``uniform``: equal layer counts (torchtitan, DeepSpeed ``"uniform"``);
* ``parameters``: equal trainable parameter bytes per stage (DeepSpeed ``"parameters"``).

Reported per split: the predicted per-rank peaks (cost model, layer costs measured on ``device``) and,
on CPU, the measured ones (``LivePeak`` on each of 4 gloo processes, a steady-state step, parameters and
optimizer state included), as the largest
rank peak, the mean and their ratio ``max/mean`` (1.0 = every rank equally full). Goal: memkit's
``max/mean <= 1.05`` and strictly below both baselines.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks._pipeline_partition_worker import batch, layers, lm_loss
from benchmarks.common import record
from lightning_memkit.pipeline import (
    measure_layer_costs,
    parameter_balanced_partition,
    partition_layers,
    uniform_partition,
)

ROOT = Path(__file__).resolve().parent.parent
FULL = {"vocab": 4096, "dim": 64, "blocks": 30, "seq": 64, "batch": 32, "microbatches": 8}
QUICK = {"vocab": 2048, "dim": 64, "blocks": 22, "seq": 64, "batch": 32, "microbatches": 8}
RANKS = 4
GOAL = "memkit max/mean <= 1.05 and strictly below uniform and parameters"


def _splits(config: dict, device: str) -> dict:
    x, y = (t.to(device) for t in batch(**config))
    mb = config["batch"] // config["microbatches"]
    model = layers(**config).to(device)
    costs = measure_layer_costs(model, x[:mb], loss_fn=lm_loss, target=y[:mb], optimizer="adamw")
    kw = {"schedule": "1f1b", "microbatches": config["microbatches"]}
    return {
        "memkit": partition_layers(costs, RANKS, **kw),
        "uniform": uniform_partition(costs, RANKS, **kw),
        "parameters": parameter_balanced_partition(costs, RANKS, **kw),
    }


def _measure(config: dict, splits: dict) -> dict[str, list[int]] | None:
    """Per-rank measured peaks of each split from one 4-process run; ``None`` if the run failed."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tempfile.mkdtemp(prefix="bench_pipeline_")
    sizes = json.dumps([list(p.sizes) for p in splits.values()])
    procs = []
    for rank in range(RANKS):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(RANKS), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   PYTHONPATH=str(ROOT))
        cmd = [sys.executable, "-m", "benchmarks._pipeline_partition_worker", f"{out}/rank-RANK.json",
               json.dumps(config), sizes]
        procs.append(subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    ok = True
    for p in procs:
        try:
            ok &= p.wait(timeout=150) == 0
        except subprocess.TimeoutExpired:
            ok = False
            for q in procs:
                q.kill()
    if not ok:
        return None
    per_rank = [json.loads(Path(f"{out}/rank-{r}.json").read_text()) for r in range(RANKS)]
    return {name: [per_rank[r][i] for r in range(RANKS)] for i, name in enumerate(splits)}


def _rows(peaks: dict[str, list[int]], splits: dict) -> tuple[list[dict], bool]:
    rows = []
    for name, values in peaks.items():
        mean = sum(values) / len(values)
        rows.append({
            "impl": name,
            "layers per stage": "/".join(map(str, splits[name].sizes)),
            "max rank peak (bytes)": max(values),
            "mean rank peak (bytes)": round(mean),
            "max/mean": round(max(values) / mean, 3),
            "max vs uniform": round(max(values) / max(peaks["uniform"]), 3),
        })
    ratio = {r["impl"]: r["max/mean"] for r in rows}
    met = ratio["memkit"] <= 1.05 and ratio["memkit"] < min(ratio["uniform"], ratio["parameters"])
    return rows, met


def run(device: str = "cpu", quick: bool = False) -> list[dict]:
    config = QUICK if quick else FULL
    splits = _splits(config, device)
    case = (
        f"1F1B, {RANKS} stages, {config['microbatches']} microbatches, AdamW; embedding+head {config['vocab']}x"
        f"{config['dim']}, {config['blocks']} blocks of width {config['dim']}, batch {config['batch']}x{config['seq']}"
    )
    predicted = {name: list(p.predicted_peak_bytes) for name, p in splits.items()}
    rows, met = _rows(predicted, splits)
    entries = [record("pipeline_partition", f"predicted (cost model): {case}", "uniform", rows, GOAL, met)]
    # the measured run is 4 CPU processes over gloo: only on CPU (4 GPUs per node would be needed otherwise)
    measured = _measure(config, splits) if device == "cpu" else None
    if measured is not None:
        rows, met = _rows(measured, splits)
        entries.append(record("pipeline_partition", f"measured (LivePeak, 4 gloo processes): {case}", "uniform",
                              rows, GOAL, met))
    return entries
