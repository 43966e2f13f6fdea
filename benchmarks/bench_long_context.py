"""The longest sequence that fits (``memkit estimate --seq-len max``), and the tiled MLP's cut measured on this CPU.

Cases:

- the levers in the order they help: Llama-3.1-8B QLoRA at 65,536 tokens, one lever added at a time (the fused loss,
  full recomputation, activation offload, the tiled MLP): each plan's predicted device peak, host bytes and step time
  (an H100's balance);
- the longest sequence predicted for one sequence of Llama-3.1-8B QLoRA (nf4, LoRA rank 16, bf16) on 24 GiB and on
  80 GiB with 128 GiB of host memory, an H100's balance assumed (``examples/hf_configs/llama3_1_8b.json``, its
  ``max_position_embeddings`` raised from 131,072 to 1,048,576 in a copy: Unsloth's 342,733-token run goes past the
  trained context too); Unsloth reports 78,475 tokens on 24 GB and 342,733 on 80 GB (transformers with
  FlashAttention-2: 5,789 and 28,454), with about 84 GB of host memory for its offloaded activations;
- the same for Qwen3-30B-A3B QLoRA on 80 GiB (``examples/hf_configs/qwen3_30b_a3b.json``, positions raised from
  40,960 to 1,048,576 in a copy);
- on this CPU: a tiny Llama and a tiny Qwen3-MoE (hidden size 64, 2 layers, AdamW, full recomputation and the fused
  loss) on one sequence of 4,096, 8,192 and 16,384 tokens, with and without the tiled MLP: the predicted peak
  (``estimate_training_memory``) against the one ``LivePeak`` measures in the second step of a real ``Trainer.fit``,
  the measured cut, and the step time of the tiled fit against the untiled one (the median of steps 2 to 4, timed
  without ``LivePeak``).

Goals: the Llama lengths beyond Unsloth's; every predicted peak within 5% of the measured one.

    python -m benchmarks.run --only long_context --device cpu [--quick]
"""

from __future__ import annotations

import contextlib
import json
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from benchmarks.bench_estimate import TOLERANCE, Case, _Batches, _callbacks, _command, _module, measure, predict
from benchmarks.common import record

ROOT = Path(__file__).resolve().parents[1]
POSITIONS = 1_048_576
LEVERS = "tiled_mlp,recompute,fused_loss,quantization,offload_activations,offload_optimizer,micro_batch"
#: (label, config, budget, Unsloth's tokens, transformers + FlashAttention-2's tokens), as Unsloth reports them
SEARCHES = (
    ("Llama-3.1-8B QLoRA nf4, batch 1, 24 GiB", "llama3_1_8b.json", "24GiB", 78_475, 5_789),
    ("Llama-3.1-8B QLoRA nf4, batch 1, 80 GiB", "llama3_1_8b.json", "80GiB", 342_733, 28_454),
    ("Qwen3-30B-A3B QLoRA nf4, batch 1, 80 GiB", "qwen3_30b_a3b.json", "80GiB", None, None),
)
LENGTHS = (4096, 8192, 16384)
#: plans estimated by the search at the longest length (the strongest fit there by construction; an estimate of
#: Qwen3-30B-A3B takes 30-45 s on this CPU, every expert of each traced layer run)
FINAL_ESTIMATES = 12
LADDER_TOKENS = 65_536
#: the levers added one at a time, in the order they help a long sequence
LADDER = (("QLoRA nf4 as given", {}), ("+ fused loss", {"fused_loss": True}),
          ("+ full recompute", {"recompute": "full"}), ("+ activation offload", {"offload_activations": True}),
          ("+ tiled MLP", {"tiled_mlp": 4096}))
FEATURES = ("checkpoint", "fused")


def _gib(n: int) -> float:
    return round(n / 2**30, 2)


def _config(name: str, folder: Path) -> tuple[Path, int]:
    """A copy of ``examples/hf_configs/<name>`` with ``max_position_embeddings`` raised to ``POSITIONS``; the
    positions it had."""
    config = json.loads((ROOT / "examples" / "hf_configs" / name).read_text())
    trained = config["max_position_embeddings"]
    config["max_position_embeddings"] = POSITIONS
    path = folder / name
    path.write_text(json.dumps(config, indent=2))
    return path, trained


def _search(label: str, name: str, budget: str, unsloth: int | None, plain: int | None) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        path, trained = _config(name, Path(tmp))
        args = ("--hf-config", str(path), "--precision", "bf16-true", "--plugin", "nf4-lora", "--seq-len", "max",
                "--budget", budget, "--host-memory", "128GiB", "--machine", "h100", "--allow", LEVERS,
                "--max-estimates", str(FINAL_ESTIMATES))
        shown = " ".join(a if a != str(path) else f"{name} (positions {POSITIONS:,})" for a in args)
        case = f"{label} (memkit estimate {shown}; the config trains {trained:,} positions)"
        try:
            out = json.loads(_command((*args, "--json"))["out"])
        except RuntimeError as err:  # a search that cannot run is a result, said as it is
            return record("long_context", case, "Unsloth (reported)",
                          [{"impl": "not estimated", "error": str(err).strip().splitlines()[-1][:300]}], met=False)
    search = out["search"]
    best = search["plans"][0] if search["plans"] else None
    rows = [{"impl": "memkit estimate --seq-len max", "tokens": out["seq_len"],
             "plan": best["plan"] if best else "none fits",
             "device GiB": _gib(best["peak_bytes"]) if best else "",
             "host GiB": _gib(best["host_bytes"]) if best else "",
             "step s (predicted, H100)": round(best["step_seconds"], 2) if best else "",
             "search s": out["seconds"], "lengths probed": len(out["probes"])}]
    if unsloth:
        rows += [{"impl": "Unsloth (reported)", "tokens": unsloth},
                 {"impl": "transformers + FlashAttention-2 (reported by Unsloth)", "tokens": plain}]
    goal = f"beyond Unsloth's {unsloth:,} tokens" if unsloth else "a length found"
    met = best is not None and (unsloth is None or out["seq_len"] > unsloth)
    return record("long_context", case, "Unsloth (reported)", rows, goal=goal, met=met)


def _ladder() -> dict[str, Any]:
    from lightning_memkit.estimate.hf_run import HFRun
    from lightning_memkit.estimate.plans import step_cost
    from lightning_memkit.measure.machine import machine_balance

    machine = machine_balance("h100")
    run = HFRun(ROOT / "examples" / "hf_configs" / "llama3_1_8b.json", seq_len=LADDER_TOKENS, batch_size=1,
                precision="bf16-true", plugin="nf4-lora", allow=tuple(LEVERS.split(",")))
    plan, rows, base = run.base, [], None
    for label, change in LADDER:
        plan = plan.replace(**change)
        start = time.perf_counter()
        est = run.estimate(plan)
        cost = plan.scale_cost(run.base, step_cost(est, machine, run.compute_dtype(plan)), run, est, machine).seconds
        base = base or cost
        largest = est.largest_tensor
        rows.append({"impl": label, "device GiB": _gib(est.peak_bytes), "host GiB": _gib(est.host_bytes),
                     "step s (predicted, H100)": round(cost, 2), "step time": f"{cost / base - 1:+.0%}",
                     "largest tensor": (f"{_gib(largest['bytes'])} GiB {tuple(largest['shape'])} in "
                                        f"{largest['module'] or 'the step'}") if largest else "",
                     "estimated in s": round(time.perf_counter() - start, 1)})
    case = (f"Llama-3.1-8B QLoRA nf4, one sequence of {LADDER_TOKENS:,} tokens: the levers added one at a time "
            "(estimates for an H100)")
    return record("long_context", case, "QLoRA nf4 as given", rows)


def _step_seconds(case: Case, steps: int = 4) -> float:
    """The median seconds of steps 2 to ``steps`` of a real ``Trainer.fit`` of ``case`` (no ``LivePeak``)."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback

    times: list[float] = []

    class Clock(Callback):
        def on_train_batch_start(self, *args: Any) -> None:
            self.start = time.perf_counter()

        def on_train_batch_end(self, *args: Any) -> None:
            times.append(time.perf_counter() - self.start)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, precision=case.precision, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             callbacks=_callbacks(case, Clock()))
        loader = torch.utils.data.DataLoader(_Batches(case), batch_size=case.rows)
        with contextlib.redirect_stdout(None), contextlib.redirect_stderr(None):
            trainer.fit(_module(case), loader)
    return statistics.median(times[1:])


def _table(family: str, lengths: tuple[int, ...]) -> dict[str, Any]:
    rows, worst = [], 0.0
    for tokens in lengths:
        plain, tiled = (Case(family, feats, seq=tokens, rows=1) for feats in (FEATURES, (*FEATURES, "tiled")))
        (p_plain, m_plain), (p_tiled, m_tiled) = ((predict(c), measure(c)) for c in (plain, tiled))
        worst = max(worst, abs(p_plain / m_plain - 1), abs(p_tiled / m_tiled - 1))
        ratio = _step_seconds(tiled) / _step_seconds(plain)
        rows.append({"impl": f"{tokens:,} tokens", "untiled predicted B": p_plain, "untiled measured B": m_plain,
                     "tiled predicted B": p_tiled, "tiled measured B": m_tiled,
                     "worst error": f"{max(p_plain / m_plain - 1, p_tiled / m_tiled - 1, key=abs):+.2%}",
                     "cut (measured)": f"{1 - m_tiled / m_plain:.1%}", "step time tiled / untiled": round(ratio, 2)})
    case = (f"tiny {family} (hidden 64, 2 layers, AdamW, full recompute + fused loss), one sequence: tiled MLP "
            "(tiles of 64 tokens) vs untiled, predicted vs measured (LivePeak, second step of Trainer.fit)")
    return record("long_context", case, "untiled", rows, goal=f"every predicted peak within {TOLERANCE:.0%}",
                  met=worst <= TOLERANCE)


def run(device: str = "cpu", quick: bool = False) -> list[dict]:
    if device != "cpu":
        raise ValueError(f"device={device!r}: estimates and the CPU table are made on this machine; run with "
                         "--device cpu")
    lengths = LENGTHS[:1] if quick else LENGTHS
    entries = [_table(family, lengths) for family in ("llama", "qwen3_moe")]
    if not quick:
        entries = [_ladder(), *(_search(*s) for s in SEARCHES), *entries]
    return entries
