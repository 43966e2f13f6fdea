"""ActivationCheckpointing, PhaseMemoryRelease and StageBoundaryRelease under FSDPStrategy (FSDP1) and
ModelParallelStrategy with ``fully_shard`` (FSDP2): two gloo ranks on CPU, run by ``_fsdp_worker.py``."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import ranks
import torch
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

from lightning_memkit.callbacks import ActivationCheckpointing
from lightning_memkit.demo.tiny_lm import Block, TinyLM
from lightning_memkit.memory import LivePeak
from lightning_memkit.ops.padded_index_gather import padded_rows

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("_fsdp_worker.py")
KINDS = [pytest.param("fsdp", marks=pytest.mark.slow), "model_parallel"]
_RUNS: dict[tuple[str, str], list[dict]] = {}




def _run(kind: str, scenario: str, tmp_path_factory) -> list[dict]:
    """Both ranks' results of one worker scenario (run once per session)."""
    if (kind, scenario) in _RUNS:
        return _RUNS[kind, scenario]
    out = tmp_path_factory.mktemp(f"{kind}_{scenario}")
    procs = ranks.launch(WORKER, [kind, scenario, str(out)], 2, OMP_NUM_THREADS="1")
    for rank, (code, log) in enumerate(ranks.wait(procs, 480, f"{kind} {scenario} run")):
        assert code == 0 and f"rank {rank} ok" in log, log[-4000:]
    _RUNS[kind, scenario] = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    return _RUNS[kind, scenario]


def _model() -> TinyLM:
    return TinyLM(d_model=16, n_layers=2, n_heads=2, seq_len=8)  # the worker's model


# -- ActivationCheckpointing -----------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_checkpointing_recomputes_inside_the_units_with_equal_losses_and_a_lower_peak(kind, tmp_path_factory):
    unit_block = "Block" if kind == "fsdp" else "FSDPBlock"  # FSDP1: the Block inside FullyShardedDataParallel
    for rank, res in enumerate(_run(kind, "checkpointing", tmp_path_factory)):
        plain = res["plain"]
        assert plain["recomputed"] == [[], [], []]
        for name in ("auto", "policy"):
            run = res[name]
            assert run["losses"] == plain["losses"], (rank, name)  # recomputation changes no number
            assert run["checkpointed"] == ["blocks.0", "blocks.1"]  # names without FSDP's wrappers
            assert run["recomputed"] == [[unit_block, unit_block]] * 3
            assert all(a < b for a, b in zip(run["peaks"], plain["peaks"])), (rank, name, run["peaks"], plain["peaks"])
            assert run["left_after_fit"] == 0  # every forward restored at teardown
        assert "which contains the FSDP unit blocks.0: recompute must run inside FSDP units" in res["around_units"]


def test_checkpointing_refusals_under_sharded_strategies():
    model = _model()
    for strategy in (FSDPStrategy(), ModelParallelStrategy()):
        trainer, kind = SimpleNamespace(strategy=strategy), type(strategy).__name__
        with pytest.raises(ValueError, match=rf"budget_bytes=1000000\) plans on one device and does not run under "
                                             rf"{kind}"):
            ActivationCheckpointing(policy={Block}, budget_bytes=10**6).setup(trainer, model, "fit")
        offload = ActivationCheckpointing(policy={Block})
        offload.offload = True  # set after construction: the constructor refuses offload without CUDA
        with pytest.raises(ValueError, match=rf"offload=True\) does not run under {kind}: save_on_cpu would also"):
            offload.setup(trainer, model, "fit")
        ActivationCheckpointing(policy={Block}).setup(trainer, model, "fit")  # the plain callback is accepted
    deepspeed = SimpleNamespace(strategy=type("DeepSpeedStrategy", (), {})())
    with pytest.raises(ValueError, match=r"does not run under DeepSpeedStrategy.*partition_activations"):
        ActivationCheckpointing(policy={Block}).setup(deepspeed, model, "fit")


def test_layers_in_torchs_checkpoint_wrapper_are_refused_not_recomputed_twice():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = _model()
    model.blocks[1] = checkpoint_wrapper(model.blocks[1])  # as apply_activation_checkpointing does
    trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cpu")))
    with pytest.raises(ValueError, match=r"1 chosen layers \(blocks\.1\) already recompute themselves .*"
                                         r"checkpoint_wrapper"):
        ActivationCheckpointing(policy={Block}).on_fit_start(trainer, model)
    assert "forward" not in vars(model.blocks[0])  # nothing patched


# -- PhaseMemoryRelease ----------------------------------------------------------------------------------------
def _fsdp1_states(rank: int) -> int:
    """Parameters with a non-empty piece in ``rank``'s half of each FSDP1 flat parameter (root unit, then blocks)."""
    model, count = _model(), 0
    units = [[p for n, p in model.named_parameters() if not n.startswith("blocks.")]]
    units += [list(b.parameters()) for b in model.blocks]
    for params in units:
        sizes = [p.numel() for p in params]
        assert sum(sizes) % 2 == 0  # no padding: each rank holds exactly half
        lo, hi, start = rank * sum(sizes) // 2, (rank + 1) * sum(sizes) // 2, 0
        for n in sizes:
            count += start < hi and start + n > lo
            start += n
    return count


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["fsdp", "model_parallel"])
def test_phase_release_frees_this_ranks_shard_of_gradients_and_optimizer_state(kind, tmp_path_factory):
    total = sum(p.numel() for p in _model().parameters())
    root = total - sum(p.numel() for p in _model().blocks.parameters())
    for rank, res in enumerate(_run(kind, "release", tmp_path_factory)):
        result, single = res["result"], res["single"]
        assert result["grad_bytes"] == total * 4 // 2 == single["grad_bytes"] // 2  # fp32, half the model per rank
        states = _fsdp1_states(rank) if kind == "fsdp" else len(list(_model().parameters()))
        assert res["states"] == states
        # AdamW: exp_avg and exp_avg_sq of the shard, plus one 4-byte step per parameter with state
        assert result["optimizer_state_bytes"] == 2 * result["grad_bytes"] + 4 * states
        assert result["unsharded_bytes"] == 0  # backward resharded every unit
        assert result["retained_bytes"] == single["retained_bytes"]  # no more left than on one device
        assert res["grads_left"] == 0 and res["shards_allocated"] and res["same_output"]
        assert res["sharded_after"] is (True if kind == "model_parallel" else None)
        # ending on validation: FSDP2 keeps the root unit gathered, FSDP1 SHARD_GRAD_OP every unit
        gathered = res["gathered"]
        assert gathered["unsharded_bytes"] == 4 * (total if kind == "fsdp" else root)
        assert f"gathered FSDP weights {gathered['unsharded_bytes']:,})" in res["gathered_effect"]
        assert gathered["retained_bytes"] == res["single_validated"]["retained_bytes"]
        assert res["same_output_resharded"]


def test_refresh_sizes_sees_a_storage_freed_outside_an_op():
    """FSDP frees its gathered parameters with ``untyped_storage().resize_(0)``, which no op reports."""
    with LivePeak() as live:
        t = torch.empty(256)
        t.untyped_storage().resize_(0)
        assert live.live_bytes == 1024
        assert live.refresh_sizes() == -1024
        assert (live.live_bytes, live.peak_bytes) == (0, 1024)
        assert live.refresh_sizes() == 0


# -- StageBoundaryRelease --------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["fsdp", "model_parallel"])
def test_stage_boundary_release_frees_the_same_bytes_as_on_one_device(kind, tmp_path_factory):
    rows = 4 * 8 * 2  # batch x sequence x top_k on each rank
    per_layer = (padded_rows(rows, 24) + rows) * 16 * 4  # dispatch input (padded) + expert outputs, fp32
    for res in _run(kind, "boundary", tmp_path_factory):
        release = res["release"]
        assert release["losses"] == res["plain"]["losses"]
        assert release["released_bytes"] == 3 * 2 * per_layer == res["single_released_bytes"]
        assert (release["released"], release["kept"]) == (3 * 2 * 2, 0)
