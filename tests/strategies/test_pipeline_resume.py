"""A ``memkit_pipeline`` fit on 2 gloo ranks of a tiny Hugging Face Llama, with the package's features (the strategy's
fused loss, ``ActivationCheckpointing``, ``MemoryBudget`` planning the microbatches per rank, nf4 QLoRA with
``NoSaveBitsandbytesPrecision``), killed with SIGKILL in an optimizer step of one rank and resumed with
``ckpt_path="last"`` in fresh processes, has the losses of the same 2-rank fit that never stopped, bitwise, and runs
the same plan."""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

import _pipeline_resume_worker as worker
import pytest
import ranks

from lightning_memkit.pipeline.checkpoint import verify_checkpoint

WORKER = Path(worker.__file__)
KILL_AT = 4  # the 5th optimizer step; last.ckpt then holds step 4, the end of epoch 1 (2 steps per epoch)
BUDGET_S = 120  # seconds for one 2-rank fit (about 6 s on 2 cores)


def _launch(out: Path, names: str, mode: str, kill_at: int = -1, victim: int = 1) -> list:
    return ranks.launch(WORKER, [str(out), names, str(kill_at), str(victim), mode], 2, OMP_NUM_THREADS="1")


def _results(out: Path, mode: str) -> list[dict]:
    return [json.loads((out / f"{mode}_rank{r}.json").read_text()) for r in range(2)]


def _fit(out: Path, names: str, mode: str) -> list[dict]:
    """A 2-rank fit to its end (``resume``: from ``out/ckpt/last.ckpt``); what each rank recorded."""
    for code, log in ranks.wait(_launch(out, names, mode), BUDGET_S, mode):
        assert code == 0, log[-4000:]
    return _results(out, mode)


def _killed(out: Path, names: str, victim: int) -> list[dict]:
    """A 2-rank fit whose rank ``victim`` kills itself in optimizer step ``KILL_AT``; the other rank then fails on
    its own (its peer's connection is gone, or the process group's timeout) or is killed here after a grace time."""
    procs = _launch(out, names, "fit", KILL_AT, victim)
    try:
        try:
            dead, _ = procs[victim].communicate(timeout=BUDGET_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"rank {victim} did not kill itself within {BUDGET_S} s")
        survivor = procs[1 - victim]
        try:
            left, _ = survivor.communicate(timeout=worker.TIMEOUT + 30)
        except subprocess.TimeoutExpired:  # still blocked in a collective: end it
            survivor.kill()
            left, _ = survivor.communicate(timeout=30)
    finally:
        for p in procs:
            p.kill()
    assert procs[victim].returncode == -signal.SIGKILL, dead[-4000:]
    assert survivor.returncode != 0, left[-4000:]  # it cannot finish without its peer
    return _results(out, "fit")


def _check_features(names: str, results: list[dict]) -> None:
    """Each feature asked for is in effect on both ranks, with one plan."""
    plan = results[0]["plan"]
    assert results[1]["plan"] == plan
    if "budget" in names:  # it had to change the run: 4 microbatches (from 2) and the fused loss
        assert (plan["microbatches"], plan["fused_loss"]) == (4, True) and plan["budget_changes"]
    else:
        assert plan["microbatches"] == worker.MICROBATCHES and plan["fused_loss"] == ("fused" in names)
    recompute = 2 if "checkpointing" in names else 1  # a recomputed layer runs its forward again in backward
    for result in results:
        assert result["local_layers"] == 1  # each rank holds one of the 2 decoder layers
        assert result["quantized_local_layers"] == (7 if "qlora" in names else 0)  # q, k, v, o, gate, up, down
        calls = result["attention_calls"][1:]  # (the first step also runs torch's shape inference)
        assert calls and set(calls) == {recompute * plan["microbatches"]}


@pytest.mark.parametrize(("names", "victim"), [
    pytest.param("qlora,fused,checkpointing,budget", 1, marks=pytest.mark.slow),  # one process: the fast suite
    pytest.param("fused,checkpointing,budget", 0, marks=pytest.mark.slow),
    pytest.param("checkpointing,budget", 1, marks=pytest.mark.slow),  # the budget turns on the fused loss
    pytest.param("fused", 0, marks=pytest.mark.slow),
    pytest.param("qlora", 1, marks=pytest.mark.slow),
    pytest.param("qlora,fused,checkpointing", 0, marks=pytest.mark.slow),
    pytest.param("-", 1, marks=pytest.mark.slow),
])
def test_a_pipeline_fit_killed_mid_training_resumes_with_the_uninterrupted_losses(tmp_path, names, victim):
    killed = _killed(tmp_path, names, victim)
    seen = killed[victim]["losses"]
    assert len(seen) == KILL_AT  # the victim died in the next step's optimizer step
    assert killed[1 - victim]["losses"][:KILL_AT] == seen
    manifest = verify_checkpoint(tmp_path / "ckpt" / "last.ckpt")  # committed, every shard intact
    assert (manifest["global_step"], manifest["world_size"]) == (KILL_AT, 2)

    resumed = _fit(tmp_path, names, "resume")
    for result in resumed:
        assert result["start_step"] == KILL_AT and result["losses"] == resumed[0]["losses"]
    # The same plan as the killed run and as the checkpoint. MemoryBudget plans again on resume (measured, the same
    # peaks); without it the strategy restores the checkpoint's split and predicts its peaks from the weights and
    # optimizer state alone (no measurement on resume): the peaks are compared only with the budget.
    same = [k for k in resumed[0]["plan"] if k != "peaks" or "budget" in names]
    assert {k: resumed[0]["plan"][k] for k in same} == {k: killed[0]["plan"][k] for k in same}
    assert (manifest["meta"]["microbatches"], manifest["meta"]["sizes"]) == (
        resumed[0]["plan"]["microbatches"], resumed[0]["plan"]["sizes"])
    _check_features(names, resumed)

    straight = _fit(tmp_path / "straight", names, "fit")
    _check_features(names, straight)
    assert {k: straight[0]["plan"][k] for k in same} == {k: resumed[0]["plan"][k] for k in same}
    assert straight[0]["losses"] == straight[1]["losses"]
    assert len(straight[0]["losses"]) == worker.STEPS
    assert seen + resumed[0]["losses"] == straight[0]["losses"]  # bitwise (float equality)
