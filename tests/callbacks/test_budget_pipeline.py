"""MemoryBudget under memkit_pipeline, 2 gloo processes: planned per rank from the strategy's own predictions
(each stage's layers and the schedule's in-flight microbatches), a budget the run as given exceeds met by more
microbatches and the fused loss with the same losses, a plentiful budget changing nothing, and a budget nothing
reaches refused at setup on both ranks in one line."""

from pathlib import Path

import pytest
import ranks

from lightning_memkit.callbacks.budget_pipeline import candidates

WORKER = Path(__file__).with_name("_budget_pipeline_worker.py")


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    return ranks.collect(WORKER, tmp_path_factory.mktemp("budget_pipeline"), 2, 240, "pipeline fits")


@pytest.mark.slow
def test_a_budget_the_pipeline_exceeds_is_met_per_rank_with_the_same_losses(results):
    for result in results:
        as_is, tight = result["as_is"], result["tight"]
        budget = int(result["busiest"] * 0.85)
        assert max(as_is["peaks"]) > budget / 1.05  # the run as given does not fit: the budget needs changes
        assert tight["error"] is None and tight["changes"]
        assert (tight["microbatches"], tight["fused"]) != (as_is["microbatches"], as_is["fused"])
        assert max(tight["peaks"]) <= budget / 1.05  # every rank's predicted peak, the strategy's own split
        assert tight["steps"] == pytest.approx(as_is["steps"], abs=1e-4) and len(tight["steps"]) == 3
    assert results[0]["tight"]["peaks"] == results[1]["tight"]["peaks"]  # one plan, the same on every rank


@pytest.mark.slow
def test_a_plentiful_budget_leaves_the_pipeline_as_given(results):
    for result in results:
        plentiful, as_is = result["plentiful"], result["as_is"]
        assert plentiful["changes"] == [] and plentiful["steps"] == as_is["steps"]
        assert (plentiful["microbatches"], plentiful["fused"], plentiful["peaks"]) == (
            as_is["microbatches"], as_is["fused"], as_is["peaks"])


@pytest.mark.slow
def test_a_budget_nothing_reaches_stops_every_rank_at_setup_in_one_line(results):
    for result in results:
        error = result["none"]["error"]
        assert error.startswith("NoPlanFits: MemoryBudget(budget=") and "no memkit_pipeline plan fits" in error
        assert "the smallest busiest-rank peak is" in error and "\n" not in error
        assert result["none"]["steps"] == []


class _Options:
    def __init__(self, microbatches, fused, hf):
        self.microbatches, self.fused_loss, self.splits_hf_model = microbatches, fused, hf


def test_candidates_start_as_given_and_respect_allow():
    assert list(candidates(_Options(2, False, True), ("fused_loss", "micro_batch"), 2)) == [
        (2, False), (2, True), (4, True), (8, True)]
    assert list(candidates(_Options(2, False, False), ("fused_loss", "micro_batch"), 1)) == [(2, False), (4, False)]
    assert list(candidates(_Options(4, True, True), ("recompute",), 3)) == [(4, True)]
