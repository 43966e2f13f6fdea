"""The same plan on an idle machine and on a busy one: a bf16 QLoRA + peft fine-tune's search ranked with this CPU's
balance measured as it is, then measured again on one core shared with two processes multiplying matrices (the
probe's rates fall by half or more, not all alike), chooses the same plan: plans the step time model cannot tell apart
rank by the levers they change (``search_plans``' tie band), not by the probe's noise."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import warnings

import pytest
import torch

pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")

from lightning_memkit.demo import HFCausalLM  # noqa: E402
from lightning_memkit.estimate.module import ModuleRun  # noqa: E402
from lightning_memkit.estimate.plans import search_plans  # noqa: E402
from lightning_memkit.measure.machine import probe_machine  # noqa: E402
from lightning_memkit.plugins import NoSaveBitsandbytesPrecision  # noqa: E402

BUSY = ("import torch\ntorch.set_num_threads(1)\na = torch.randn(512, 512)\n"
        "while True:\n    a = torch.mm(a, a).tanh_()\n")


def _busy_balance():
    """The balance probed on one core that two busy processes share with it (whatever the machine's core count)."""
    before = os.sched_getaffinity(0)
    core = {min(before)}
    workers = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(2)]
    try:
        for w in workers:
            os.sched_setaffinity(w.pid, core)
        os.sched_setaffinity(0, core)
        time.sleep(2.0)  # all running
        return probe_machine("cpu", cache=False)
    finally:
        os.sched_setaffinity(0, before)
        for w in workers:
            w.kill()
            w.wait()


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="pins processes to one core (Linux)")
def test_an_idle_and_a_busy_probe_choose_the_same_plan() -> None:
    idle = probe_machine("cpu", cache=False)
    busy = _busy_balance()
    assert busy.gemm("float32") < idle.gemm("float32")  # the load is real
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = HFCausalLM(family="llama", hidden_size=64, num_layers=2, vocab_size=1024,
                           peft_lora={"r": 4, "target_modules": ["q_proj", "v_proj"]})
    ids = torch.randint(0, 1024, (4, 128), generator=torch.Generator().manual_seed(0))
    run = ModuleRun(model, {"input_ids": ids, "labels": ids}, plugin=NoSaveBitsandbytesPrecision("nf4", "bfloat16"),
                    allow=("recompute", "fused_loss", "micro_batch", "optimizer_in_backward", "offload_optimizer"))
    budget = int(run.estimate(run.base).peak_bytes * 0.6)
    plans = [search_plans(run, budget, max_plans=1, machine=m).fitting[0].plan for m in (idle, busy)]
    assert plans[0] == plans[1], [p.describe(run.base) for p in plans]
