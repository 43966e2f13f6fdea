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


def one_process(features: bool, qlora: bool = False, family: str = "llama") -> tuple[list[float], dict]:
    import lightning.pytorch as pl
    import torch

    losses = []

    class Record(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(outputs["loss"].item())

    model = fsdp2_data.module(family)
    pl.Trainer(accelerator="cpu", devices=1, max_steps=fsdp2_data.STEPS,
               callbacks=[fsdp2_data.seeded(), Record(), *(fsdp2_data.features() if features else [])], logger=False,
               plugins=fsdp2_data.plugins() if qlora else None,
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
@pytest.mark.parametrize(("reshard", "features", "qlora", "moe"),
                         [(True, False, False, False), (False, False, False, False), (True, True, False, False),
                          (True, True, False, True), (True, False, True, False)],
                         ids=["full_shard", "shard_grad_op", "recompute+fused_loss", "moe+recompute+fused_loss",
                              "nf4"])
def test_two_ranks_train_as_one_process(tmp_path, reshard, features, qlora, moe):
    import torch

    args = ([str(tmp_path)] + ([] if reshard else ["keep"]) + (["features"] if features else [])
            + (["nf4", "resume"] if qlora else []) + (["moe"] if moe else []))
    procs = ranks.launch(WORKER, args, 2, OMP_NUM_THREADS="1")
    for code, out in ranks.wait(procs, 240, "memkit_fsdp2 fit"):
        assert code == 0, out[-4000:]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    losses, state = one_process(features, qlora, "qwen3_moe" if moe else "llama")
    assert results[0]["strategy"] == "MemkitFSDP2Strategy" and results[0]["param"] == "DTensor"
    assert results[0]["losses"] == results[1]["losses"]
    if moe:  # the router aux loss of each rank's half batch: DDP on the same ranks is the reference
        assert results[0]["losses"] == pytest.approx(results[0]["ddp"], rel=1e-5, abs=1e-6)
        assert results[0]["losses"][0] == pytest.approx(losses[0], rel=1e-5)  # the same model and batches
        return
    assert results[0]["losses"] == pytest.approx(losses, rel=1e-5, abs=1e-6)
    if qlora:  # stopped after step 2, resumed from its sharded checkpoint: the same last step
        assert results[0]["resumed"] == results[0]["losses"][-1:]
    for name, value in state.items():
        torch.testing.assert_close(torch.tensor(results[0]["state"][name]), value, rtol=1e-5, atol=1e-5, msg=name)


def test_exporting_adapters_from_a_sharded_run_is_refused_before_it_trains():
    from lightning.pytorch import Trainer

    from lightning_memkit.finetune.export import ExportAdapters

    trainer = Trainer(accelerator="cpu", devices=1, strategy="memkit_fsdp2", logger=False, plugins=fsdp2_data.plugins())
    with pytest.raises(ValueError, match=r"^ExportAdapters: under MemkitFSDP2Strategy \(a ModelParallelStrategy\) each "
                                         r"rank holds a shard of the adapters"):
        ExportAdapters().preflight(trainer, fsdp2_data.module())
