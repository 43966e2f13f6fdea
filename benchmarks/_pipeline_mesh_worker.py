"""One rank of ``bench_pipeline_mesh``: a 2-stage pipeline on a (dp, pp) mesh of gloo processes (pure torch).

    RANK=0 WORLD_SIZE=4 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 \\
        python -m benchmarks._pipeline_mesh_worker OUT.json '{"vocab": 4096, ...}' '[6, 4]' ddp

Each step does what ``MemkitPipelineStrategy(pipeline_parallel_size=2)`` does on its mesh: gradients set to
``None``, the 1F1B schedule over this replica's shard of the global batch, then, with ``ddp`` and several
replicas, the gradients averaged over them (``average_gradients`` on the ``dp`` group), then the optimizer
step (``AdamW``, or ``SGD`` with momentum 0.9 where the config says ``"optimizer": "sgd"``).
With ``fsdp`` the stage modules are sharded over the ``dp`` group (``shard_stage_modules``) before torch's
stages wrap them, and FSDP2 averages the gradients itself. The peak is this rank's ``LivePeak`` over a
steady-state step (parameters and optimizer state included, as in ``bench_pipeline_partition``); the time is
the wall time of the following steps, run without the tracker.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Iterator

import torch

from benchmarks._pipeline_partition_worker import batch, layers, lm_loss

PP = 2


@contextlib.contextmanager
def fsdp_resizes_reported() -> Iterator[None]:
    """Report FSDP2's ``resize_`` of its unsharded parameters to ``LivePeak`` (a resize is not an op it sees)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group

    from lightning_memkit.measure.live_peak import note_storage_resized

    def reported(fn):
        def wrapper(tensor: torch.Tensor) -> None:
            fn(tensor)
            note_storage_resized(tensor)

        return wrapper

    modules = [m for m in (_fsdp_param, _fsdp_param_group) if hasattr(m, "alloc_storage")]
    saved = [(m, name, getattr(m, name)) for m in modules for name in ("alloc_storage", "free_storage")
             if hasattr(m, name)]
    try:
        for m, name, fn in saved:
            setattr(m, name, reported(fn))
        yield
    finally:
        for m, name, fn in saved:
            setattr(m, name, fn)


def measure(config: dict, sizes: list[int], mode: str) -> dict:
    """This rank's steady-state peak and seconds per timed step."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_memkit.memory import LivePeak
    from lightning_memkit.pipeline import evaluate_partition
    from lightning_memkit.pipeline.gradients import average_gradients
    from lightning_memkit.pipeline.runtime import PipelineRuntime

    dp = dist.get_world_size() // PP
    mesh = init_device_mesh("cpu", (dp, PP), mesh_dim_names=("dp", "pp"))
    replica, per_replica = dist.get_rank() // PP, config["batch"]
    x, y = batch(**{**config, "batch": per_replica * dp})
    x, y = x[replica * per_replica:(replica + 1) * per_replica], y[replica * per_replica:(replica + 1) * per_replica]
    part = evaluate_partition([1] * (config["blocks"] + 2), sizes, schedule="1f1b", microbatches=config["microbatches"])
    prepare = None
    if mode == "fsdp":
        from lightning_memkit.pipeline.sharding import shard_stage_modules

        def prepare(runtime):
            shard_stage_modules(runtime.modules, mesh["dp"])

    def step(runtime, opt):
        params = list(runtime.parameters())
        for p in params:
            p.grad = None
        runtime.train_step(x, y)
        if dp > 1 and mode == "ddp":
            average_gradients([p for p in params if p.grad is not None], mesh["dp"].get_group())
        opt.step()

    with (fsdp_resizes_reported() if mode == "fsdp" else contextlib.nullcontext()), LivePeak() as lp:
        runtime = PipelineRuntime(layers(**config), part, loss_fn=lm_loss, group=mesh["pp"].get_group(),
                                  prepare=prepare)
        if config.get("optimizer", "adamw") == "sgd":
            opt = torch.optim.SGD(runtime.parameters(), lr=1e-3, momentum=0.9, foreach=False)
        else:
            opt = torch.optim.AdamW(runtime.parameters(), lr=1e-3, foreach=False)
        lp.reset_peak()  # drop the moment this rank still held the whole model
        step(runtime, opt)
        lp.reset_peak()  # the first step also infers shapes and creates the optimizer state
        step(runtime, opt)
    dist.barrier()
    step(runtime, opt)  # warm-up outside the tracker
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(config["timed_steps"]):
        step(runtime, opt)
    dist.barrier()
    return {"peak": lp.peak_bytes, "seconds_per_step": (time.perf_counter() - t0) / config["timed_steps"]}


def main(out: str, config: str, sizes: str, mode: str) -> None:
    import datetime as dt

    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=dt.timedelta(seconds=120))
    result = measure(json.loads(config), json.loads(sizes), mode)
    with open(out.replace("RANK", str(dist.get_rank())), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.modules["lightning"] = None  # type: ignore[assignment]  # the pure-torch core needs no Lightning
    main(*sys.argv[1:5])
