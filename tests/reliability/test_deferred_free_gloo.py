"""DeferredFree with a real collective: before, a completed gloo all_to_all_single(async_op=True) still
held its buffer through the work handle and ``drain`` refused every release."""

import os
from pathlib import Path

import ranks

WORKER = Path(__file__).with_name("_deferred_free_gloo_worker.py")
ROOT = Path(__file__).resolve().parents[2]




def test_deferred_free_releases_after_a_real_gloo_all_to_all():
    port, world = ranks.free_port(), 2
    procs = [ranks.start([WORKER], dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                                        MASTER_PORT=str(port), PYTHONPATH=str(ROOT))) for rank in range(world)]
    outputs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=120)
            outputs.append(out)
    finally:
        for p in procs:
            p.kill()
    for rank, (p, out) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0 and f"rank {rank} ok" in out, out
