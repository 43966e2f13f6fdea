"""``MemoryBudget`` under ``memkit_fsdp2`` on 2 gloo ranks: one rank's step planned with the module sharded (a fake
process group in the planning process, beside the real one), a budget the replicated run cannot meet met by the
sharded one, the measured rank's peak within the prediction."""

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
        # the rank's measured step against its prediction (CPU: exact live bytes)
        assert fsdp2["predicted"] * 0.95 <= fsdp2["measured"] <= fsdp2["predicted"] * 1.05, fsdp2
        assert result["ddp_tight"]["error"].startswith("NoPlanFits") and "no plan fits" in result["ddp_tight"]["error"]
        tight = result["fsdp2_tight"]
        assert tight["error"] is None and tight["changes"] == [] and tight["predicted"] * 1.05 <= result["between"]
