"""The planner's step time model against measured steps: a Llama of about 100M parameters at sequence 512.

Method: one tiny-random Llama (``HFCausalLM``; hidden 768, 12 layers, vocabulary 32,000: about 110M parameters)
trained on one batch of 1 x 512 random tokens, repeated. For each plan (the run as given, full activation
checkpointing with the fused loss, selective checkpointing with the fused loss, activation offload with full
checkpointing, and the plan ``MemoryBudget`` would choose at 60% of the run as given's predicted peak), the
predicted step time is the planner's (``ModuleRun`` estimates priced with this machine's probed balance,
``lightning_memkit.measure.machine.probe_machine``), the measured one the median of the timed steps of a
``Trainer.fit`` with the plan's callbacks (two warm-up steps not counted). The goal compares the step-time cost,
plan over run as given, predicted and measured.

    python -m benchmarks.run --only step_time [--quick]
"""

from __future__ import annotations

import statistics
import time
import warnings
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

from benchmarks.common import record, sync
from lightning_memkit.callbacks import ActivationCheckpointing, ActivationOffloading, FusedLinearCrossEntropy
from lightning_memkit.demo import HFCausalLM
from lightning_memkit.estimate.levers import Plan
from lightning_memkit.estimate.module import ModuleRun
from lightning_memkit.estimate.plans import search_plans, step_cost
from lightning_memkit.measure.machine import probe_machine

WARMUP, TIMED = 2, 3
GOAL = 0.25  # the chosen plan's predicted cost within 25% of the measured


class _StepTimes(Callback):
    def __init__(self) -> None:
        self.times: list[float] = []
        self._start = 0.0

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        sync(str(trainer.strategy.root_device))
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        sync(str(trainer.strategy.root_device))
        self.times.append(time.perf_counter() - self._start)


def _shape(quick: bool) -> dict[str, int]:
    if quick:
        return dict(hidden_size=128, num_layers=2, vocab_size=2048, seq=128)
    return dict(hidden_size=768, num_layers=12, vocab_size=32000, seq=512)


def _model(shape: dict[str, int]) -> HFCausalLM:
    return HFCausalLM("llama", hidden_size=shape["hidden_size"], num_layers=shape["num_layers"],
                      vocab_size=shape["vocab_size"], seed=0)


def _batch(shape: dict[str, int]) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, shape["vocab_size"], (1, shape["seq"]), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids.clone()}


def _callbacks(plan: Plan) -> list[Callback]:
    out: list[Callback] = []
    if plan["recompute"] is not None:
        out.append(ActivationCheckpointing(selective=plan["recompute"] == "selective"))
    if plan["offload_activations"]:
        out.append(ActivationOffloading())
    if plan["fused_loss"]:
        out.append(FusedLinearCrossEntropy())
    return out


def _measure(shape: dict[str, int], batch: dict[str, torch.Tensor], plan: Plan, device: str) -> float:
    times = _StepTimes()
    loader = torch.utils.data.DataLoader([{k: v[0] for k, v in batch.items()}] * (WARMUP + TIMED), batch_size=1)
    trainer = L.Trainer(accelerator=device, devices=1, max_steps=WARMUP + TIMED, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[times, *_callbacks(plan)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(_model(shape), loader)
    return statistics.median(times.times[WARMUP:])


def _predicted(run: ModuleRun, plan: Plan, machine: Any) -> float:
    est = run.estimate(plan)
    cost = step_cost(est, machine, run.compute_dtype(plan))
    return plan.scale_cost(run.base, cost, run, est, machine).seconds


def run(device: str = "cpu", quick: bool = False) -> list[dict]:
    shape = _shape(quick)
    batch = _batch(shape)
    machine = probe_machine(device, cache=False)  # this machine now, not a balance cached while it was busy
    model = _model(shape)
    run_ = ModuleRun(model, batch, allow=("recompute", "offload_activations", "fused_loss"), target=device)
    base = run_.base
    plans = {"the run as given": base,
             "full checkpointing + fused loss": base.replace(recompute="full", fused_loss=True),
             "selective checkpointing + fused loss": base.replace(recompute="selective", fused_loss=True),
             "full checkpointing + activation offload": base.replace(recompute="full", offload_activations=True)}
    peak = run_.estimate(base).peak_bytes
    chosen = search_plans(run_, int(peak * 0.6), machine=machine).fitting
    if chosen:
        plans[f"chosen at 60%: {chosen[0].plan.describe(base)}"] = chosen[0].plan
    del model
    predicted = {name: _predicted(run_, plan, machine) for name, plan in plans.items()}
    measured = {name: _measure(shape, batch, plan, device) for name, plan in plans.items()}
    rows, given = [], "the run as given"
    for name in plans:
        p_ratio, m_ratio = predicted[name] / predicted[given], measured[name] / measured[given]
        rows.append({"impl": name, "predicted_s": round(predicted[name], 3), "measured_s": round(measured[name], 3),
                     "predicted_cost": round(p_ratio, 3), "measured_cost": round(m_ratio, 3),
                     "cost_error_%": round(100 * (p_ratio / m_ratio - 1), 1)})
    key = "full checkpointing + fused loss"
    met = abs(predicted[key] / predicted["the run as given"] / (measured[key] / measured["the run as given"]) - 1)
    params = sum(p.numel() for p in _model(shape).parameters())
    case = (f"Llama {params / 1e6:.0f}M parameters, 1 x {shape['seq']} tokens, {torch.get_num_threads()} threads; "
            f"machine probed: {machine.device}")
    return [record("step_time", case, "the run as given", rows,
                   goal=f"full checkpointing + fused loss: predicted step-time cost within {GOAL:.0%} of the measured",
                   met=met <= GOAL)]
