"""Tied parameters in the cost model: a rank that holds both ends of a tie (the V of DualPipeV/ZBV, one rank) pays
its bytes once; found by ``shared_parameter_costs``; the exact search stays exact (brute force); measured on one
process."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import ranks
from torch import nn

from lightning_memkit.pipeline import LayerCost, evaluate_partition, partition_layers, static_cost
from lightning_memkit.pipeline.cost import shared_parameter_costs

WORKER = Path(__file__).with_name("_tie_peak_worker.py")
ENDS = LayerCost(param_bytes=1000, grad_bytes=1000, optimizer_bytes=2000, activation_bytes=10, output_bytes=8)
BLOCK = LayerCost(param_bytes=100, grad_bytes=100, optimizer_bytes=200, activation_bytes=300, output_bytes=8)
COSTS = [ENDS, *[BLOCK] * 6, ENDS]
TIE = [(0, 7, LayerCost(param_bytes=1000, grad_bytes=1000, optimizer_bytes=2000))]


def _tied_modules() -> list[nn.Module]:
    emb, head = nn.Embedding(16, 4), nn.Linear(4, 16, bias=False)
    head.weight = emb.weight
    return [emb, nn.Linear(4, 4), head]


def test_shared_parameter_costs_are_the_static_bytes_of_the_shared_parameters():
    layers = _tied_modules()
    (i, j, cost), = shared_parameter_costs(layers, "adamw")
    assert (i, j) == (0, 2)
    assert cost == static_cost(nn.ParameterList([layers[0].weight]), "adamw")
    assert cost.static_bytes == 16 * 4 * 4 * 4 + 4  # weight, gradient, 2 Adam states, the step
    assert shared_parameter_costs([nn.Linear(2, 2), nn.Linear(2, 2)]) == []


def _compositions(n: int, k: int):
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = (0, *cuts, n)
        yield [bounds[s + 1] - bounds[s] for s in range(k)]


@pytest.mark.parametrize("schedule", ["dualpipev", "zbv"])
def test_the_v_pays_a_tie_of_its_ends_once_on_rank_0_and_the_search_stays_exact(schedule):
    kw = dict(schedule=schedule, microbatches=4)
    part = partition_layers(COSTS, 4, ties=TIE, **kw)
    best = min(max(evaluate_partition(COSTS, sizes, ties=TIE, **kw).predicted_peak_bytes)
               for sizes in _compositions(len(COSTS), 4))
    assert part.max_peak_bytes == best
    plain = evaluate_partition(COSTS, part.sizes, **kw)
    assert part.predicted_peak_bytes[0] == plain.predicted_peak_bytes[0] - 4000  # rank 0 holds both ends
    assert part.predicted_peak_bytes[1:] == plain.predicted_peak_bytes[1:]
    assert part.stage_peak_bytes[0] == plain.stage_peak_bytes[0] - 4000


def test_ties_on_two_ranks_or_one_rank():
    split = evaluate_partition(COSTS, [4, 4], schedule="1f1b", ties=TIE)
    assert split == evaluate_partition(COSTS, [4, 4], schedule="1f1b")  # each rank holds a copy
    alone, plain = (evaluate_partition(COSTS, [8], schedule="1f1b", ties=t) for t in (TIE, ()))
    assert alone.predicted_peak_bytes[0] == plain.predicted_peak_bytes[0] - 4000  # one rank holds both
    assert partition_layers(COSTS, 2, schedule="1f1b", ties=TIE) == partition_layers(COSTS, 2, schedule="1f1b")


@pytest.mark.parametrize(("ties", "error", "match"), [
    ("0,7", TypeError, r"partition_layers\(ties=...\) must be a sequence of \(layer, layer, cost\), got str"),
    ([(0, 7)], TypeError, r"partition_layers\(ties\[0\]=\(0, 7\)\) must be a \(layer, layer, cost\) triple"),
    ([(7, 0, 10)], ValueError, r"ties\[0\]=\(7, 0, ...\)\): need two layers i < j among the 8 layers"),
    ([(0, 8, 10)], ValueError, r"need two layers i < j among the 8 layers"),
    ([(0, 7, -1)], ValueError, r"costs\[0\]=-1 must be >= 0 bytes"),
])
def test_bad_ties_are_refused_naming_them(ties, error, match):
    with pytest.raises(error, match=match):
        partition_layers(COSTS, 2, ties=ties)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_tied_v_on_one_process_measures_what_the_ties_predict(tmp_path):
    """DualPipeV on one gloo process, the toy LM's head tied to its 2048 x 32 embedding, AdamW: the prediction with
    ties is within 5% of LivePeak's steady-state step; without, it counts the embedding's 1 MB of state twice."""
    done = ranks.run([WORKER, tmp_path], timeout=110, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ranks.free_port()))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    r = json.loads((tmp_path / "tie_peak.json").read_text())
    assert abs(r["tied"] - r["measured"]) <= 0.05 * r["measured"], r
    assert r["plain"] - r["tied"] == r["tie_bytes"] > 0.2 * r["measured"], r
