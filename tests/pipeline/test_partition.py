"""partition_layers is the exact minimax split (checked against brute force); baselines; errors."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_memkit.pipeline import (
    LayerCost,
    evaluate_partition,
    inflight_microbatches,
    parameter_balanced_partition,
    partition_layers,
    stage_to_rank,
    uniform_partition,
)

SPR = {"gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2, "zbv": 2, "dualpipev": 2}


def _compositions(n: int, k: int):
    for cut in itertools.combinations(range(1, n), k - 1):
        yield [b - a for a, b in zip((0, *cut), (*cut, n))]


def _brute_force(costs, num_stages, **kw) -> int:
    return min(evaluate_partition(costs, sizes, **kw).max_peak_bytes for sizes in _compositions(len(costs), num_stages))


layer_costs = st.builds(
    LayerCost,
    param_bytes=st.integers(0, 60),
    grad_bytes=st.integers(0, 60),
    optimizer_bytes=st.integers(0, 120),
    activation_bytes=st.integers(0, 40),
    output_bytes=st.integers(0, 20),
    workspace_bytes=st.integers(0, 50),
    saves_input=st.booleans(),
    saves_output=st.booleans(),
)


@st.composite
def problems(draw):
    schedule = draw(st.sampled_from(sorted(SPR)))
    v = SPR[schedule]
    ranks = draw(st.integers(1, 3))
    costs = draw(st.lists(st.one_of(layer_costs, st.integers(0, 100)), min_size=ranks * v, max_size=9))
    microbatches = draw(st.integers(1, 6))
    if schedule == "interleaved_1f1b":
        rounds = max(1, microbatches // ranks)
        microbatches -= microbatches % rounds
    return costs, ranks * v, schedule, microbatches


@pytest.mark.slow
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_partition_is_the_brute_force_optimum(problem):
    costs, num_stages, schedule, microbatches = problem
    kw = {"schedule": schedule, "microbatches": microbatches}
    part = partition_layers(costs, num_stages, **kw)
    assert part.max_peak_bytes == _brute_force(costs, num_stages, **kw)
    assert sum(part.sizes) == len(costs) and min(part.sizes) >= 1
    again = evaluate_partition(costs, part.sizes, **kw)  # the reported peaks are those of the returned split
    assert again.predicted_peak_bytes == part.predicted_peak_bytes
    assert again.stage_ranks == stage_to_rank(schedule, num_stages)


def test_rank_peak_is_the_sum_over_its_stages():
    costs = [LayerCost(param_bytes=10 * (i + 1), activation_bytes=i + 1) for i in range(8)]
    part = evaluate_partition(costs, [1, 2, 3, 2], schedule="dualpipev", microbatches=4)
    inflight = inflight_microbatches("dualpipev", 4, 4)
    stage = [
        sum(c.static_bytes for c in costs[a:b]) + n * sum(c.activation_bytes for c in costs[a:b])
        for (a, b), n in zip(zip(part.boundaries, part.boundaries[1:]), inflight)
    ]
    assert part.stage_peak_bytes == tuple(stage)
    assert part.predicted_peak_bytes == (stage[0] + stage[3], stage[1] + stage[2])
    assert part.stages_of_rank(0) == (0, 3) and list(part.layers_of_stage(2)) == [3, 4, 5]


def test_stage_cost_counts_receive_buffers_and_kept_outputs():
    """Boundary terms: M input buffers on a non-first stage, M gradient buffers on a non-last one."""
    costs = [LayerCost(output_bytes=100, saves_output=True), LayerCost(output_bytes=10), LayerCost(output_bytes=1)]
    gpipe = evaluate_partition(costs, [1, 2], schedule="gpipe", microbatches=3)
    # stage 0: 3 in flight x own output 100, + 3 gradient buffers of 100
    # stage 1: 3 input buffers of 100, + 3 in flight x (layer-1 output kept? no: nobody saves it) + own output 1
    assert gpipe.stage_peak_bytes == (3 * 100 + 3 * 100, 3 * 100 + 3 * 1)


def test_replicas_add_the_allreduce_buffer_where_it_exceeds_activations_and_workspace():
    """dp > 1: a stage peaks at static + buffers + max(activations + workspace, all-reduce buffer)."""
    acts = LayerCost(activation_bytes=300)
    grads = LayerCost(grad_bytes=200, largest_grad_bytes=100)
    costs = [acts, grads, grads, LayerCost(activation_bytes=10)]
    kw = {"schedule": "gpipe", "microbatches": 1}
    alone = partition_layers(costs, 2, **kw)
    assert (alone.sizes, alone.predicted_peak_bytes, alone.data_parallel_size) == ((1, 3), (300, 410), 1)
    assert partition_layers(costs, 2, data_parallel_size=1, **kw) == alone
    # two replicas: the last stage of (1, 3) also holds a 400-byte buffer of its 400 gradient bytes at the step
    assert evaluate_partition(costs, [1, 3], data_parallel_size=2, **kw).predicted_peak_bytes == (300, 800)
    two = partition_layers(costs, 2, data_parallel_size=2, **kw)
    assert (two.sizes, two.predicted_peak_bytes, two.data_parallel_size) == ((2, 2), (500, 400), 2)
    # 150-byte buckets: the buffer is one bucket; 50-byte buckets: the largest gradient (100 bytes) goes alone
    small = evaluate_partition(costs, [1, 3], data_parallel_size=2, bucket_bytes=150, **kw)
    assert small.predicted_peak_bytes == (300, 400 + 150)
    assert evaluate_partition(costs, [1, 3], data_parallel_size=2, bucket_bytes=50, **kw).predicted_peak_bytes == (
        300, 400 + 100)
    assert uniform_partition(costs, 2, data_parallel_size=2, bucket_bytes=150, **kw) == evaluate_partition(
        costs, [2, 2], data_parallel_size=2, bucket_bytes=150, method="uniform", **kw)


def test_allreduce_buffer_comes_on_top_of_the_boundary_buffers():
    costs = [LayerCost(grad_bytes=40, largest_grad_bytes=40, output_bytes=5),
             LayerCost(grad_bytes=40, largest_grad_bytes=40, activation_bytes=1)]
    kw = {"schedule": "gpipe", "microbatches": 2}
    # stage 0: 40 static + 2 x 5 gradient buffers + max(2 in flight x own output 5, 40); stage 1: 40 + 2 x 5
    # input buffers + max(2 x 1, 40)
    assert evaluate_partition(costs, [1, 1], **kw).stage_peak_bytes == (40 + 10 + 10, 40 + 10 + 2)
    assert evaluate_partition(costs, [1, 1], data_parallel_size=4, **kw).stage_peak_bytes == (90, 90)


@st.composite
def replicated_problems(draw):
    costs = []
    for _ in range(draw(st.integers(2, 8))):
        grad = draw(st.integers(0, 80))
        costs.append(LayerCost(param_bytes=draw(st.integers(0, 60)), grad_bytes=grad,
                               largest_grad_bytes=draw(st.integers(0, grad)), activation_bytes=draw(st.integers(0, 40)),
                               output_bytes=draw(st.integers(0, 20)), workspace_bytes=draw(st.integers(0, 50))))
    schedule = draw(st.sampled_from(["gpipe", "1f1b", "dualpipev"]))
    ranks = draw(st.integers(1, len(costs) // SPR[schedule]))
    return costs, ranks * SPR[schedule], schedule, draw(st.integers(1, 4))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(replicated_problems(), st.integers(2, 8), st.integers(1, 100))
def test_partition_with_replicas_is_the_brute_force_optimum(problem, dp, bucket):
    costs, num_stages, schedule, microbatches = problem
    kw = {"schedule": schedule, "microbatches": max(microbatches, num_stages), "data_parallel_size": dp,
          "bucket_bytes": bucket}
    part = partition_layers(costs, num_stages, **kw)
    assert part.max_peak_bytes == _brute_force(costs, num_stages, **kw)
    alone = evaluate_partition(costs, part.sizes, schedule=schedule, microbatches=kw["microbatches"])
    assert all(a <= b for a, b in zip(alone.predicted_peak_bytes, part.predicted_peak_bytes))


def test_memory_partition_beats_the_baselines_on_a_heavy_embedding_and_head():
    big = LayerCost(param_bytes=4000, grad_bytes=4000, optimizer_bytes=8000, activation_bytes=100, output_bytes=50)
    block = LayerCost(param_bytes=500, grad_bytes=500, optimizer_bytes=1000, activation_bytes=1500, output_bytes=50,
                      saves_input=True)
    costs = [big, *[block] * 10, big]
    kw = {"schedule": "1f1b", "microbatches": 8}
    best = partition_layers(costs, 4, **kw)
    uniform = uniform_partition(costs, 4, **kw)
    params = parameter_balanced_partition(costs, 4, **kw)
    assert uniform.sizes == (3, 3, 3, 3)
    assert best.max_peak_bytes < min(uniform.max_peak_bytes, params.max_peak_bytes)
    assert (best.method, uniform.method, params.method) == ("memory", "uniform", "parameters")
    weights = [c.grad_bytes for c in costs]
    best_param_split = min(
        max(sum(weights[a:b]) for a, b in zip(itertools.accumulate([0, *s[:-1]]), itertools.accumulate(s)))
        for s in _compositions(len(costs), 4)
    )
    stage_params = [sum(weights[i] for i in params.layers_of_stage(s)) for s in range(4)]
    assert max(stage_params) == best_param_split


def test_cap_reports_the_best_achievable_peak():
    costs = [LayerCost(param_bytes=100, activation_bytes=10)] * 6
    best = partition_layers(costs, 3, schedule="1f1b", microbatches=3)
    assert partition_layers(costs, 3, schedule="1f1b", microbatches=3, max_bytes_per_rank=best.max_peak_bytes) == best
    needs = rf"cannot be met: the best achievable split .* still needs {best.max_peak_bytes} bytes"
    with pytest.raises(ValueError, match=needs):
        partition_layers(costs, 3, schedule="1f1b", microbatches=3, max_bytes_per_rank=best.max_peak_bytes - 1)


def test_bad_input():
    with pytest.raises(ValueError, match="num_stages=5 exceeds the 4 layers: every stage needs at least one layer"):
        partition_layers([1, 2, 3, 4], 5)
    with pytest.raises(ValueError, match=r"sizes=\[2, 1\] add up to 3 layers, but there are 4"):
        evaluate_partition([1, 2, 3, 4], [2, 1])
    with pytest.raises(ValueError, match=r"evaluate_partition\(sizes\[1\]=0\): must be an int >= 1"):
        evaluate_partition([1, 2, 3, 4], [4, 0])
    with pytest.raises(ValueError, match=r"partition_layers\(data_parallel_size=0\): must be an int >= 1"):
        partition_layers([1, 2, 3, 4], 2, data_parallel_size=0)
    with pytest.raises(ValueError, match=r"evaluate_partition\(bucket_bytes=0\): must be an int >= 1"):
        evaluate_partition([1, 2, 3, 4], [2, 2], data_parallel_size=2, bucket_bytes=0)
    with pytest.raises(ValueError, match=r"partition_layers\(max_bytes_per_rank=0\): must be an int >= 1 or None"):
        partition_layers([1, 2], 2, max_bytes_per_rank=0)
    with pytest.raises(ValueError, match="supports 2 stages per rank"):
        partition_layers([1] * 9, 9, schedule="interleaved_1f1b", stages_per_rank=3, microbatches=3)
    with pytest.raises(TypeError, match="costs must be a sequence"):
        partition_layers(5, 1)


def test_backward_workspace_is_net_of_the_later_layers_and_the_step_is_a_phase():
    """A layer's backward runs after the later layers of its stage freed their per-microbatch bytes."""
    costs = [LayerCost(activation_bytes=100, workspace_bytes=900, output_bytes=10),
             LayerCost(activation_bytes=200, workspace_bytes=50, output_bytes=20, saves_input=True),
             LayerCost(activation_bytes=300, workspace_bytes=120, output_bytes=5)]
    kw = {"schedule": "gpipe", "microbatches": 1}
    # one stage: 600 activations + layer 0's output (kept by layer 1) 10 + own output 5 = 615 per microbatch;
    # backward: layer 2 120, layer 1 50 - 300, layer 0 900 - (200 + 300) = 400
    assert evaluate_partition(costs, [3], **kw).stage_peak_bytes == (615 + 400,)
    # stage 1 = layers 1, 2: 10 input buffer + 505 per microbatch + max(120, 50 - 300); stage 0: 10 + 110 + 900
    assert evaluate_partition(costs, [1, 2], **kw).stage_peak_bytes == (10 + 110 + 900, 10 + 505 + 120)
    # the optimizer step: the largest one-at-a-time step (2000) plus the foreach steps (300 + 400)
    stepped = [replace(costs[0], step_bytes=2000), replace(costs[1], step_bytes=300, step_foreach=True),
               replace(costs[2], step_bytes=400, step_foreach=True)]
    assert evaluate_partition(stepped, [3], **kw).stage_peak_bytes == (2000 + 700,)
    assert evaluate_partition(stepped, [1, 2], **kw).stage_peak_bytes == (10 + 2000, 10 + 700)


def test_sharded_stages_hold_shards_full_gradients_and_the_gathered_layers():
    """FSDP: (param + optimizer) / D, full gradients in backward, gathered layers l..b-1 when layer l runs backward."""
    costs = [LayerCost(param_bytes=400, grad_bytes=400, optimizer_bytes=801, activation_bytes=100, workspace_bytes=50,
                       output_bytes=10),
             LayerCost(param_bytes=200, grad_bytes=200, optimizer_bytes=400, activation_bytes=300, workspace_bytes=450,
                       output_bytes=5, step_bytes=400)]
    kw = {"schedule": "gpipe", "microbatches": 1, "data_parallel_size": 2}
    shards = (400 + 801 + 1) // 2 + 400 + (200 + 400) // 2 + 200  # ceil per layer, plus full gradients
    # per microbatch 100 + 300 + own output 5 = 405; layer 1: 450 + gathered 200 = 650; layer 0: max(50, its 400
    # all-gather) - 300 freed + gathered 400 + 200 = 700; step: 400 / 2 + sharded gradients 300 - full ones 600
    part = evaluate_partition(costs, [2], sharded=True, **kw)
    assert (part.predicted_peak_bytes, part.sharded) == ((shards + 405 + 700,), True)
    # replicated (DDP): full static, the all-reduce buffer of 600 bytes below 405 + workspace 450
    assert evaluate_partition(costs, [2], **kw).predicted_peak_bytes == (2401 + 405 + 450,)
    big_step = [costs[0], replace(costs[1], step_bytes=6000)]
    assert evaluate_partition(big_step, [2], sharded=True, **kw).predicted_peak_bytes == (
        shards + 3000 + 300 - 600,)
    assert partition_layers(costs, 1, sharded=True, **kw) == replace(part, method="memory")
    # a loss's backward on the last layer runs before that layer is gathered: 900 instead of 900 + 200
    lossy = [costs[0], replace(costs[1], loss_workspace_bytes=900)]
    assert evaluate_partition(lossy, [2], sharded=True, **kw).predicted_peak_bytes == (shards + 405 + 900,)
    assert evaluate_partition(lossy, [2], **kw).predicted_peak_bytes == (2401 + 405 + 900,)
    with pytest.raises(TypeError, match=r"evaluate_partition\(sharded=...\) must be a bool, got int"):
        evaluate_partition(costs, [2], sharded=1, **kw)
