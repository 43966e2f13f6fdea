"""A rank's step under FSDP2, estimated in one process on fake tensors under a fake process group, against the same
step run on 2 and 4 gloo ranks (per-rank live bytes, exact on CPU): a dense Llama in bf16, a Qwen3-MoE, a Llama
wrapped by peft; offloaded; with tiled MLPs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import ranks

from benchmarks import sharding_cases as fsdp2_cases  # noqa: E402
from lightning_memkit.estimate.step import estimate_training_memory  # noqa: E402

pytest.importorskip("transformers")
WORKER = Path(__file__).parents[2] / "benchmarks" / "_sharding_worker.py"
PHASES = ("forward", "backward", "optimizer step")


estimate = fsdp2_cases.estimate


def test_a_sharded_step_holds_a_share_of_the_weights_and_optimizer_state():
    """Two ranks: each holds half of every parameter and of AdamW's state (the tiny Llama's sizes divide evenly), and
    the step's peak is below the unsharded one; one rank's estimate needs no process group before or after."""
    import torch.distributed as dist

    whole = estimate_training_memory(fsdp2_cases.model_factory("qwen3_moe"), fsdp2_cases.batch, optimizer="adamw")
    half = estimate("qwen3_moe", 2)
    assert not dist.is_initialized()
    h, w = half.phases[-1], whole.phases[-1]
    buffers = w.weights - w.gradients  # every parameter trains: the rest are buffers (rotary), kept whole
    assert (h.weights - buffers) * 2 == w.weights - buffers and h.gradients * 2 == w.gradients
    assert h.optimizer_state * 2 == w.optimizer_state
    assert half.peak_bytes < whole.peak_bytes
    kept = estimate("qwen3_moe", 2, reshard=False)  # gathered parameters kept from forward to backward: more
    assert kept.peak_bytes > half.peak_bytes


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_the_estimate_of_a_rank_matches_the_gloo_ranks(tmp_path, world):
    procs = ranks.launch(WORKER, [str(tmp_path)], world, OMP_NUM_THREADS="1")
    for code, out in ranks.wait(procs, 240, f"FSDP2 over {world} gloo ranks"):
        assert code == 0, out[-4000:]
    measured = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    for case in fsdp2_cases.CASES:
        est = {p.phase: p.peak_bytes for p in estimate(case, world).phases}
        for phase in PHASES:  # rank 0 holds the largest shards: the estimate is its
            assert est[phase] == pytest.approx(measured[0][case][phase], rel=0.05), (case, phase)
        # the other ranks hold shards no larger; gloo's worker thread may free a unit's reduce-scatter input a moment
        # after the collective returns, which a rank then sees beside the next unit's: at most the largest unit's
        peak = max(est[p] for p in PHASES) * 1.05 + largest_unit_gradients(case)
        assert max(max(m[case][p] for p in PHASES) for m in measured) <= peak, case
    for case in fsdp2_cases.OFFLOADED:  # the device and host bytes FSDP2's CPU offload leaves a rank
        offloaded = estimate(case, world, offload=True)
        est = {p.phase: p.peak_bytes for p in offloaded.phases}
        for phase in PHASES:
            assert est[phase] == pytest.approx(measured[0][f"{case} offloaded"][phase], rel=0.05), (case, phase)
        assert offloaded.host_bytes == pytest.approx(measured[0][f"{case} offloaded"]["host"], rel=0.05), case
    for case in fsdp2_cases.TILED:  # the MLPs in tiles inside the FSDP2 units: lower, and as estimated
        est = {p.phase: p.peak_bytes for p in estimate(case, world, tiled=True).phases}
        for phase in PHASES:
            assert est[phase] == pytest.approx(measured[0][f"{case} tiled"][phase], rel=0.05), (case, phase)
        assert measured[0][f"{case} tiled"]["backward"] < measured[0][case]["backward"], case


def largest_unit_gradients(case: str) -> int:
    """The bytes of the largest FSDP2 unit's gradients as one process holds them (its reduce-scatter input)."""
    from lightning_memkit.estimate.step import build_model
    from lightning_memkit.hf.layers import decoder_layers

    model = build_model(fsdp2_cases.model_factory(case), fsdp2_cases.CASES[case][1])
    blocks = [m for _, m in decoder_layers(model)]
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    units = [list(b.parameters()) for b in blocks] + [[p for p in model.parameters() if id(p) not in in_blocks]]
    return max(sum(p.numel() * p.element_size() for p in unit if p.requires_grad) for unit in units)


def test_the_cuda_optimizer_step_of_a_rank_steps_its_shards():
    """``optimizer.step()``'s foreach temporaries on CUDA (one buffer the size of the parameters it steps) are a
    rank's: half of them on 2 ranks."""


    from lightning_memkit.estimate.levers.sharding import shard_transform
    from lightning_memkit.estimate.step import estimate_training_memory
    from lightning_memkit.estimate.step_spec import StepSpec, World

    def foreach(shards: int) -> int:
        steps = {}
        for target in ("cpu", "cuda"):
            step = StepSpec(world=World(shard=shards), target=target,
                            transforms=[shard_transform] if shards > 1 else [])
            est = estimate_training_memory(fsdp2_cases.model_factory("qwen3_moe"), fsdp2_cases.batch, step=step)
            steps[target] = est.phases[-1].transient
        return steps["cuda"] - steps["cpu"]

    assert foreach(2) * 2 == foreach(1) > 0


def test_memkit_estimate_devices_composes_one_sharded_rank_to_the_byte(tmp_path):
    """``estimate_from_hf_config(devices=2)``: one rank under ``full_shard``, composed from its layers equal to the
    whole trace, with recomputation and the fused loss (where a unit's all-gather output and its parameters, grown
    in place by FSDP2, are alive together at the peak); the optimizer state is half a device's."""
    from lightning_memkit.demo.hf_models import tiny_hf_config
    from lightning_memkit.estimate.hf import estimate_from_hf_config

    path = tmp_path / "config.json"
    path.write_text(tiny_hf_config("llama", hidden_size=64, num_layers=7, vocab_size=256,
                                   intermediate_size=1024).to_json_string())  # large units beside the activations
    one = estimate_from_hf_config(path, seq_len=16, precision="bf16-true", activation_checkpointing=True)
    kwargs = dict(seq_len=16, precision="bf16-true", activation_checkpointing=True, fused_loss=True, devices=2)
    composed = estimate_from_hf_config(path, compose=True, **kwargs)
    whole = estimate_from_hf_config(path, compose=False, **kwargs)
    assert composed.assumptions[-1].startswith("composed from traces at depths 3, 4, 5 of the 7 decoder layers")
    assert composed.phases == whole.phases and composed.parameter_bytes == whole.parameter_bytes > 0
    assert composed.phases[-1].optimizer_state * 2 == one.phases[-1].optimizer_state
    assert composed.peak_bytes < one.peak_bytes


def test_the_collectives_cost_a_sharded_plan_per_micro_batch():
    """Per micro-batch: (N - 1) / N of the parameters' bytes per all-gather (two for full_shard) and of the
    gradients' for the reduce-scatter, at the collective bandwidth; added on a CPU, overlapped on a GPU."""
    from types import SimpleNamespace

    from lightning_memkit.estimate.levers.base import StepCost
    from lightning_memkit.estimate.levers.sharding import SHARDING
    from lightning_memkit.measure.machine import MachineBalance

    est = SimpleNamespace(phases=[SimpleNamespace(weights=100)] * 2, trainable_parameters=50, precision="32-true")
    run = SimpleNamespace(devices=4)
    cpu = MachineBalance("cpu", {"float32": 1.0}, 1.0, 1.0, collective_bytes_per_s=3.0)
    gpu = MachineBalance("cuda", {"float32": 1.0}, 1.0, 1.0, collective_bytes_per_s=3.0)
    gathered = 100 * 4 * 3 / 4  # a rank's 100 B of 4 shards: 300 B come from the others per all-gather
    reduced = 50 * 4 * 3 / 4
    full = SHARDING.scale_cost("full_shard", None, StepCost(10.0), run, est, cpu)
    assert full.micro == pytest.approx(10.0 + (2 * gathered + reduced) / 3.0)
    kept = SHARDING.scale_cost("shard_grad_op", None, StepCost(10.0), run, est, cpu)
    assert kept.micro == pytest.approx(10.0 + (gathered + reduced) / 3.0)
    assert SHARDING.scale_cost("full_shard", None, StepCost(500.0), run, est, gpu).micro == 500.0  # hidden
    assert SHARDING.scale_cost(None, None, StepCost(10.0), run, est, cpu).micro == 10.0


def test_a_ddp_replica_holds_one_more_copy_of_its_gradients():
    """``World(replicate=2)``: DDP's reducer keeps a flat copy of the trainable gradients for the whole run, so every
    phase of the step holds exactly that much more, filed as gradients (measured on 2 gloo ranks by
    tests/callbacks/test_budget_fsdp2.py)."""
    from lightning_memkit.estimate.step import build_model, estimate_training_memory
    from lightning_memkit.estimate.step_spec import StepSpec, World

    one = estimate_training_memory(fsdp2_cases.model_factory("peft"), fsdp2_cases.batch)
    two = estimate_training_memory(fsdp2_cases.model_factory("peft"), fsdp2_cases.batch,
                                   step=StepSpec(world=World(replicate=2)))
    model = build_model(fsdp2_cases.model_factory("peft"), "32-true")
    grads = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    for a, b in zip(one.phases[1:], two.phases[1:], strict=True):
        assert (b.peak_bytes, b.gradients) == (a.peak_bytes + grads, a.gradients + grads), b.phase
    assert two.assumptions[-1].startswith("DDP: each replica's reducer holds one flat copy")


def test_the_devices_named_bound_the_pipeline_plans(tmp_path):
    from lightning_memkit.demo.hf_models import tiny_hf_config
    from lightning_memkit.estimate.hf_run import HFRun

    path = tmp_path / "config.json"
    path.write_text(tiny_hf_config("llama", hidden_size=32, num_layers=8, vocab_size=1000).to_json_string())
    assert [p["stages"] for p in HFRun(path, seq_len=16).pipelines()] == [2, 4, 8]
    assert [p["stages"] for p in HFRun(path, seq_len=16, devices=2).pipelines()] == [2]


def test_a_sharded_moe_step_fuses_its_loss_with_the_router_aux_loss():
    """FSDP2 gives the sharded model a class of its own (``FSDPQwen3MoeForCausalLM``, in torch's module): the fused
    loss still finds the family's ``load_balancing_loss_func`` along the class's bases, as the unsharded step does."""
    import functools

    from lightning_memkit.estimate.levers.fused_loss import fused_linear_cross_entropy_inside
    from lightning_memkit.estimate.levers.sharding import shard_transform
    from lightning_memkit.estimate.step import estimate_training_memory
    from lightning_memkit.estimate.step_spec import StepSpec, World

    def fused(shards: int):
        step = StepSpec(world=World(shard=shards), patches=[fused_linear_cross_entropy_inside], fused_loss=True,
                        transforms=[functools.partial(shard_transform)] if shards > 1 else [])
        return estimate_training_memory(fsdp2_cases.model_factory("qwen3_moe"), fsdp2_cases.batch, step=step)

    one, two = fused(1), fused(2)
    assert "fused_linear_cross_entropy_inside" in two.features
    assert two.phases[-1].optimizer_state * 2 == one.phases[-1].optimizer_state


def test_an_offloaded_rank_keeps_its_shards_gradients_and_state_in_host_memory():
    """``full_shard_offload``: the shards, their gradients and AdamW's state, exactly full_shard's bytes of them, are
    host memory through the step; the device keeps none of them (a few buffers), so its peak falls by at least what
    went to the host less one unit's gathered shards; the CUDA foreach temporaries go too (the host steps)."""
    from lightning_memkit.estimate.levers.sharding import SHARDING
    from lightning_memkit.estimate.step import estimate_training_memory
    from lightning_memkit.estimate.step_spec import StepSpec, World

    def estimate(choice: str):
        step = StepSpec(precision="bf16-true", world=World(replicate=2), target="cuda")
        SHARDING.to_step(choice, step)
        return estimate_training_memory(fsdp2_cases.model_factory("llama"), fsdp2_cases.batch, step=step,
                                        optimizer="adamw")

    sharded, offloaded = estimate("full_shard"), estimate("full_shard_offload")
    s, o = sharded.phases[-1], offloaded.phases[-1]
    buffers = s.weights - sharded.parameter_bytes
    kept = sharded.parameter_bytes + s.gradients + s.optimizer_state  # what a sharded rank keeps between steps
    assert offloaded.host_steady_bytes == kept and offloaded.parameter_bytes == sharded.parameter_bytes
    assert o.weights == buffers and o.gradients == o.optimizer_state == 0
    assert offloaded.peak_bytes <= sharded.peak_bytes - kept + largest_unit_parameters("llama") // 2
    assert sharded.host_bytes == 0 and "offloaded_like_a_gpu_run" in offloaded.features
    assert s.transient > 0 == o.transient  # no foreach temporaries on the device at the optimizer step


def largest_unit_parameters(case: str) -> int:
    """The bytes of the largest FSDP2 unit's parameters as one process holds them (gathered)."""
    from lightning_memkit.estimate.step import build_model
    from lightning_memkit.hf.layers import decoder_layers

    model = build_model(fsdp2_cases.model_factory(case), fsdp2_cases.CASES[case][1])
    blocks = [m for _, m in decoder_layers(model)]
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    units = [list(b.parameters()) for b in blocks] + [[p for p in model.parameters() if id(p) not in in_blocks]]
    return max(sum(p.numel() * p.element_size() for p in unit) for unit in units)


def test_the_offload_choice_is_written_read_and_priced_over_the_host_link():
    """``full_shard_offload`` writes ``memkit_fsdp2`` with ``offload: true``, reads back from it, and costs each
    gather's shards up and the gradients' shards down the host link per micro-batch, and the host's AdamW step."""
    from types import SimpleNamespace

    from lightning_memkit.estimate.levers.base import StepCost, Written
    from lightning_memkit.estimate.levers.sharding import SHARDING
    from lightning_memkit.measure.machine import MachineBalance

    run = SimpleNamespace(devices=4, allows=lambda name: True)
    assert SHARDING.options(None, run)[-1] == "full_shard_offload"
    out = Written()
    SHARDING.write_hf({"sharding": "full_shard_offload"}, run, out)
    strategy = out.trainer["strategy"]
    assert strategy["init_args"] == {"reshard_after_forward": True, "offload": True}
    assert SHARDING.read_config({"strategy": strategy}) == "full_shard_offload"
    est = SimpleNamespace(phases=[SimpleNamespace(weights=7)] * 2, parameter_bytes=100, trainable_parameters=50,
                          precision="32-true")
    cpu = MachineBalance("cpu", {"float32": 1.0}, 1.0, link_bytes_per_s=2.0, host_memory_bytes_per_s=5.0,
                         collective_bytes_per_s=3.0)
    full = SHARDING.scale_cost("full_shard", None, StepCost(10.0), run, est, cpu)
    offload = SHARDING.scale_cost("full_shard_offload", None, StepCost(10.0), run, est, cpu)
    assert offload.micro == full.micro and full.link == full.once == 0
    assert offload.link == pytest.approx((2 * 100 + 50 * 4 / 4) / 2.0)  # two gathers' shards, a rank's gradients
    assert offload.once == pytest.approx(7 * 50 * 4 / 4 / 5.0)
