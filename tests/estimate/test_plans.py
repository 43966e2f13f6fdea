"""memkit estimate --budget: plans that fit, cheapest first, and a plan's YAML trains within the budget."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

from lightning_memkit.cli.main import main
from lightning_memkit.common.sizes import parse_bytes
from lightning_memkit.config.errors import ConfigError
from lightning_memkit.demo.hf_models import tiny_hf_config
from lightning_memkit.estimate.hf import estimate_from_hf_config
from lightning_memkit.estimate.hf_run import HFRun
from lightning_memkit.estimate.levers import Plan
from lightning_memkit.estimate.plans import TIE, search_plans, step_cost
from lightning_memkit.measure.machine import H100
from lightning_memkit.memory import LivePeak

BASE_CONFIG = """\
seed_everything: 0
trainer:
  accelerator: cpu
  devices: 1
  max_steps: 3
  limit_val_batches: 0
  num_sanity_val_steps: 0
  enable_progress_bar: false
  enable_checkpointing: false
  enable_model_summary: false
  logger: false
  default_root_dir: ROOT
model:
  class_path: lightning_memkit.demo.HFCausalLM
  init_args: {family: llama, hidden_size: 64, num_layers: 1}
data:
  class_path: lightning_memkit.demo.ByteTextDataModule
  init_args: {batch_size: 4, seq_len: 64, batch_format: hf}
"""


@pytest.mark.parametrize("text, expected", [
    ("24GiB", 24 * 2**30), ("80GB", 80 * 10**9), ("1.5 MiB", int(1.5 * 2**20)), ("4096", 4096), (512, 512),
    ("2tib", 2 * 2**40),
])
def test_parse_bytes(text: str | int, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "-1GiB", "0", "3 parsecs", "inf", True])
def test_parse_bytes_refuses(text: object) -> None:
    """A bare size error: the callers name where the value came from (``--budget``, ``MemoryBudget(budget=...)``)."""
    with pytest.raises(ConfigError, match=r" is not a positive size; write e.g. 24GiB") as err:
        parse_bytes(text)
    assert "--budget" not in str(err.value)


def test_plan_order_and_words() -> None:
    base = Plan(recompute=None, fused_loss=False, micro_batch=8)
    strong = Plan(precision="bf16-true", recompute="full", fused_loss=True, micro_batch=2)
    assert base.at_most(strong) and not strong.at_most(base)
    assert not Plan(recompute="full", micro_batch=8).at_most(Plan(precision="bf16-true", fused_loss=True,
                                                                   micro_batch=8))
    assert strong.describe(base) == ("precision bf16-true, full activation checkpointing, fused loss, "
                                     "micro-batch 2 x 4 accumulation")
    assert base.describe(base) == "the run as given"


def test_the_strongest_plan_is_tried_first(tmp_path: Path) -> None:
    from lightning_memkit.estimate.plans import _strongest

    path = tmp_path / "config.json"
    path.write_text(tiny_hf_config("llama").to_json_string())
    run = HFRun(path, seq_len=16, batch_size=4, precision="bf16-true", plugin="nf4-lora")
    plans = list(run.axes())
    single = 2 * 3 * 2 * 2  # quantization x recompute x activation offload x loss
    # micro-batches 4, 2, 1 with no optimizer-state lever and with the host offload (8-bit is opt-in); the step in
    # backward, alone or with the host offload, only without accumulation (4 of 4)
    assert len(plans) == single * (3 + 3 + 1 + 1) and len(set(plans)) == len(plans)
    strongest = Plan(precision="bf16-true", quantization="nf4-dq-lora", recompute="full", offload_activations=True,
                     fused_loss=True, micro_batch=1, offload_optimizer=True)
    assert _strongest(plans) == [strongest, strongest.replace(micro_batch=4, optimizer_in_backward=True)]
    # choices that exclude each other: each strongest combination, strongest first
    tops = _strongest([Plan(recompute="full", micro_batch=1), Plan(fused_loss=True, micro_batch=1),
                       Plan(micro_batch=1)])
    assert tops == [Plan(recompute="full", micro_batch=1), Plan(fused_loss=True, micro_batch=1)]


@pytest.fixture(scope="module")
def llama_json(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("hf") / "config.json"
    path.write_text(tiny_hf_config("llama", vocab_size=1000, hidden_size=64, num_layers=2).to_json_string())
    return path


@pytest.mark.slow
def test_search_returns_fitting_plans_cheapest_first(llama_json: Path, pinned_machine) -> None:
    """The plan ranked first is estimated again from the options it names: the levers that
    ``estimate_from_hf_config`` takes as arguments (the balance pinned: which plan comes first is the balance's)."""
    run = HFRun(llama_json, seq_len=64, batch_size=2, allow=("precision", "recompute", "fused_loss", "micro_batch"))
    base = run.estimate(run.base)
    budget = int(base.peak_bytes * 0.6)
    lines: list[str] = []
    result = search_plans(run, budget, max_plans=10, progress=lines.append)
    assert not result.base.fits and result.base.peak_bytes == base.peak_bytes
    assert result.fitting and len(lines) == result.estimated
    assert all(r.peak_bytes * 1.05 <= budget for r in result.fitting)
    # cheapest first, the plans tied with the cheapest (within TIE) first of all, fewest changes first
    overheads = [round(r.overhead, 6) for r in result.fitting]
    cheapest = min(overheads)
    tied = [i for i, o in enumerate(overheads) if 1 + o <= (1 + cheapest) * (1 + TIE)]
    assert tied == list(range(len(tied)))
    changes = [result.fitting[i].plan.changes(run.base) for i in tied]
    assert changes == sorted(changes) and overheads[len(tied):] == sorted(overheads[len(tied):])
    best = result.fitting[0]
    accumulate = best.plan["micro_batch"] < run.batch_size
    again = estimate_from_hf_config(llama_json, seq_len=64, batch_size=best.plan["micro_batch"],
                                    precision=best.plan["precision"],
                                    activation_checkpointing=best.plan["recompute"] or False,
                                    fused_loss=best.plan["fused_loss"], accumulate=accumulate)
    assert best.peak_bytes == again.peak_bytes  # the plan's peak is the estimate of its options
    steps = run.batch_size // best.plan["micro_batch"]
    machine = run.machine()  # the balance the search ranked with
    cost, plain = step_cost(again, machine, run.compute_dtype(best.plan)), step_cost(base, machine)
    assert cost.once > 0 and best.overhead == pytest.approx((steps * cost.micro + cost.once) / plain.seconds - 1)
    assert '"plans"' in result.to_json() and "plan 1:" in str(result)


def test_full_recompute_costs_more_than_none(llama_json: Path) -> None:
    plain = estimate_from_hf_config(llama_json, seq_len=64, batch_size=2)
    full = estimate_from_hf_config(llama_json, seq_len=64, batch_size=2, activation_checkpointing=True)
    selective = estimate_from_hf_config(llama_json, seq_len=64, batch_size=2, activation_checkpointing="selective")
    assert full.step_flops > plain.step_flops == selective.step_flops  # selective keeps every matmul output
    seconds = [step_cost(e, H100).seconds for e in (full, selective, plain)]
    assert seconds[0] > seconds[1] > seconds[2]


def test_no_plan_fits_a_tiny_budget(llama_json: Path) -> None:
    run = HFRun(llama_json, seq_len=64, batch_size=2)
    result = search_plans(run, 1024)
    assert result.fitting == [] and "no plan fits" in str(result)
    # as given, the two strongest (host offload, step in backward), then 2 stages (2 layers)
    assert result.estimated == 1 + 2 + 1 and result.skipped > 0


def test_the_estimate_limit_is_reported(llama_json: Path, capsys: pytest.CaptureFixture) -> None:
    plain = estimate_from_hf_config(llama_json, seq_len=64, batch_size=2)
    main(["estimate", "--hf-config", str(llama_json), "--seq-len", "64", "--batch-size", "2",
          "--budget", str(int(plain.peak_bytes * 0.7)), "--max-estimates", "3"])
    out = capsys.readouterr().out
    assert "3 plans estimated" in out and "left out by the estimate limit (raise --max-estimates)" in out


def test_the_plans_are_ranked_on_the_balance_given_else_the_pinned_one(llama_json: Path, monkeypatch,
                                                                         capsys: pytest.CaptureFixture) -> None:
    """``--machine`` wins over ``MEMKIT_MACHINE``, which wins over the probe (an H100's for ``--device cuda`` here):
    the output names the balance the plans were ranked with."""
    rates = {"gemm_flops": {"float32": 1e9}, "memory_bytes_per_s": 1e13, "link_bytes_per_s": 1e13}
    monkeypatch.setenv("MEMKIT_MACHINE", json.dumps({"device": "a pinned device", **rates}))
    args = ["estimate", "--hf-config", str(llama_json), "--seq-len", "64", "--batch-size", "2", "--budget", "1GiB",
            "--max-estimates", "2"]
    main([*args, "--json"])
    assert json.loads(capsys.readouterr().out)["machine"] == "a pinned device"
    main([*args, "--machine", "h100"])
    assert f"ranked by step time on {H100.device}\n" in capsys.readouterr().out


def test_search_arguments_are_checked(llama_json: Path) -> None:
    run = HFRun(llama_json, seq_len=16)
    with pytest.raises(ValueError, match="margin"):
        search_plans(run, 2**30, margin=1.0)
    with pytest.raises(ValueError, match="budget_bytes"):
        search_plans(run, 0)


def _fit_peak(*configs: Path) -> int:
    """LivePeak over a whole ``memkit fit`` of ``configs`` (opened before anything is built)."""
    args = [a for c in configs for a in ("--config", str(c))]
    with LivePeak() as lp, contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        main(["fit", *args])
    return lp.peak_bytes


@pytest.mark.slow  # a planned fit in the fast suite: test_memory_budget
def test_training_with_the_plan_stays_within_the_budget(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    base = tmp_path / "base.yaml"
    base.write_text(BASE_CONFIG.replace("ROOT", str(tmp_path / "runs")))  # memkit fit saves its config there
    main(["estimate", "--config", str(base), "--json"])
    predicted = json.loads(capsys.readouterr().out)["peak_bytes"]
    budget = int(predicted * 0.6)
    main(["estimate", "--config", str(base), "--budget", str(budget), "--max-estimates", "6", "--json"])
    result = json.loads(capsys.readouterr().out)
    assert result["base"]["peak_bytes"] == predicted and result["plans"]
    plan = tmp_path / "plan.yaml"
    plan.write_text(result["plans"][0]["yaml"])
    measured = _fit_peak(base, plan)
    assert measured <= budget, (measured, budget, result["plans"][0]["yaml"])
    assert abs(measured / result["plans"][0]["peak_bytes"] - 1) <= 0.05  # the whole run peaks at its steady step
    assert _fit_peak(base) > budget  # the run as given does not fit


@pytest.mark.parametrize("plan", [
    Plan(precision="bf16-true", recompute="selective", fused_loss=True, micro_batch=2),
    Plan(quantization="nf4-dq-lora", recompute="full", fused_loss=False, micro_batch=4),
    Plan(precision="bf16-true", recompute="full", fused_loss=True, micro_batch=4, stages=2),
], ids=["single", "qlora", "pipeline"])
def test_hf_fragments_parse_as_lightningcli_configs(plan: Plan, llama_json: Path, tmp_path: Path) -> None:
    """Every key of a plan's YAML is one LightningCLI accepts (class paths, init args, trainer options)."""
    import yaml

    from lightning_memkit.config.lightning_cli import parse_config

    run = HFRun(llama_json, seq_len=64, batch_size=4)
    base, fragment = tmp_path / "base.yaml", tmp_path / "plan.yaml"
    base.write_text(BASE_CONFIG.replace("ROOT", str(tmp_path)))
    fragment.write_text(yaml.safe_dump(run.fragment(plan)))
    parsed = parse_config(base, ["--config", str(fragment)])
    trainer = parsed["trainer"]
    names = [c["class_path"].rpartition(".")[2] for c in trainer.get("callbacks") or []]
    assert ("ActivationCheckpointing" in names) == (plan["recompute"] is not None)
    assert ("FusedLinearCrossEntropy" in names) == (plan["fused_loss"] and plan["stages"] == 1)
    if plan["stages"] > 1:
        assert trainer["strategy"]["init_args"]["fused_loss"] is True and trainer["devices"] == 2
    if plan["quantization"] is not None:
        assert trainer["plugins"][0]["init_args"]["mode"] == "nf4-dq"
    else:
        assert trainer["precision"] == plan["precision"]
    assert trainer["accumulate_grad_batches"] == 4 // plan["micro_batch"]


def test_a_plan_over_the_host_memory_only_rules_out_no_weaker_plan(llama_json: Path) -> None:
    """The strongest plan offloads activations and fits the device, but not the host memory given: the search tries
    the strongest plan that keeps nothing on the host next, and finds the fitting plans without offload (a plan
    over the device budget would rule out every weaker one; one over the host memory rules out none)."""
    run = HFRun(llama_json, seq_len=64, batch_size=2, allow=("recompute", "offload_activations"))
    light = run.estimate(run.base.replace(recompute="full"))
    budget = int(light.peak_bytes * 1.06)
    assert run.estimate(run.base).peak_bytes * 1.05 > budget
    result = search_plans(run, budget, host_budget=1)
    recomputed = run.base.replace(recompute="full")
    assert recomputed.replace(offload_activations=True).uses_host() and not recomputed.uses_host()
    assert result.fitting and all(not r.plan.uses_host() and r.host_bytes == 0 for r in result.fitting)
    assert recomputed in [r.plan for r in result.fitting]
    with_host = search_plans(run, budget, host_budget=1 << 40)  # the host holds it: the offload plans may fit too
    assert any(r.plan.uses_host() for r in with_host.fitting)
