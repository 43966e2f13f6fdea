"""PipelineRuntime on 2, 3 and 4 CPU processes (gloo): exact training, predicted vs measured peak, no hangs."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
import ranks
import torch
from torch import nn
from torch.torch_version import TorchVersion

from lightning_memkit.pipeline import evaluate_partition
from lightning_memkit.pipeline.runtime import (
    TUPLES_SINCE,
    check_microbatches,
    release_to_meta,
    split_batch_size,
    tied_parameters,
)

WORKER = Path(__file__).with_name("_pipeline_worker.py")
ROOT = Path(__file__).resolve().parents[2]
PYPATH = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))  # keep what is installed




def launch(
    scenario: str,
    world: int,
    tmp_path: Path,
    *,
    timeout: float = 120,
    pg_timeout: float = 60,
    stalled: int | None = None,
) -> list:
    """Run ``world`` worker processes; return (returncode, output, seconds) per rank.

    A rank still running at ``timeout`` is killed (its output then starts with ``TIMEOUT``); rank ``stalled``
    is expected to hang and is killed as soon as the others are done.
    """
    port = ranks.free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), PG_TIMEOUT=str(pg_timeout), PYTHONPATH=PYPATH)
        procs.append(ranks.start([WORKER, scenario, tmp_path], env))
    t0 = time.monotonic()
    results = []
    order = [r for r in range(world) if r != stalled] + ([stalled] if stalled is not None else [])
    for rank in order:
        p = procs[rank]
        if rank == stalled:
            p.kill()
        try:
            out, _ = p.communicate(timeout=max(1.0, timeout - (time.monotonic() - t0)))
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
            out = "TIMEOUT\n" + out
        results.append((p.returncode, out, time.monotonic() - t0))
    return [results[order.index(r)] for r in range(world)]


def _json(tmp_path: Path, rank: int) -> dict:
    return json.loads((tmp_path / f"rank{rank}.json").read_text())


def _within_15_percent(peak: dict) -> bool:
    return peak["measured"] > 0 and abs(peak["predicted"] - peak["measured"]) <= 0.15 * peak["measured"]


@pytest.mark.slow
def test_two_ranks_match_single_process_for_every_schedule(tmp_path):
    """Loss, gradients, SGD steps and eval agree with the unsplit model for all five schedules (and a fused head).

    Layers that pass tuples (hidden states, an int padding mask, positions shared by the rows) with a
    :class:`BatchLoss` (mean over the batch's valid targets) agree too, under 1F1B and DualPipeV.

    The same run measures each rank's steady-state LivePeak under the four schedules not covered by the
    4-rank 1F1B test and compares it with the prediction.
    """
    results = launch("correctness", 2, tmp_path)
    for rc, out, _ in results:
        assert rc == 0, out[-4000:]
    r0, r1 = _json(tmp_path, 0), _json(tmp_path, 1)
    peaks = [r0.pop("peaks"), r1.pop("peaks")]
    tuples = {"1f1b_tuples", "dualpipev_tuples"} if TorchVersion(torch.__version__) >= TUPLES_SINCE else set()
    assert set(r0) == {"gpipe", "1f1b", "interleaved_1f1b", "zbv", "dualpipev", "1f1b_fused", *tuples}
    assert r0 == r1  # every rank reports the same (broadcast) losses and the same partition
    for entry in r0.values():
        assert entry["losses"] == pytest.approx(entry["ref"], rel=1e-5)
    for rank, per_schedule in enumerate(peaks):
        assert set(per_schedule) == {"gpipe", "interleaved_1f1b", "zbv", "dualpipev"}
        for schedule, peak in per_schedule.items():
            assert _within_15_percent(peak), (rank, schedule, peak)


@pytest.mark.slow
def test_four_ranks_predicted_peak_within_15_percent_of_measured(tmp_path):
    """1F1B over 4 ranks: each rank's LivePeak in a steady-state step is within 15% of the partition's prediction."""
    results = launch("peak", 4, tmp_path)
    for rc, out, _ in results:
        assert rc == 0, out[-4000:]
    for rank in range(4):
        peak = _json(tmp_path, rank)["peak"]
        assert _within_15_percent(peak), (rank, peak)
        assert set(_json(tmp_path, rank)) == {"peak", "1f1b", "dualpipev"}


@pytest.mark.slow
def test_a_stalled_rank_makes_the_others_fail_not_hang(tmp_path):
    """The last of 3 ranks hangs: the others raise within the process-group timeout plus slack; nobody waits forever."""
    pg_timeout = 4.0
    results = launch("failure", 3, tmp_path, timeout=60, pg_timeout=pg_timeout, stalled=2)
    for rank in (0, 1):
        rc, out, seconds = results[rank]
        assert rc == 0, out[-4000:]
        report = _json(tmp_path, rank)
        assert report["raised"] is not None, report
        assert report["seconds"] < pg_timeout + 30, report
    assert results[2][0] != 0 and not (tmp_path / "rank2.json").exists()  # the stalled rank never finished


def test_microbatch_and_batch_checks():
    with pytest.raises(ValueError, match="microbatches=2 is too few for schedule='1f1b' with 4 stages"):
        check_microbatches("1f1b", 4, 2, 4)
    with pytest.raises(ValueError, match="microbatches=3 is too few for schedule='dualpipev' with 4 stages"):
        check_microbatches("dualpipev", 4, 3, 2)
    with pytest.raises(ValueError, match="must be a multiple of"):
        check_microbatches("interleaved_1f1b", 4, 5, 2)
    check_microbatches("gpipe", 4, 1, 4)  # GPipe runs any count
    with pytest.raises(ValueError, match="a batch of 10 samples does not split into microbatches=4"):
        split_batch_size(10, 4)
    assert split_batch_size(12, 4) == 3


def test_tied_weights_across_ranks_are_found_and_the_local_copy_survives_the_release():
    emb = nn.Embedding(8, 4)
    head = nn.Linear(4, 8, bias=False)
    head.weight = emb.weight
    layers = [emb, nn.Linear(4, 4), head]
    across = evaluate_partition([1, 1, 1], [1, 2], schedule="gpipe")
    (tie,) = tied_parameters(layers, across)
    assert (tie.ranks, tie.names, tie.param is emb.weight) == ((0, 1), ("layer 0 (weight)", "layer 2 (weight)"), True)
    together = evaluate_partition([1, 1, 1], [3], schedule="gpipe")
    assert tied_parameters(layers, together) == []
    # rank 1 holds layers 1 and 2: the embedding goes to meta, the head keeps the real (shared) weight
    value = emb.weight.detach().clone()
    release_to_meta(emb, keep={id(p) for layer in layers[1:] for p in layer.parameters()})
    assert emb.weight.device.type == "meta" and head.weight.device.type == "cpu"
    assert torch.equal(head.weight, value)
    release_to_meta(layers[1], keep=set())
    assert all(p.device.type == "meta" for p in layers[1].parameters())


@pytest.mark.cuda
def test_cuda_single_rank_matches_and_predicts(tmp_path):
    """One rank per GPU over nccl: exact loss and gradients (also with the fused head), prediction within 15%."""
    results = launch("cuda", 1, tmp_path)
    assert results[0][0] == 0, results[0][1][-4000:]
    report = _json(tmp_path, 0)
    for name in ("1f1b", "gpipe_fused"):
        assert report[name]["losses"] == pytest.approx(report[name]["ref"], rel=1e-4)
    assert _within_15_percent(report["peak"]), report["peak"]
