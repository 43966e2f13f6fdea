"""Plans that shard over several GPUs (``memkit estimate --devices N --budget B``) and one rank's estimate against the
same step run on gloo ranks.

Cases:

- Llama-3-8B full fine-tuning in bf16 on one sequence of 4,096 tokens per rank, 4 x 24 GiB, no host offload
  (``examples/hf_configs/llama3_8b.json``, an H100's balance assumed);
- Llama-3-70B QLoRA (nf4, LoRA rank 16, bf16) at 2,048 tokens on 2 x 24 GiB with 128 GiB of host memory
  (``examples/hf_configs/llama3_70b.json``, Llama-3-70B's published dimensions); fsdp_qlora and peft's FSDP + QLoRA
  guide report 19.6 GB per GPU with CPU offload (about 107 GB of host memory) and 35.6 GB without;
- on this CPU: one rank's step estimated on fake tensors under a fake process group against the same step on 2 and
  4 gloo ranks (``benchmarks/_sharding_worker.py``; ``LivePeak`` on every rank): a Llama in bf16, a Qwen3-MoE, a
  peft-wrapped Llama; the Llamas again with FSDP2's CPU offload (host bytes too); the Llama and the Qwen3-MoE again
  with their MLPs tiled (``sharding_cases.TILE`` tokens a tile).

Goals: each search finds a plan under 60 s; the estimate of a rank within 5% of every measured rank.

    python -m benchmarks.run --only sharding --device cpu [--quick]
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks import sharding_cases
from benchmarks.bench_plans_8b import plan_entry
from benchmarks.common import record

ROOT = Path(__file__).resolve().parents[1]
SEARCHES = (
    ("Llama-3-8B full fine-tune bf16-true, 1 x 4,096 tokens per rank, 4 devices, --budget 24GiB",
     ("--hf-config", "examples/hf_configs/llama3_8b.json", "--seq-len", "4096", "--precision", "bf16-true",
      "--devices", "4", "--budget", "24GiB", "--machine", "h100")),
    ("Llama-3-70B QLoRA nf4, 1 x 2,048 tokens per rank, 2 devices, --budget 24GiB --host-memory 128GiB",
     ("--hf-config", "examples/hf_configs/llama3_70b.json", "--seq-len", "2048", "--precision", "bf16-true",
      "--plugin", "nf4-lora", "--devices", "2", "--budget", "24GiB", "--host-memory", "128GiB",
      "--machine", "h100")),
)
PHASES = ("forward", "backward", "optimizer step")


def _search(label: str, args: tuple[str, ...]) -> dict[str, Any]:
    try:
        entry = plan_entry("sharding", label, args)
    except Exception as err:  # noqa: BLE001 - a search that cannot run is a result, said as it is
        return record("sharding", f"{label} (memkit estimate {' '.join(args)})", "the run as given",
                      [{"impl": "not estimated", "error": str(err).strip().splitlines()[-1][:300]}],
                      goal="a plan that fits, found in under 60 s", met=False)
    seconds = float(entry["case"].split("searched in ")[1].split(" s")[0])
    devices = int(args[args.index("--devices") + 1])
    for row in entry["rows"][1:]:  # a sharded plan runs on every device
        row["devices"] = devices if "FSDP2" in row["plan"] else row.get("devices", 1)
    budget = args[args.index("--budget") + 1]
    entry["goal"] = f"a plan within {budget} per rank with the 5% margin, found in under 60 s"
    entry["met"] = bool(entry["met"]) and seconds < 60
    return entry


def _ranks(world: int) -> list[dict] | str:
    """Each rank's measured phases of every case (``_sharding_worker``), or why the run failed."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = Path(tempfile.mkdtemp(prefix="bench_sharding_"))
    procs = []
    for rank in range(world):
        env = dict(os.environ, LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, "-m", "benchmarks._sharding_worker", str(out)], env=env,
                                      cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    for p in procs:
        text, _ = p.communicate(timeout=600)
        if p.returncode:
            return text.strip().splitlines()[-1] if text.strip() else f"exit code {p.returncode}"
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def _table(world: int) -> dict[str, Any]:
    measured = _ranks(world)
    case = f"one rank's step estimated vs measured on {world} gloo ranks (CPU, tiny models, 2 x 32 tokens, AdamW)"
    if isinstance(measured, str):
        return record("sharding", case, "measured", [{"impl": "failed", "error": measured}], met=False)
    rows, worst = [], 0.0
    cases = ([(name, "") for name in sharding_cases.CASES] + [(name, "offloaded") for name in sharding_cases.OFFLOADED]
             + [(name, "tiled") for name in sharding_cases.TILED])
    for name, variant in cases:
        offload = variant == "offloaded"
        est = sharding_cases.estimate(name, world, offload=offload, tiled=variant == "tiled")
        key = f"{name} {variant}".strip()
        predicted = max(p.peak_bytes for p in est.phases if p.phase in PHASES)
        peaks = [max(m[key][p] for p in PHASES) for m in measured]
        errors = [predicted / peak - 1 for peak in peaks]
        if offload:  # the host bytes too
            errors += [est.host_bytes / m[key]["host"] - 1 for m in measured]
        worst = max(worst, *(abs(e) for e in errors))
        rows.append({"impl": key, "predicted B": predicted, **{f"rank {r} B": peak for r, peak in enumerate(peaks)},
                     "predicted host B": est.host_bytes if offload else "",
                     "rank 0 host B": measured[0][key]["host"] if offload else "",
                     "worst error": f"{max(errors, key=abs):+.2%}"})
    return record("sharding", case, "measured", rows, goal="every rank's step peak within 5% of the estimate",
                  met=worst <= 0.05)


def run(device: str = "cpu", quick: bool = False) -> list[dict]:
    if device != "cpu":
        raise ValueError(f"device={device!r}: estimates for a CUDA device made on this machine; run with --device cpu")
    entries = [_table(2), _table(4)]
    if not quick:
        entries = [*(_search(label, args) for label, args in SEARCHES), *entries]
    return entries
