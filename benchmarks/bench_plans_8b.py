"""Single-device plans for Llama-3-8B that the levers of host memory make possible: ``memkit estimate --budget``
on the published Llama-3-8B dimensions (``examples/hf_configs/llama3_8b.json``), for a CUDA device
(``--device cuda``, the default), each search in a fresh interpreter on this machine.

Cases (one entry each; the first plan's levers, device peak, host bytes and predicted step-time cost, the number of
plans estimated and the search's wall time, start-up included):

- QLoRA (nf4, LoRA rank 16, bf16) on 4 sequences of 8,192 tokens, ``--budget 8GiB``;
- a full fine-tune in bf16 on one sequence of 4,096 tokens, ``--budget 24GiB --host-memory 128GiB`` (the optimizer
  state on the host: a host of 128 GiB is assumed, not this machine's free memory);
- QLoRA on 4 sequences of 4,096 tokens, ``--budget 24GiB`` (the search of docs/estimate.md).

Goal: each search finds a plan on one device. These are predictions (estimates on fake tensors), not measured
steps: no GPU is used.

    python -m benchmarks.run --only plans_8b --device cpu [--quick]
"""

from __future__ import annotations

import json
from typing import Any

from benchmarks.bench_estimate import _command
from benchmarks.common import record

CONFIG = "examples/hf_configs/llama3_8b.json"
QLORA = ("--precision", "bf16-true", "--plugin", "nf4-lora")
CASES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("QLoRA nf4, 4 x 8,192 tokens, --budget 8GiB",
     ("--seq-len", "8192", "--batch-size", "4", *QLORA, "--budget", "8GiB")),
    ("full fine-tune bf16-true, 1 x 4,096 tokens, --budget 24GiB --host-memory 128GiB",
     ("--seq-len", "4096", "--batch-size", "1", "--precision", "bf16-true", "--budget", "24GiB",
      "--host-memory", "128GiB")),
    ("QLoRA nf4, 4 x 4,096 tokens, --budget 24GiB",
     ("--seq-len", "4096", "--batch-size", "4", *QLORA, "--budget", "24GiB")),
)
#: ``--quick``: the first two cases at a quarter of the tokens
QUICK = {"8192": "2048", "4096": "1024"}


def _gib(n: int) -> float:
    return round(n / 2**30, 2)


def _case(label: str, flags: tuple[str, ...]) -> dict[str, Any]:
    return plan_entry("plans_8b", f"Llama-3-8B {label}", ("--hf-config", CONFIG, *flags))


def plan_entry(benchmark: str, label: str, args: tuple[str, ...]) -> dict[str, Any]:
    """``memkit estimate <args> --json`` (a ``--budget`` search) in a fresh interpreter as an entry of
    ``benchmark``: the run as given and every plan found (levers, device peak, host bytes, predicted step time,
    devices), the search's counts and time, the goal (the first single-device plan fits the budget with the
    margin) and the first plan's YAML."""
    run = _command((*args, "--json"))
    out = json.loads(run["out"])
    plans = [p for p in out["plans"] if p.get("stages", 1) == 1]
    first = plans[0] if plans else None
    base = out["base"]
    row = {"impl": "the run as given", "plan": base["plan"], "device peak GiB": _gib(base["peak_bytes"]),
           "host GiB": _gib(base["host_bytes"]), "step time (predicted)": "+0%"}
    rows = [row]
    for i, p in enumerate(out["plans"], 1):
        rows.append({"impl": f"plan {i}", "plan": p["plan"], "device peak GiB": _gib(p["peak_bytes"]),
                     "host GiB": _gib(p["host_bytes"]), "step time (predicted)": f"{p['overhead']:+.0%}",
                     "devices": p.get("stages", 1)})
    case = (f"{label} (memkit estimate {' '.join(args)}): {out['estimated']} plans "
            f"estimated, {out['skipped']} ruled out without an estimate; searched in {out['seconds']} s "
            f"({run['seconds']} s with start-up, load average {run['load']} before)")
    fits = first is not None and first["peak_bytes"] * (1 + out["margin"]) <= out["budget_bytes"]
    entry = record(benchmark, case, "the run as given", rows,
                   goal=f"a single-device plan within {_gib(out['budget_bytes'])} GiB with the "
                        f"{out['margin']:.0%} margin", met=fits)
    if first is not None:
        entry["text"] = first["yaml"]
    return entry


def run(device: str = "cpu", quick: bool = False) -> list[dict]:
    if device != "cpu":
        raise ValueError(f"device={device!r}: these are estimates made on this machine for a CUDA device; run it "
                         "with --device cpu")
    cases = CASES[:2] if quick else CASES
    if quick:
        cases = tuple((label, tuple(QUICK.get(f, f) for f in flags)) for label, flags in cases)
    return [_case(label, flags) for label, flags in cases]
