"""``MemoryBudget`` under ``memkit_fsdp2`` on 2 gloo ranks: one rank's step planned with the module sharded (a fake
process group in the planning process, beside the real one), a budget the replicated run cannot meet met by the
sharded one, each rank's measured peak within its prediction (a DDP replica's gradient buckets included)."""

from __future__ import annotations

from pathlib import Path

import pytest
import ranks

WORKER = Path(__file__).with_name("_budget_fsdp2_worker.py")


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    return ranks.collect(WORKER, tmp_path_factory.mktemp("budget_fsdp2"), 2, 300, "MemoryBudget fits under FSDP2")


@pytest.mark.slow
def test_a_sharded_rank_is_planned_and_meets_a_budget_the_replicated_one_cannot(results):
    for result in results:
        ddp, fsdp2 = result["ddp"], result["fsdp2"]
        assert ddp["error"] is None and fsdp2["error"] is None
        assert fsdp2["plan"]["sharding"] == "full_shard" and ddp["plan"]["sharding"] is None
        assert fsdp2["predicted"] < ddp["predicted"]
        # each rank's measured step against its prediction (CPU: exact live bytes); a DDP replica's buckets counted
        for run in (ddp, fsdp2):
            assert run["predicted"] * 0.95 <= run["measured"] <= run["predicted"] * 1.05, run
        assert result["ddp_tight"]["error"].startswith("NoPlanFits") and "no plan fits" in result["ddp_tight"]["error"]
        tight = result["fsdp2_tight"]
        assert tight["error"] is None and tight["changes"] == [] and tight["predicted"] * 1.05 <= result["between"]
