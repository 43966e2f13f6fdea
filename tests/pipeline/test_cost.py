"""Per-layer costs and per-schedule in-flight counts, checked against torch's own schedules and real optimizers."""

from __future__ import annotations

import types

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn
from torch.distributed.pipelining import schedules as S

from lightning_memkit.memory import LivePeak
from lightning_memkit.pipeline import (
    LayerCost,
    as_layer_costs,
    gradients,
    inflight_microbatches,
    measure_layer_costs,
    optimizer_state_bytes,
    resolve_stages_per_rank,
    stage_to_rank,
    static_cost,
)
from lightning_memkit.pipeline.cost import allreduce_buffer_bytes, optimizer_step_bytes

CLASSES = {
    "gpipe": S.ScheduleGPipe,
    "1f1b": S.Schedule1F1B,
    "interleaved_1f1b": S.ScheduleInterleaved1F1B,
    "zbv": S.ScheduleZBVZeroBubble,
    "dualpipev": S.ScheduleDualPipeV,
}


class _StubStage:
    """Just enough of a PipelineStage for a schedule to compute its order (no process group)."""

    def __init__(self, index: int, num_stages: int, ranks: int):
        self.stage_index, self.num_stages, self.group_size, self.group_rank = index, num_stages, ranks, 0
        self.is_first, self.is_last = index == 0, index == num_stages - 1
        self.submod = nn.Linear(1, 1)


def _torch_inflight(schedule: str, ranks: int, microbatches: int) -> tuple[int, ...]:
    """Most forwards not yet matched by their backward (B, or W of a split backward), per stage, in torch's order."""
    v = resolve_stages_per_rank(schedule)
    n = ranks * v
    stages = [_StubStage(i, n, ranks) for i in range(v)]
    sched = CLASSES[schedule](stages[0] if v == 1 else stages, microbatches, loss_fn=lambda out, tgt: out)
    peak = [0] * n
    for actions in sched.pipeline_order.values():
        live = [0] * n
        for action in actions:
            if action is None:
                continue
            subs = action.sub_actions if action.computation_type == S._ComputationType.OVERLAP_F_B else [action]
            for sub in subs:
                kind = sub.computation_type
                if kind == S._ComputationType.FORWARD:
                    live[sub.stage_index] += 1
                    peak[sub.stage_index] = max(peak[sub.stage_index], live[sub.stage_index])
                elif kind in (S._ComputationType.FULL_BACKWARD, S._ComputationType.BACKWARD_WEIGHT):
                    live[sub.stage_index] -= 1
    return tuple(peak)


@pytest.mark.parametrize("schedule", list(CLASSES))
@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_inflight_counts_match_torch_schedule_orders(schedule, ranks):
    checked = 0
    for microbatches in range(ranks, 4 * ranks + 2):
        try:
            expected = _torch_inflight(schedule, ranks, microbatches)
        except ValueError:  # torch refuses this count (e.g. DualPipeV needs M >= stages): so do we, elsewhere
            continue
        assert inflight_microbatches(schedule, ranks * resolve_stages_per_rank(schedule), microbatches) == expected
        checked += 1
    assert checked >= 3


def test_stage_to_rank_orders():
    assert stage_to_rank("1f1b", 3) == (0, 1, 2)
    assert stage_to_rank("interleaved_1f1b", 6) == (0, 1, 2, 0, 1, 2)
    assert stage_to_rank("zbv", 6) == (0, 1, 2, 2, 1, 0)
    assert stage_to_rank("dualpipev", 4) == (0, 1, 1, 0)


def _step_and_count(opt_cls, params, **kw) -> int:
    opt = opt_cls(params, **kw)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    seen, total = set(), 0
    for state in opt.state.values():
        for t in state.values():
            if torch.is_tensor(t) and t.untyped_storage()._cdata not in seen:
                seen.add(t.untyped_storage()._cdata)
                total += t.untyped_storage().nbytes()
    return total


@pytest.mark.parametrize(
    ("opt_cls", "kw"),
    [
        (torch.optim.SGD, {"lr": 0.1}),
        (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
        (torch.optim.Adam, {}),
        (torch.optim.AdamW, {"amsgrad": True}),
        (torch.optim.Adagrad, {}),
        (torch.optim.Adadelta, {}),
        (torch.optim.Adamax, {}),
        (torch.optim.NAdam, {}),
        (torch.optim.RAdam, {}),
        (torch.optim.RMSprop, {"momentum": 0.9, "centered": True}),
        (torch.optim.RMSprop, {}),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_optimizer_state_bytes_equal_the_states_a_real_step_creates(opt_cls, kw, dtype):
    params = [nn.Parameter(torch.zeros(7, 5, dtype=dtype)), nn.Parameter(torch.zeros(3, dtype=dtype))]
    frozen = nn.Parameter(torch.zeros(100), requires_grad=False)
    real = _step_and_count(opt_cls, params, **kw)
    assert optimizer_state_bytes([*params, frozen], opt_cls, **kw) == real
    opt = opt_cls(params, **kw)  # an instance: hyperparameters come from its groups
    assert optimizer_state_bytes(params, opt) == real


def test_optimizer_state_bytes_master_weights_and_groups():
    w = nn.Parameter(torch.zeros(10, dtype=torch.bfloat16))
    # fp32 master copy (40) + two fp32 states (80) + step (4)
    assert optimizer_state_bytes([w], "adam", master_weights=True) == 124
    a, b = nn.Parameter(torch.zeros(4)), nn.Parameter(torch.zeros(4))
    opt = torch.optim.SGD([{"params": [a], "momentum": 0.9}, {"params": [b]}], lr=0.1)
    assert optimizer_state_bytes([a, b], opt) == 16
    assert optimizer_state_bytes([nn.Parameter(torch.zeros(4))], opt) == 0  # not in the optimizer
    with pytest.raises(ValueError, match="optimizer='lbfgs' has no known state size"):
        optimizer_state_bytes([a], torch.optim.LBFGS)
    with pytest.raises(TypeError, match="optimizer must be a name"):
        optimizer_state_bytes([a], 3)


def test_static_cost_counts_parameters_buffers_gradients():
    m = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    m[0].bias.requires_grad_(False)
    c = static_cost(m, "sgd", momentum=0.9)
    params = sum(p.numel() * 4 for p in m.parameters())
    buffers = sum(b.numel() * b.element_size() for b in m.buffers())
    trainable = sum(p.numel() * 4 for p in m.parameters() if p.requires_grad)
    assert (c.param_bytes, c.grad_bytes, c.optimizer_bytes) == (params + buffers, trainable, trainable)
    assert c.largest_grad_bytes == 4 * 3 * 4  # the Linear weight; its frozen bias and the norm's 3-vectors are smaller
    assert static_cost(m, None).optimizer_bytes == 0
    assert static_cost(nn.Linear(4, 3).requires_grad_(False)).largest_grad_bytes == 0


@pytest.mark.parametrize(
    "numels, bucket, expected",
    [
        ([10, 30, 20], 2**20, 240),  # every gradient in one bucket: the rank's gradient bytes
        ([10, 100, 10], 200, 400),  # a gradient larger than the bucket, alone
        ([30, 30, 60], 240, 240),   # full buckets of 240 bytes: one flat buffer alive at a time
    ],
)
def test_allreduce_buffer_is_the_largest_flat_buffer_average_gradients_allocates(monkeypatch, numels, bucket, expected):
    """Two replicas simulated in one process (the all-reduce itself is a no-op): LivePeak sees only the flat buffers."""
    monkeypatch.setattr(gradients, "_distributed", lambda group: True)
    monkeypatch.setattr(gradients, "dist", types.SimpleNamespace(get_world_size=lambda group: 2,
                                                                   all_reduce=lambda t, group=None: None))
    params = [nn.Parameter(torch.zeros(n)) for n in numels]
    for p in params:
        p.grad = torch.full_like(p, 4.0)
    grad_bytes, largest = 4 * sum(numels), 4 * max(numels)
    predicted = allreduce_buffer_bytes(grad_bytes, largest, data_parallel_size=2, bucket_bytes=bucket)
    assert predicted == expected
    assert allreduce_buffer_bytes(grad_bytes, largest, data_parallel_size=1, bucket_bytes=bucket) == 0
    with LivePeak() as lp:
        gradients.average_gradients(params, bucket_bytes=bucket)
    assert all(torch.equal(p.grad, torch.full_like(p, 2.0)) for p in params)  # averaged in place over "2 replicas"
    assert lp.live_bytes == 0
    assert lp.peak_bytes == predicted


@given(st.lists(st.integers(1, 64), min_size=1, max_size=12), st.integers(1, 200))
def test_allreduce_buffer_bounds_the_buckets_and_is_exact_when_one_bucket_or_one_gradient_dominates(numels, bucket):
    grads = [torch.empty(n) for n in numels]
    largest_bucket = max(sum(4 * t.numel() for t in b) for b in gradients._buckets(grads, bucket))
    total, largest = 4 * sum(numels), 4 * max(numels)
    predicted = allreduce_buffer_bytes(total, largest, data_parallel_size=3, bucket_bytes=bucket)
    if total <= bucket or largest >= bucket:
        assert predicted == largest_bucket
    else:
        assert largest_bucket <= predicted < largest_bucket + largest


def test_allreduce_buffer_validation():
    with pytest.raises(ValueError, match=r"allreduce_buffer_bytes\(data_parallel_size=0\): must be an int >= 1"):
        allreduce_buffer_bytes(8, data_parallel_size=0)
    with pytest.raises(ValueError, match=r"allreduce_buffer_bytes\(bucket_bytes=0\): must be an int >= 1"):
        allreduce_buffer_bytes(8, data_parallel_size=2, bucket_bytes=0)
    with pytest.raises(ValueError, match=r"allreduce_buffer_bytes\(largest_grad_bytes=9\) exceeds grad_bytes=8"):
        allreduce_buffer_bytes(8, 9, data_parallel_size=2)
    with pytest.raises(ValueError, match=r"LayerCost\(largest_grad_bytes=9\) exceeds grad_bytes=8"):
        LayerCost(grad_bytes=8, largest_grad_bytes=9)
    assert allreduce_buffer_bytes(0, data_parallel_size=4) == 0  # no gradients, nothing to reduce


def _mlp() -> list[nn.Module]:
    return [nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 8)]


def test_measured_activations_add_up_to_what_a_chained_forward_keeps_alive():
    """LivePeak around the whole forward: live bytes == layers' activations + outputs kept inside + last output."""
    layers = _mlp()
    x = torch.randn(32, 16)
    costs = measure_layer_costs(layers, x, optimizer="adamw")
    with LivePeak() as lp:
        out = x
        for layer in layers:
            out = layer(out)
    kept = sum(
        c.output_bytes for i, c in enumerate(costs[:-1]) if c.saves_output or costs[i + 1].saves_input
    )
    assert lp.live_bytes == sum(c.activation_bytes for c in costs) + kept + costs[-1].output_bytes
    assert [c.output_bytes for c in costs] == [32 * 64 * 4, 32 * 64 * 4, 32 * 64 * 4, 32 * 64 * 4, 32 * 8 * 4]
    assert costs[1].saves_output and costs[2].saves_input and costs[3].saves_input
    for layer, c in zip(layers, costs):
        assert c.param_bytes == sum(p.numel() * 4 for p in layer.parameters())
        assert c.optimizer_bytes == optimizer_state_bytes(list(layer.parameters()), "adamw")
    assert all(p.grad is None for layer in layers for p in layer.parameters())  # measurement leaves no gradients


def test_loss_bytes_join_the_last_layer():
    layers = [nn.Linear(8, 50)]
    x, y = torch.randn(6, 8), torch.randint(0, 50, (6,))
    bare = measure_layer_costs(layers, x)[0]
    with_loss = measure_layer_costs(layers, x, loss_fn=nn.functional.cross_entropy, target=y)[0]
    # cross_entropy keeps its log-softmax (6 x 50 fp32) and nll_loss's fp32 total_weight scalar for backward
    assert with_loss.activation_bytes - bare.activation_bytes == 6 * 50 * 4 + 4
    # the loss's backward (gradients of the log-softmax and of the logits, 6 x 50 fp32 each) is measured apart
    assert (bare.loss_workspace_bytes, with_loss.loss_workspace_bytes) == (0, 2 * 6 * 50 * 4)
    assert with_loss.workspace_bytes > 0
    with pytest.raises(ValueError, match="pass loss_fn and target together"):
        measure_layer_costs(layers, x, loss_fn=nn.functional.cross_entropy)


def test_layer_cost_validation():
    assert as_layer_costs([3, LayerCost(grad_bytes=2)]) == [LayerCost(param_bytes=3), LayerCost(grad_bytes=2)]
    with pytest.raises(ValueError, match=r"LayerCost\(activation_bytes=-1\): must be an int >= 0"):
        LayerCost(activation_bytes=-1)
    with pytest.raises(TypeError, match=r"costs\[1\] must be a LayerCost or an int"):
        as_layer_costs([1, 2.5])
    with pytest.raises(ValueError, match="costs is empty"):
        as_layer_costs([])
    with pytest.raises(ValueError, match="schedule='pipedream' is not supported"):
        inflight_microbatches("pipedream", 2, 4)
    with pytest.raises(ValueError, match="num_stages=3 must be a multiple of the 2 stages per rank"):
        inflight_microbatches("dualpipev", 3, 4)
    with pytest.raises(ValueError, match="stages_per_rank=3 does not fit schedule='zbv'"):
        resolve_stages_per_rank("zbv", 3)
    with pytest.raises(ValueError, match=r"inflight_microbatches\(microbatches=0\): must be an int >= 1"):
        inflight_microbatches("1f1b", 2, 0)


_STEP_SHAPES = [[(10, 10)], [(16, 16), (64, 32)], [(64, 32), (64, 32)], [(3,), (64, 32), (5,), (7,)]]
_STEP_OPTIMIZERS = [
    (torch.optim.AdamW, {}), (torch.optim.Adam, {}), (torch.optim.Adam, {"weight_decay": 0.1}),
    (torch.optim.Adam, {"amsgrad": True}), (torch.optim.AdamW, {"maximize": True}),
    (torch.optim.SGD, {"momentum": 0.9}), (torch.optim.SGD, {"momentum": 0.9, "weight_decay": 0.1}),
    (torch.optim.SGD, {"momentum": 0.9, "nesterov": True}),
    (torch.optim.SGD, {"momentum": 0.9, "nesterov": True, "weight_decay": 0.1}),
    (torch.optim.AdamW, {"foreach": True}), (torch.optim.Adam, {"foreach": True, "weight_decay": 0.1}),
    (torch.optim.SGD, {"momentum": 0.9, "foreach": True}),
    (torch.optim.SGD, {"momentum": 0.9, "weight_decay": 0.1, "foreach": True}),
]


@pytest.mark.parametrize("shapes", _STEP_SHAPES, ids=str)
@pytest.mark.parametrize(("cls", "hp"), _STEP_OPTIMIZERS, ids=lambda v: getattr(v, "__name__", str(v)))
def test_optimizer_step_bytes_equal_the_live_peak_of_step(cls, hp, shapes):
    params = [nn.Parameter(torch.randn(*s)) for s in shapes]
    opt = cls(params, lr=1e-3, **hp)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()  # creates the state
    with LivePeak() as lp:
        opt.step()
    assert optimizer_step_bytes(params, opt) == lp.peak_bytes
    assert optimizer_step_bytes(params, cls, **hp) == lp.peak_bytes


def test_optimizer_step_bytes_rules():
    big, small = nn.Parameter(torch.zeros(64, 32)), nn.Parameter(torch.zeros(16, 16))  # 8192 and 1024 bytes
    # AdamW, one parameter at a time: 2 temporaries of the parameter + the previous parameter's denominator
    assert optimizer_step_bytes([small, big], "adamw") == 2 * 8192 + 1024
    assert optimizer_step_bytes([big, small], "adamw") == 2 * 8192
    assert optimizer_step_bytes([small, big], "adam", weight_decay=0.1) == 3 * 8192 + 1024
    assert optimizer_step_bytes([small, big], "adamw", foreach=True) == 8192 + 1024
    assert optimizer_step_bytes([small, big], "sgd", momentum=0.9) == 0
    assert optimizer_step_bytes([small, big], "sgd", weight_decay=0.1, nesterov=True, maximize=True) == 2 * 8192
    assert optimizer_step_bytes([small, big], "adagrad") == 0  # not modeled
    assert optimizer_step_bytes([nn.Parameter(torch.zeros(3), requires_grad=False)], "adamw") == 0
    with pytest.raises(TypeError, match="foreach must be a bool or None, got str"):
        optimizer_step_bytes([big], "adamw", foreach="yes")
    cost = static_cost(nn.Linear(32, 64), "adamw")  # weight 8192 bytes, then bias 256
    assert (cost.step_bytes, cost.step_foreach) == (2 * 8192, False)
    assert static_cost(nn.Linear(32, 64), "adamw", foreach=True).step_foreach
    with pytest.raises(TypeError, match=r"LayerCost\(step_foreach=...\) must be a bool"):
        LayerCost(step_foreach=1)


def test_workspace_is_net_of_the_activations_backward_frees():
    """A Linear -> GELU -> Linear block: the backward's peak above what is alive when it starts."""
    block = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))
    x = torch.randn(8, 16)
    cost = measure_layer_costs([block], x)[0]
    for p in block.parameters():
        p.grad = torch.zeros_like(p)
    with LivePeak() as lp:
        out = block(x)
        seed = torch.ones_like(out)
        lp.reset_peak()
        start = lp.live_bytes
        out.backward(seed)
    assert cost.workspace_bytes == lp.peak_bytes - start
    out = block(x)
    with LivePeak() as gross:  # sees what backward allocates, not the saved activations it frees
        out.backward(seed)
    assert cost.workspace_bytes < gross.peak_bytes
