"""The planner's answers on fixed cases, as a table: every estimate benchmark case's predicted peak, and plan
searches (HF configs, LightningCLI configs, modules as built) at two budgets: each search's plans in the
order estimated with their predicted peaks and overheads, and the plans it returns. ``test_plan_table.py``
holds the table the planner gave before its levers moved onto one protocol; the planner must keep giving it.

``python tests/estimate/plan_table.py`` prints the table as JSON (``> tests/estimate/plan_table.json`` to renew it,
only for a change meant to alter the planner's answers).
"""

from __future__ import annotations

import json
import sys
import tempfile
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FRACTIONS = (0.6, 0.3)  # budgets as fractions of the run-as-given's predicted peak


def _search_rows(run, fractions=FRACTIONS) -> list[dict]:
    from lightning_memkit.estimate.plans import search_plans
    from lightning_memkit.measure.machine import H100

    base = run.estimate(run.base).peak_bytes
    rows = []
    for fraction in fractions:
        lines: list[str] = []
        # one fixed balance (an H100's), whatever machine runs the table
        result = search_plans(run, max(int(base * fraction), 1), max_plans=3, progress=lines.append, machine=H100)
        rows.append({"budget": int(base * fraction), "estimated": result.estimated, "skipped": result.skipped,
                     "tried": [line.split(": ", 1)[1].split(" (")[0] for line in lines],
                     "base_peak": result.base.peak_bytes,
                     "plans": [[r.plan.describe(run.base), r.peak_bytes, round(r.overhead, 6), r.yaml()]
                               for r in result.fitting]})
    return rows


def _hf_searches() -> dict:
    from lightning_memkit.demo.hf_models import tiny_hf_config
    from lightning_memkit.estimate.hf_run import HFRun

    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for family, kwargs in (("llama", {}), ("llama", {"plugin": "nf4-lora", "precision": "bf16-true"}),
                               ("qwen3_moe", {"activation_checkpointing": "selective", "fused_loss": True})):
            path = Path(tmp) / f"{family}.json"
            path.write_text(tiny_hf_config(family, hidden_size=64, num_layers=4, vocab_size=1000).to_json_string())
            run = HFRun(path, seq_len=64, batch_size=4, device="cpu", lora_rank=8, **kwargs)
            out[f"hf {family} {sorted(kwargs.items())}"] = _search_rows(run)
    return out


def _config_searches() -> dict:
    from lightning_memkit.estimate.config_run import ConfigRun

    out = {}
    for name in ("tiny_lm_qlora.yaml", "hf_llama_peft_lora.yaml"):
        run = ConfigRun(ROOT / "examples" / "configs" / name)
        out[f"config {name}"] = _search_rows(run)
    return out


def _module_searches() -> dict:
    import torch

    from lightning_memkit.demo import HFCausalLM, TinyLM
    from lightning_memkit.estimate.module import ModuleRun

    out = {}
    torch.manual_seed(0)
    lm = TinyLM(d_model=32, n_layers=2, n_heads=2, seq_len=32)
    tokens = torch.randint(0, 256, (8, 33))
    for allow in (("recompute", "fused_loss", "micro_batch"), ("recompute", "fused_loss", "micro_batch", "precision")):
        run = ModuleRun(lm, (tokens[:, :-1], tokens[:, 1:]), allow=allow)
        out[f"module TinyLM {list(allow)}"] = _search_rows(run)
    hf = HFCausalLM("qwen3_moe", hidden_size=32, num_layers=2, vocab_size=256, seed=0)
    ids = torch.randint(0, 256, (4, 32))
    run = ModuleRun(hf, {"input_ids": ids, "labels": ids})
    out["module HFCausalLM qwen3_moe"] = _search_rows(run)
    return out


def _estimate_cases() -> dict:
    sys.path.insert(0, str(ROOT))
    from benchmarks.bench_estimate import CASES, predict

    return {case.name: predict(case) for case in CASES}


def _rooted(value):
    """``value`` with the checkout's path written ``<root>``, so the table holds on any checkout."""
    if isinstance(value, str):
        return value.replace(str(ROOT), "<root>")
    if isinstance(value, dict):
        return {key: _rooted(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_rooted(item) for item in value]
    return value


#: the table's parts, each computed on its own (the test runs them apart, on as many workers as there are)
PARTS = {"estimates": _estimate_cases, "hf searches": _hf_searches, "config searches": _config_searches,
         "module searches": _module_searches}


def part(name: str) -> dict:
    """One part of :func:`table`: ``{"estimates": ...}`` or ``{"searches": ...}`` with that part's searches.

    Computed as on a CPU with bf16 kernels, whatever CPU runs it: where bf16 GEMMs are emulated (AVX2), the fused
    loss multiplies fp32 copies and its chunks, and so its bytes, differ (the table was recorded with them)."""
    import importlib
    from unittest import mock

    fused = importlib.import_module("lightning_memkit.ops.linear_cross_entropy")  # the module, not its function
    with warnings.catch_warnings(), mock.patch.object(fused, "native_half_matmul", lambda dtype: True):
        warnings.simplefilter("ignore")
        rows = _rooted(PARTS[name]())
    return {"estimates": rows} if name == "estimates" else {"searches": rows}


def table() -> dict:
    """The planner's answers on every case (several minutes on 2 cores)."""
    parts = [part(name) for name in PARTS]
    return {"estimates": parts[0]["estimates"], "searches": {k: v for p in parts[1:] for k, v in p["searches"].items()}}


if __name__ == "__main__":
    print(json.dumps(table(), indent=1))
