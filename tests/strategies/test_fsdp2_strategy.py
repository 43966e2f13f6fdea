"""``strategy="memkit_fsdp2"``: Lightning's ModelParallelStrategy with the module sharded for it (each decoder layer a
FSDP2 unit), on 2 gloo ranks, trains as one process does on the same global batches."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import ranks

sys.path.insert(0, str(Path(__file__).parent))
import fsdp2_data  # noqa: E402

pytest.importorskip("transformers")
WORKER = Path(__file__).with_name("_fsdp2_strategy_worker.py")


def one_process(features: bool, qlora: bool = False, family: str = "llama", peft: bool = False,
                export: Path | None = None) -> tuple[list[float], dict]:
    import lightning.pytorch as pl
    import torch

    from lightning_memkit.finetune import ExportAdapters

    losses = []

    class Record(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(outputs["loss"].item())

    model = fsdp2_data.module(family, peft)
    pl.Trainer(accelerator="cpu", devices=1, max_steps=fsdp2_data.STEPS,
               callbacks=[fsdp2_data.seeded(), Record(), *(fsdp2_data.features() if features else []),
                          *([ExportAdapters(str(export))] if export else [])], logger=False,
               plugins=fsdp2_data.plugins(peft) if qlora else None,
               enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False).fit(
        model, fsdp2_data.loader())
    state = {k: v.detach().float().flatten()[:64] for k, v in model.state_dict().items()}
    return losses, {k: torch.as_tensor(v) for k, v in state.items()}


def test_the_strategy_is_a_model_parallel_strategy_that_needs_no_configure_model():
    from lightning.pytorch import Trainer
    from lightning.pytorch.strategies import ModelParallelStrategy

    import lightning_memkit  # noqa: F401

    trainer = Trainer(accelerator="cpu", devices=1, strategy="memkit_fsdp2", logger=False)
    assert isinstance(trainer.strategy, ModelParallelStrategy) and trainer.strategy.reshard_after_forward is True
    from lightning_memkit.strategies import MemkitFSDP2Strategy

    with pytest.raises(TypeError, match=r"MemkitFSDP2Strategy\(reshard_after_forward='yes'\): must be a bool"):
        MemkitFSDP2Strategy(reshard_after_forward="yes")


@pytest.mark.slow
@pytest.mark.parametrize(("reshard", "features", "qlora", "moe", "peft"),
                         [(True, False, False, False, False), (False, False, False, False, False),
                          (True, True, False, False, False), (True, True, False, True, False),
                          (True, False, True, False, False), (True, False, True, False, True)],
                         ids=["full_shard", "shard_grad_op", "recompute+fused_loss", "moe+recompute+fused_loss",
                              "nf4", "nf4+peft"])
def test_two_ranks_train_as_one_process(tmp_path, reshard, features, qlora, moe, peft):
    import torch

    args = ([str(tmp_path)] + ([] if reshard else ["keep"]) + (["features"] if features else [])
            + (["nf4", "resume"] if qlora else []) + (["moe"] if moe else []) + (["peft"] if peft else []))
    procs = ranks.launch(WORKER, args, 2, OMP_NUM_THREADS="1")
    for code, out in ranks.wait(procs, 240, "memkit_fsdp2 fit"):
        assert code == 0, out[-4000:]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    losses, state = one_process(features, qlora, "qwen3_moe" if moe else "llama", peft,
                                tmp_path / "one" if qlora else None)
    assert results[0]["strategy"] == "MemkitFSDP2Strategy" and results[0]["param"] == "DTensor"
    assert results[0]["losses"] == results[1]["losses"]
    if moe:  # the router aux loss of each rank's half batch: DDP on the same ranks is the reference
        assert results[0]["losses"] == pytest.approx(results[0]["ddp"], rel=1e-5, abs=1e-6)
        assert results[0]["losses"][0] == pytest.approx(losses[0], rel=1e-5)  # the same model and batches
        return
    assert results[0]["losses"] == pytest.approx(losses, rel=1e-5, abs=1e-6)
    if qlora:  # stopped after step 2, resumed from its sharded checkpoint: the same last step
        assert results[0]["resumed"] == results[0]["losses"][-1:]
        assert_same_adapters(tmp_path / "adapters", tmp_path / "one")
    for name, value in state.items():
        torch.testing.assert_close(torch.tensor(results[0]["state"][name]), value, rtol=1e-5, atol=1e-5, msg=name)


def assert_same_adapters(sharded: Path, one: Path) -> None:
    """The adapters exported from the 2-rank run (gathered whole, rank 0 writing) are one process's: the same files,
    keys, shapes and config, the values within the runs' 1e-5."""
    import torch
    from safetensors.torch import load_file

    assert sorted(p.name for p in sharded.iterdir()) == sorted(p.name for p in one.iterdir())
    def config(directory: Path, name: str) -> dict:
        data = json.loads((directory / name).read_text())
        if isinstance(data.get("target_modules"), list):  # peft writes a set: its order is the process's
            data["target_modules"] = sorted(data["target_modules"])
        return data

    for name in ("adapter_config.json", "memkit_base.json"):
        assert config(sharded, name) == config(one, name), name
    got, want = load_file(sharded / "adapter_model.safetensors"), load_file(one / "adapter_model.safetensors")
    assert sorted(got) == sorted(want) and want
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-5, msg=key)


def test_exporting_adapters_from_a_flat_sharded_run_is_refused_before_it_trains():
    from types import SimpleNamespace

    from lightning.pytorch.strategies import FSDPStrategy

    from lightning_memkit.finetune.export import ExportAdapters

    trainer = SimpleNamespace(strategy=FSDPStrategy(), precision_plugin=fsdp2_data.plugins()[0])  # FSDP1 needs CUDA
    with pytest.raises(ValueError, match=r"^ExportAdapters: under FSDPStrategy \(a FSDPStrategy\) each rank holds a "
                                         r"flat shard of the adapters, which is not exported; allowed: "
                                         r"strategy='memkit_fsdp2'"):
        ExportAdapters().preflight(trainer, fsdp2_data.module())
