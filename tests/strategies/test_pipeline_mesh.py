"""memkit_pipeline on a 2-D mesh: 4 gloo processes, 2 pipeline ranks x 2 data-parallel replicas."""

import json
from pathlib import Path

import pytest
import ranks
import torch

WORKER = Path(__file__).with_name("_pipeline_mesh_worker.py")


def launch(tmp_path: Path, phase: str, world: int, budget: float = 280) -> list[dict]:
    for code, out in ranks.wait(ranks.launch(WORKER, [str(tmp_path), phase], world, OMP_NUM_THREADS="1"), budget,
                                f"{phase} run"):
        assert code == 0, out[-4000:]
    return [json.loads((tmp_path / f"{phase}_rank{r}.json").read_text()) for r in range(world)]


@pytest.mark.slow
def test_two_replicas_of_a_two_stage_pipeline_train_as_one_process_with_clipping_and_resume_exactly(tmp_path):
    results = launch(tmp_path, "mesh", 4)
    r0 = results[0]
    ref = r0["reference"]
    assert r0["mesh"] == [2, 2]
    # each replica reads its own shard: ranks 0, 1 are replica 0, ranks 2, 3 replica 1
    assert [(r["sampler"], r["sampler_rank"]) for r in results] == [("DistributedSampler", i // 2) for i in range(4)]
    # every rank logs the same loss: the mean over both replicas, which is the single process's loss
    assert all(r["train"] == r0["train"] for r in results)
    assert r0["train"] == pytest.approx(ref["train"], rel=1e-5, abs=1e-6)
    # final weights (merged from the pipeline shards) = the single process's, with global-norm clipping
    for name, value in ref["state"].items():
        torch.testing.assert_close(torch.tensor(r0["state"][name]), torch.tensor(value), rtol=1e-5, atol=1e-6,
                                   msg=name)
    # resume from the step-2 checkpoint on the same mesh: bitwise the same steps 3 and 4 and the same weights
    assert r0["resumed"] == r0["train"][2:]
    assert r0["resumed_equal"] is True
    # clipping by value: the replicas' averaged gradients, clipped entry by entry, as one process
    assert all(r["value"] == r0["value"] for r in results)
    assert r0["value"] == pytest.approx(r0["value_reference"], rel=1e-5, abs=1e-6)
    assert r0["value"] != pytest.approx(r0["train"], rel=1e-4)  # the two clippings give other runs
    # a head tied to the embedding, the two on different ranks: gradients summed, one update on both copies
    assert all(r["tied"] == r0["tied"] for r in results)
    assert r0["tied"] == pytest.approx(r0["tied_reference"], rel=1e-5, abs=1e-6)
    assert r0["tied_keys"] == ["head.weight", "tok_emb.weight"] and r0["tied_equal"] is True
    assert r0["tied_error"] < 1e-5
    # the checkpoint of a 2-replica run loads into a 1-replica run (parameters do not depend on dp)
    one = launch(tmp_path, "one_replica", 2)
    assert one[0]["mesh"] == [1, 2]
    assert one[0]["val_step2"] == pytest.approx(r0["val_step2"], rel=1e-5)


@pytest.mark.slow
def test_stages_sharded_over_two_replicas_with_fsdp_train_as_one_process(tmp_path):
    results = launch(tmp_path, "fsdp", 4)
    r0 = results[0]
    assert r0["sharded"] == "DTensor"
    for tied in (False, True):  # with a tied head too: its two copies are sharded and summed shard by shard
        assert all(r[f"train_{tied}"] == r0[f"train_{tied}"] for r in results)
        assert r0[f"train_{tied}"] == pytest.approx(r0[f"reference_{tied}"], rel=1e-5, abs=1e-6), tied
        assert r0[f"state_error_{tied}"] < 1e-5  # the checkpoint holds full tensors: one process's weights
    # resume from the sharded run's epoch-0 checkpoint: bitwise the same steps, sharded or replicated
    assert r0["resumed"] == r0["train_False"][2:]
    assert r0["resumed_ddp"] == pytest.approx(r0["train_False"][2:], rel=1e-6)
    assert r0["value"] == pytest.approx(r0["value_reference"], rel=1e-5, abs=1e-6)  # clipping by value, on shards


@pytest.mark.slow
def test_a_killed_rank_makes_every_other_rank_fail_within_the_timeout(tmp_path):
    """Rank 3 exits at step 1 (timeout=10 s): ranks 0-2 raise instead of hanging, within the timeout and start-up."""
    done = ranks.wait(ranks.launch(WORKER, [str(tmp_path), "kill"], 4, OMP_NUM_THREADS="1"), 120, "killed run")
    codes = [code for code, _ in done]
    assert codes[3] == 17
    assert all(code not in (0, None) for code in codes[:3]), codes
    assert not any((tmp_path / f"kill_rank{r}.json").exists() for r in range(4))
