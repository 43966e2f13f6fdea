"""One rank of the multi-process pipeline tests (pure torch, gloo). Run by tests/pipeline/test_runtime.py.

    RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 python _pipeline_worker.py SCENARIO OUT_DIR

Lightning is made unimportable first: the pipeline core must work without it.
"""

from __future__ import annotations

import copy
import datetime as dt
import json
import os
import sys
import time
from pathlib import Path

sys.modules["lightning"] = None  # type: ignore[assignment]  # any import of Lightning now fails

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _toy import lm_loss, pair_batch, pair_layers, pair_reference, reference, toy_batch, toy_layers  # noqa: E402

from lightning_memkit.memory import LivePeak  # noqa: E402
from lightning_memkit.pipeline import measure_layer_costs, partition_layers  # noqa: E402
from lightning_memkit.pipeline.runtime import (  # noqa: E402
    TUPLES_SINCE,
    BatchLoss,
    PipelineRuntime,
    measure_pipeline_costs,
)

TOL = {"rtol": 1e-5, "atol": 1e-6}


def _costs(layers, x, y, microbatches, optimizer="sgd"):
    mb = x.shape[0] // microbatches
    return measure_layer_costs(layers, x[:mb], loss_fn=lm_loss, target=y[:mb], optimizer=optimizer)


def _check(schedule: str, world: int, fused: bool = False, device: str = "cpu") -> dict:
    """Two SGD steps and an eval through the pipeline against the same model in this process."""
    stages = world * (1 if schedule in ("gpipe", "1f1b") else 2)
    m = 2 * stages if world <= 2 else stages
    layers = toy_layers(blocks=2 * stages, plain_head=fused).to(device)
    ref = copy.deepcopy(layers)
    x, y = (t.to(device) for t in toy_batch(2 * m, 8))
    part = partition_layers(_costs(layers, x, y, m), stages, schedule=schedule, microbatches=m)
    runtime = PipelineRuntime(layers, part, loss_fn=None if fused else lm_loss, fused_head=fused, device=device)
    opt = torch.optim.SGD(runtime.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    losses, ref_losses = [], []
    for step in range(2):
        losses.append(runtime.train_step(x, y))
        ref_loss = reference(ref, x, y)
        ref_loss.backward()
        ref_losses.append(ref_loss.detach())
        if step == 0:
            for i in runtime.layer_indices:
                for (name, p), q in zip(layers[i].named_parameters(), ref[i].parameters()):
                    torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=f"{schedule} grad {i}.{name}")
        opt.step()
        opt.zero_grad(set_to_none=True)
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
    torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses), **TOL)
    with torch.no_grad():
        odd = x.shape[0] - 1  # eval accepts a short batch (unequal microbatches)
        torch.testing.assert_close(runtime.eval_step(x[:odd], y[:odd]), reference(ref, x[:odd], y[:odd]), **TOL)
    torch.testing.assert_close(runtime.train_step(x, y), reference(ref, x, y).detach(), **TOL)  # train after eval
    dist.barrier()
    return {"sizes": list(part.sizes), "losses": [float(v) for v in losses], "ref": [float(v) for v in ref_losses]}


class TokenMean(BatchLoss):
    """Cross-entropy averaged over the batch's targets that are not -100, whatever microbatch holds them."""

    def begin(self, target, microbatches):
        self.scale = microbatches / (target != -100).sum()

    def __call__(self, logits, target):
        flat = torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="sum")
        return flat * self.scale


def _check_tuples(schedule: str, world: int) -> dict:
    """Layers passing (hidden, int mask, shared positions) and a batch-level loss: as in one process."""
    stages = world * (1 if schedule in ("gpipe", "1f1b") else 2)
    m = 2 * stages
    layers = pair_layers(blocks=2 * stages)
    ref = copy.deepcopy(layers)
    inputs, y = pair_batch(2 * m, 8)
    mb = slice(0, 2)
    costs = measure_pipeline_costs(layers, tuple(t[mb] for t in inputs), y[mb], loss_fn=TokenMean())
    part = partition_layers(costs, stages, schedule=schedule, microbatches=m)
    runtime = PipelineRuntime(layers, part, loss_fn=TokenMean())
    opt, ref_opt = torch.optim.SGD(runtime.parameters(), lr=0.5), torch.optim.SGD(ref.parameters(), lr=0.5)
    losses, ref_losses = [], []
    for step in range(2):
        losses.append(runtime.train_step(inputs, y))
        ref_loss = pair_reference(ref, inputs, y)
        ref_loss.backward()
        ref_losses.append(ref_loss.detach())
        if step == 0:
            for i in runtime.layer_indices:
                for (name, p), q in zip(layers[i].named_parameters(), ref[i].parameters()):
                    torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=f"{schedule} grad {i}.{name}")
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad(set_to_none=True)
    torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses), **TOL)
    odd = y.shape[0] - 1  # eval: tuples through the blocking point-to-point path, unequal microbatches
    with torch.no_grad():
        expected = pair_reference(ref, tuple(t[:odd] for t in inputs), y[:odd])
    torch.testing.assert_close(runtime.eval_step(tuple(t[:odd] for t in inputs), y[:odd]), expected, **TOL)
    dist.barrier()
    return {"sizes": list(part.sizes), "losses": [float(v) for v in losses], "ref": [float(v) for v in ref_losses]}


def correctness(rank: int, world: int) -> dict:
    schedules = ["gpipe", "1f1b", "interleaved_1f1b", "zbv", "dualpipev"] if world == 2 else ["1f1b", "dualpipev"]
    result = {s: _check(s, world) for s in schedules}
    if world == 2:
        result["1f1b_fused"] = _check("1f1b", world, fused=True)
        if torch.torch_version.TorchVersion(torch.__version__) >= TUPLES_SINCE:
            result["1f1b_tuples"] = _check_tuples("1f1b", world)
            result["dualpipev_tuples"] = _check_tuples("dualpipev", world)
    return result


def peak(rank: int, world: int, schedule: str = "1f1b", device: str = "cpu") -> dict:
    """Measured per-rank LivePeak of a steady-state step against the partition's prediction."""
    m = 8
    stages = world * (1 if schedule in ("gpipe", "1f1b") else 2)
    x, y = (t.to(device) for t in toy_batch(2 * m, 32, vocab=256))
    layers = toy_layers(vocab=256, dim=32, blocks=6).to(device)
    part = partition_layers(_costs(layers, x, y, m, optimizer="adamw"), stages, schedule=schedule, microbatches=m)
    del layers
    with LivePeak() as lp:
        layers = toy_layers(vocab=256, dim=32, blocks=6)  # parameters created inside: counted
        runtime = PipelineRuntime(layers, part, loss_fn=lm_loss, device=device)
        opt = torch.optim.AdamW(runtime.parameters(), lr=1e-3, foreach=False)
        lp.reset_peak()  # drop the moment every rank still held the whole model
        for step in range(3):
            runtime.train_step(x, y)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if step == 0:
                lp.reset_peak()  # the first step also infers shapes: measure the steady state
    return {
        "predicted": part.predicted_peak_bytes[rank],
        "measured": lp.peak_bytes,
        "cuda_peak_delta": lp.cuda_peak_delta,  # allocator view (CUDA only), for the record
        "sizes": list(part.sizes),
    }


class _Stall(torch.nn.Module):
    """Hangs in its second forward (the last rank stops answering)."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls == 2:
            time.sleep(120)
        return x


def failure(rank: int, world: int) -> dict:
    """The last rank hangs: its neighbour times out (process-group timeout), the rank before it sees a dead peer."""
    layers = toy_layers(blocks=world)
    layers.append(_Stall())
    x, y = toy_batch(8, 4)
    part = partition_layers([1] * len(layers), world, schedule="gpipe", microbatches=4)
    runtime = PipelineRuntime(layers, part, loss_fn=lambda out, tgt: out.float().mean())
    t0 = time.monotonic()
    try:
        runtime.train_step(x, y)
    except Exception as err:  # noqa: BLE001 - the error is the result
        return {"raised": type(err).__name__, "message": str(err)[:300], "seconds": time.monotonic() - t0}
    return {"raised": None, "seconds": time.monotonic() - t0}


def main() -> None:
    scenario, out = sys.argv[1], Path(sys.argv[2])
    timeout = float(os.environ.get("PG_TIMEOUT", "60"))
    dist.init_process_group("nccl" if scenario == "cuda" else "gloo", timeout=dt.timedelta(seconds=timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    if scenario == "cuda":  # one rank per GPU: the CUDA code paths (nccl, device tensors, fused head on GPU)
        result = {
            "1f1b": _check("1f1b", world, device="cuda"),
            "gpipe_fused": _check("gpipe", world, fused=True, device="cuda"),
            "peak": peak(rank, world, "1f1b", device="cuda"),
        }
    elif scenario == "correctness":
        result = correctness(rank, world)
        result["peaks"] = {s: peak(rank, world, s) for s in ("gpipe", "interleaved_1f1b", "zbv", "dualpipev")}
    elif scenario == "peak":
        result = {"peak": peak(rank, world), **correctness(rank, world)}
    else:
        result = failure(rank, world)
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    if scenario == "failure":
        os._exit(0)  # the process group is broken: skip its teardown
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
