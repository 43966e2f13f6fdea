"""The lever protocol: plans as mappings, each lever's options, words, YAML and cost, and the registry."""

from __future__ import annotations

import pytest

from lightning_memkit.estimate.levers import LEVERS, Plan, StepCost, StepSpec, lever
from lightning_memkit.estimate.runs import LeverRun


class _Run(LeverRun):
    def __init__(self, allow=None, batch=8, inside=False, fixed=False, causal=True):
        self.allow, self.batch_size, self.splits_inside_step = allow, batch, inside
        self.precision_fixed, self.has_causal_lm = fixed, causal
        self.base = Plan(micro_batch=batch)


def test_a_plan_is_a_hashable_mapping_of_every_lever():
    plan = Plan(recompute="full", micro_batch=4)
    assert list(plan) == [x.name for x in LEVERS] and len(plan) == len(LEVERS)
    assert plan["precision"] == "32-true" and plan["stages"] == 1 and plan["quantization"] is None  # defaults
    assert plan == Plan({"micro_batch": 4}, recompute="full") and hash(plan) == hash(plan.replace())
    assert plan.replace(fused_loss=True) != plan and {plan, plan.replace()} == {plan}
    assert Plan.from_dict(plan.to_dict()) == plan
    with pytest.raises(ValueError, match=r"Plan: 'checkpointing' not a lever; levers: precision, quantization"):
        Plan(checkpointing="full")
    with pytest.raises(KeyError):
        plan["offload"]


def test_a_plan_saved_before_the_levers_loads():
    """``MemoryBudget`` checkpoints written before the protocol name the fields ``plugin`` and ``checkpoint``."""
    saved = {"precision": "32-true", "plugin": None, "checkpoint": "selective", "fused_loss": True, "micro_batch": 2,
             "stages": 1}
    assert Plan.from_dict(saved) == Plan(recompute="selective", fused_loss=True, micro_batch=2)


def test_unknown_lever_names_the_levers():
    with pytest.raises(ValueError, match=r"'offload' is not a lever; levers: precision, .*stages"):
        lever("offload")


def test_options_follow_the_run():
    run = _Run()
    assert lever("precision").options("32-true", run) == ["32-true", "bf16-true"]
    assert lever("precision").options("32-true", _Run(fixed=True)) == ["32-true"]
    assert lever("precision").options("32-true", _Run(allow=("recompute",))) == ["32-true"]
    assert lever("recompute").options(None, run) == [None, "selective", "full"]
    assert lever("recompute").options("selective", run) == ["selective", "full"]
    assert lever("fused_loss").options(False, run) == [False, True]
    assert lever("fused_loss").options(False, _Run(causal=False)) == [False]
    assert lever("micro_batch").options(12, run) == [12, 6, 3]
    assert lever("micro_batch").options(12, _Run(inside=True)) == [12, 6, 3, 2, 1]
    assert lever("micro_batch").options(0, run) == [0]
    assert lever("quantization").options("nf4-lora", run) == ["nf4-lora", "nf4-dq-lora"]
    assert lever("stages").options(1, run) == [1]


def test_axes_are_the_product_of_the_options():
    plans = list(_Run(allow=("recompute", "micro_batch"), batch=4).axes())
    assert len(plans) == 3 * 3 and len(set(plans)) == len(plans)
    assert plans[0] == Plan(micro_batch=4)  # each lever's choice as given first


def test_order_cost_and_words():
    base = Plan(micro_batch=8)
    recompute, split = base.replace(recompute="full"), base.replace(micro_batch=2)
    assert recompute.search_order(base) == (2, 0) and split.search_order(base) == (2.0, 0)
    assert base.replace(fused_loss=True, precision="bf16-true").search_order(base) == (0, -2)
    assert split.replace(recompute="full").costlier(split) and not split.costlier(split.replace(fused_loss=True))
    run = _Run()
    assert split.scale_cost(base, StepCost(10.0, 3.0), run) == StepCost(40.0, 3.0)  # the optimizer steps once
    assert base.replace(stages=2).scale_cost(base, StepCost(16.0), run).seconds == 16.0 * (1 + 1 / 8) / 2
    assert split.replace(stages=2).describe(base) == "micro-batch 2 x 4 accumulation, 2 pipeline stages"


def test_a_plan_enters_the_fake_step_lever_by_lever():
    """Each lever adds its own to the step the run seeds: the plugin (built per model, in the precision's dtype),
    the KV cache off and the fused loss as patches, the micro-step of an accumulation, the world."""
    import torch

    from lightning_memkit.estimate.levers.fused_loss import fused_linear_cross_entropy_inside
    from lightning_memkit.estimate.step_spec import World
    from lightning_memkit.hf.layers import kv_cache_off

    spec = _Run().step_spec(Plan(precision="bf16-true", quantization="nf4-lora", recompute="selective",
                                 fused_loss=True, micro_batch=2, stages=2))
    assert (spec.precision, spec.dtype, spec.recompute, spec.fused_loss, spec.rows, spec.zero_grad, spec.world) == (
        "32-true", torch.bfloat16, "selective", True, 2, "accumulate", World(pipeline=2))
    assert spec.patches == [kv_cache_off, fused_linear_cross_entropy_inside] and spec.optimizer == []
    plugin, other = spec.make_plugin(), spec.make_plugin()
    assert plugin is not other and (plugin.mode, plugin.dtype, plugin.lora_rank) == ("nf4", torch.bfloat16, 16)
    plain = _Run().step_spec(Plan(micro_batch=8))
    assert plain == StepSpec(rows=8) and plain.world.devices == 1
    assert [x.devices(2) for x in LEVERS if x.kind == "scale"] == [2]


@pytest.mark.parametrize("kind", ["hf", "module"])
def test_written_callbacks_follow_the_lever_order(kind):
    run = _Run()
    run.kind, run.lora_rank = kind, 8
    plan = Plan(recompute="full", fused_loss=True, micro_batch=2)
    out = run.written(plan)
    names = [c["class_path"].rpartition(".")[2] for c in out.callbacks]
    if kind == "hf":
        assert names == ["ActivationCheckpointing", "FusedLinearCrossEntropy"]
        assert out.trainer == {"accumulate_grad_batches": 4}
    else:
        assert names == ["ActivationCheckpointing", "FusedLinearCrossEntropy", "MicroBatchSplit"]
        assert out.callbacks[-1]["init_args"] == {"max_rows": 2} and out.trainer == {}
    assert list(run.fragment(plan)["trainer"])[-1] == "callbacks"


def test_allow_names_levers_and_the_opt_in_ones_stay_out_unless_named():
    from lightning_memkit.common.errors import ConfigError
    from lightning_memkit.estimate.runs import check_allow

    assert check_allow(None) is None and check_allow(["recompute", "recompute"]) == ("recompute",)
    with pytest.raises(ConfigError, match=r"--allow: 'nope' not a lever; levers: precision, quantization"):
        check_allow(["nope"], "--allow")
    with pytest.raises(ConfigError, match="not a list of lever names"):
        check_allow("recompute")
    assert _Run().allows("offload_optimizer") and not _Run().allows("optimizer_8bit")
    assert _Run(allow=("optimizer_8bit",)).allows("optimizer_8bit")
