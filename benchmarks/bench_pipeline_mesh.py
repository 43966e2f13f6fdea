"""Pipeline x data parallel on a 2-D mesh: per-rank peak memory, predicted and measured, and throughput.

A 2-stage 1F1B pipeline (the model of ``bench_pipeline_partition``: an embedding and an LM head around MLP
blocks) trained on CPU by gloo processes, one per rank:

* ``PP=2 x DP=1``: 2 processes, one pipeline;
* ``PP=2 x DP=2 (DDP)``: 4 processes, two replicas of the pipeline on a (dp, pp) mesh, each on its own shard of
  a global batch twice as large (the same batch per replica); before the optimizer step every rank averages its
  gradients over its replica group with ``average_gradients`` (25 MiB buckets), as ``MemkitPipelineStrategy``;
* ``PP=2 x DP=2 (FSDP)``: the same mesh with each stage sharded over the replicas (FSDP2, each layer one unit),
  split and predicted with ``sharded=True``. Recorded as not available where ``data_parallel='fsdp'`` is refused
  or fails.

Each split is :func:`lightning_memkit.pipeline.partition_layers` on layer costs measured on one microbatch, with
``data_parallel_size`` set to the replicas (and ``sharded=True`` for FSDP); it predicts each rank's peak.
Measured per rank: ``LivePeak`` over a steady-state step (parameters and optimizer state included), the larger over
the replicas of a pipeline rank; throughput: global batch / wall time per step. Cases (AdamW unless named): ranks
that peak in the activations of the schedule (the all-reduce buffer changes nothing); gradients that outweigh the
activations (the buffer of all of a rank's gradients raises its peak); an embedding and a head whose gradients exceed
the 25 MiB bucket (each is reduced alone), with AdamW (whose one-parameter-at-a-time step holds two temporaries of
the largest parameter plus one of the previous: the step is the peak) and with SGD (momentum 0.9: a step without
temporaries, so the all-reduce buffer alone decides the peak of the step). Goal: every predicted rank peak within 5%
of the measured one.
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
from lightning_memkit.pipeline import measure_layer_costs, partition_layers

ROOT = Path(__file__).resolve().parent.parent
PP, DP = 2, 2
CASES = {
    "activations dominate": {"vocab": 4096, "dim": 64, "blocks": 8, "seq": 64, "batch": 8, "microbatches": 4},
    "gradients dominate": {"vocab": 2048, "dim": 256, "blocks": 6, "seq": 32, "batch": 4, "microbatches": 4},
    "embedding and head gradients over the 25 MiB bucket": {
        "vocab": 32768, "dim": 256, "blocks": 4, "seq": 32, "batch": 4, "microbatches": 4},
    "embedding and head gradients over the 25 MiB bucket, SGD": {
        "vocab": 32768, "dim": 256, "blocks": 4, "seq": 32, "batch": 4, "microbatches": 4, "optimizer": "sgd"},
}
OPTIMIZERS = {"adamw": ("AdamW", {}), "sgd": ("SGD with momentum 0.9", {"momentum": 0.9})}
QUICK = ("gradients dominate",)
GOAL = "every predicted rank peak within 5% of the measured one (DP=1, DDP and FSDP)"
TOLERANCE = 0.05


def _launch(config: dict, sizes: tuple[int, ...], world: int, mode: str) -> list[dict] | str:
    """Per-rank results of one ``world``-process run, or the tail of the output of a run that failed."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tempfile.mkdtemp(prefix="bench_pipeline_mesh_")
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
        cmd = [sys.executable, "-m", "benchmarks._pipeline_mesh_worker", f"{out}/rank-RANK.json", json.dumps(config),
               json.dumps(list(sizes)), mode]
        procs.append(subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    failure = ""
    for p in procs:
        try:
            text, _ = p.communicate(timeout=200)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            return "timed out"
        if p.returncode and not failure:
            lines = [line for line in text.strip().splitlines() if line.strip()]
            failure = lines[-1] if lines else f"exit code {p.returncode}"
    if failure:
        return failure
    return [json.loads(Path(f"{out}/rank-{r}.json").read_text()) for r in range(world)]


def _fsdp_refusal() -> str | None:
    """Why ``data_parallel='fsdp'`` cannot run here, or ``None``."""
    from lightning_memkit.pipeline.config import PipelineConfig

    try:
        PipelineConfig(data_parallel="fsdp", pipeline_parallel_size=PP)
    except (NotImplementedError, ValueError) as err:
        return f"{type(err).__name__}: {err}"
    try:
        from lightning_memkit.pipeline.sharding import shard_stage_modules  # noqa: F401
    except ImportError as err:
        return f"ImportError: {err}"
    return None


def _row(name: str, config: dict, dp: int, sizes, results: list[dict], predicted=None) -> dict:
    peaks = [max(results[replica * PP + r]["peak"] for replica in range(dp)) for r in range(PP)]
    seconds = max(r["seconds_per_step"] for r in results)
    row = {"impl": name, "layers per stage": "/".join(map(str, sizes))}
    for r in range(PP):
        row[f"rank {r} measured (bytes)"] = peaks[r]
    for r in range(PP):
        row[f"rank {r} predicted (bytes)"] = predicted[r] if predicted is not None else "not modeled"
    row["max error (%)"] = (
        round(100 * max(abs(p / m - 1) for p, m in zip(predicted, peaks)), 3) if predicted is not None else "n/a")
    row["samples/s"] = round(config["batch"] * dp / seconds, 1)
    return row


def _relative(rows: list[dict]) -> None:
    """Add each row's largest rank peak over that of the first row (DP=1)."""
    def top(row):
        return max(row.get(f"rank {r} measured (bytes)", 0) for r in range(PP))

    base = top(rows[0])
    for row in rows:
        if base and top(row):
            row["max peak vs DP=1"] = round(top(row) / base, 3)


def _case(title: str, config: dict, device: str, timed_steps: int) -> dict:
    x, y = batch(**config)
    mb = config["batch"] // config["microbatches"]
    optimizer = config.get("optimizer", "adamw")
    label, hyperparams = OPTIMIZERS[optimizer]
    costs = measure_layer_costs(layers(**config), x[:mb].to(device), loss_fn=lm_loss, target=y[:mb].to(device),
                                optimizer=optimizer, **hyperparams)
    kw = {"schedule": "1f1b", "microbatches": config["microbatches"]}
    run = {**config, "timed_steps": timed_steps}
    rows, errors = [], []
    for dp, name in ((1, "PP=2 x DP=1"), (DP, f"PP=2 x DP={DP} (DDP)")):
        part = partition_layers(costs, PP, data_parallel_size=dp, **kw)
        results = _launch(run, part.sizes, PP * dp, "ddp")
        if isinstance(results, str):
            rows.append({"impl": name, "layers per stage": "/".join(map(str, part.sizes)), "status": results})
            errors.append(1.0)
            continue
        rows.append(_row(name, config, dp, part.sizes, results, part.predicted_peak_bytes))
        errors.append(rows[-1]["max error (%)"] / 100)
    fsdp = f"PP=2 x DP={DP} (FSDP)"
    refusal = _fsdp_refusal()
    part = partition_layers(costs, PP, data_parallel_size=DP, sharded=True, **kw)
    results = refusal or _launch(run, part.sizes, PP * DP, "fsdp")
    if isinstance(results, str):
        rows.append({"impl": fsdp, "status": f"not available: {results}"})
        errors.append(1.0)
    else:
        rows.append(_row(fsdp, config, DP, part.sizes, results, part.predicted_peak_bytes))
        errors.append(rows[-1]["max error (%)"] / 100)
    _relative(rows)
    case = (
        f"{title}: 1F1B, {PP} stages, {config['microbatches']} microbatches, {label}; embedding+head "
        f"{config['vocab']}x{config['dim']}, {config['blocks']} blocks of width {config['dim']}; {config['batch']}x"
        f"{config['seq']} tokens per replica; gloo processes on {os.cpu_count()} CPU cores"
    )
    return record("pipeline_mesh", case, "PP=2 x DP=1", rows, GOAL, max(errors) <= TOLERANCE)


def run(device: str = "cpu", quick: bool = False) -> list[dict]:
    if device != "cpu":
        raise ValueError(f"device={device!r}: this benchmark runs gloo processes on CPU; run it with --device cpu")
    names = QUICK if quick else tuple(CASES)
    return [_case(name, CASES[name], device, 3 if quick else 10) for name in names]
