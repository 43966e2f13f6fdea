"""MemkitPipelineStrategy: construction checks, registry, the layer protocol, LightningCLI, and a 2-process fit."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import lightning.pytorch as pl
import pytest
import ranks
import torch
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch.strategies import StrategyRegistry

import lightning_memkit
from lightning_memkit.strategies import MemkitPipelineStrategy

ROOT = Path(__file__).resolve().parents[2]
PYPATH = ranks.PYPATH
WORKER = Path(__file__).with_name("_pipeline_strategy_worker.py")


def test_registered_by_importing_the_package_and_twice_is_harmless():
    assert "memkit_pipeline" in StrategyRegistry
    importlib.reload(lightning_memkit)  # what a second import runs
    strategy = StrategyRegistry.get("memkit_pipeline")
    assert isinstance(strategy, MemkitPipelineStrategy)
    assert (strategy.schedule, strategy.microbatches, strategy.partition_method) == ("1f1b", 4, "memory")


@pytest.mark.parametrize(("devices", "pp", "mesh", "replicas"), [(2, None, (1, 2), 1), (4, 2, (2, 2), 2),
                                                               (4, 1, (4, 1), 4)])
def test_trainer_resolves_the_name_and_shards_the_data_over_the_replicas(devices, pp, mesh, replicas):
    strategy = "memkit_pipeline" if pp is None else MemkitPipelineStrategy(pipeline_parallel_size=pp)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=devices, logger=False)
    assert isinstance(trainer.strategy, MemkitPipelineStrategy)
    assert trainer.strategy.num_processes == devices and trainer.strategy.root_device == torch.device("cpu")
    assert trainer.strategy.mesh_shape == mesh
    assert trainer._accelerator_connector.is_distributed == (replicas > 1)  # a DistributedSampler only for replicas
    # the ranks of one pipeline read the same shard: rank r is in replica r // pp
    for rank in range(devices):
        trainer.strategy.cluster_environment.set_global_rank(rank)  # what set_world_ranks does in each process
        assert trainer.strategy.distributed_sampler_kwargs == {"num_replicas": replicas, "rank": rank // mesh[1]}


def test_pipeline_size_must_divide_the_world():
    strategy = MemkitPipelineStrategy(pipeline_parallel_size=3)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=4, logger=False)
    with pytest.raises(ValueError, match=r"pipeline_parallel_size=3\): the 4 ranks .* allowed here: 1, 2, 4"):
        _ = trainer.strategy.mesh_shape


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"schedule": "pipedream"}, ValueError, r"\(schedule='pipedream'\): must be one of 'gpipe', '1f1b'"),
        ({"microbatches": 0}, ValueError, r"MemkitPipelineStrategy\(microbatches=0\): must be an int >= 1"),
        ({"max_bytes_per_rank": 0}, ValueError, r"\(max_bytes_per_rank=0\): must be an int >= 1 or None"),
        ({"partition": "greedy"}, ValueError, r"\(partition='greedy'\): must be one of 'memory', 'uniform'"),
        ({"partition": [2, 0]}, ValueError, "must be one of"),
        ({"schedule": "zbv", "stages_per_rank": 3}, ValueError, "stages_per_rank=3 does not fit schedule='zbv'"),
        ({"schedule": "interleaved_1f1b", "stages_per_rank": 3}, ValueError, "partition='memory' is not supported"),
        ({"partition": "uniform", "max_bytes_per_rank": 10}, ValueError, r"max_bytes_per_rank=...\) needs partition"),
        ({"fused_loss": 1}, TypeError, r"\(fused_loss=1\): must be a bool"),
        ({"timeout": -1}, ValueError, r"\(timeout=-1\): must be a finite number > 0"),
        ({"timeout": 0}, ValueError, r"\(timeout=0\): must be a finite number > 0"),
        ({"timeout": float("nan")}, ValueError, r"\(timeout=nan\): must be a finite number > 0"),
        ({"timeout": float("inf")}, ValueError, r"\(timeout=inf\): must be a finite number > 0"),
        ({"timeout": timedelta(0)}, ValueError, r"\(timeout=0.0\): must be a finite number > 0"),
        ({"timeout": "soon"}, TypeError, r"\(timeout='soon'\): must be seconds"),
        ({"pipeline_parallel_size": 0}, ValueError, r"\(pipeline_parallel_size=0\): must be an int >= 1 or None"),
        ({"data_parallel": "zero"}, ValueError, r"\(data_parallel='zero'\): must be one of 'ddp', 'fsdp'"),
        ({"start_method": "thread"}, ValueError, r"\(start_method='thread'\): must be one of 'popen', 'spawn'"),
        ({"router_aux": "all"}, ValueError, r"\(router_aux='all'\): must be one of 'exact', 'microbatch'"),
        ({"data_parallel": "fsdp", "fused_loss": True}, NotImplementedError,
         r"\(data_parallel='fsdp', fused_loss=True\): the fused loss reads the head's weight"),
    ],
)
def test_bad_arguments_fail_at_construction(kwargs, error, match):
    with pytest.raises(error, match=match):
        MemkitPipelineStrategy(**kwargs)


def test_a_missing_rank_fails_the_set_up_after_the_timeout(monkeypatch):
    """Rank 0 of 2 alone: torch's rendezvous gives up after ``timeout`` seconds, not Lightning's 30 minutes."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")  # set again by the set-up: restored after the test
    monkeypatch.setenv("MASTER_PORT", str(ranks.free_port()))
    strategy = MemkitPipelineStrategy(timeout=1.5, parallel_devices=[torch.device("cpu")] * 2,
                                      cluster_environment=LightningEnvironment())
    t0 = time.monotonic()
    with pytest.raises(torch.distributed.DistStoreError, match=r"waiting for clients\. 1/2 clients joined"):
        strategy.setup_distributed()
    assert 1.5 <= time.monotonic() - t0 < 15
    assert not torch.distributed.is_initialized()


def test_explicit_partition_sizes_are_kept():
    assert MemkitPipelineStrategy(partition=[1, 2, 3]).partition_method == (1, 2, 3)


def test_module_without_the_layer_protocol_is_refused():
    class Plain(pl.LightningModule):
        pass

    with pytest.raises(TypeError, match="needs the LightningModule Plain to implement pipeline_layers, pipeline_loss"):
        MemkitPipelineStrategy().connect(Plain())

    class OnlyLayers(pl.LightningModule):
        def pipeline_layers(self):
            return torch.nn.ModuleList([torch.nn.Linear(2, 2)])

    MemkitPipelineStrategy(fused_loss=True).connect(OnlyLayers())  # a fused loss needs no pipeline_loss
    with pytest.raises(TypeError, match="to implement pipeline_loss"):
        MemkitPipelineStrategy().connect(OnlyLayers())


def test_example_config_builds_the_strategy_through_lightning_cli(tmp_path):
    from lightning_memkit.config.lightning_cli import MemkitCLI

    config = ROOT / "examples" / "configs" / "tiny_lm_pipeline.yaml"
    cli = MemkitCLI(args=["--config", str(config), "--trainer.default_root_dir", str(tmp_path)], run=False)
    strategy = cli.trainer.strategy
    assert isinstance(strategy, MemkitPipelineStrategy)
    assert (strategy.schedule, strategy.microbatches, strategy._timeout) == ("1f1b", 4, timedelta(seconds=300))
    assert callable(cli.model.pipeline_layers) and len(cli.model.pipeline_layers()) == cli.model.hparams.n_layers + 3




def _assert_the_fit_matches_one_process_and_resumes_exactly(r0, r1, ref):
    """Both ranks log the same values: those of one process, continued bit for bit after the resume."""
    assert {k: r0[k] for k in r1} == r1  # both ranks log the same (broadcast) values
    full, resumed = r0["full"], r0["resumed"]
    assert len(full["train"]) == 6 and len(full["val"]) == 2
    assert full["train"] == pytest.approx(ref["train"], rel=1e-5)  # loss of every step vs one process
    assert full["val"] == pytest.approx(ref["val"], rel=1e-5)
    assert resumed["train"] == full["train"][3:]  # bit-identical continuation from the epoch-0 checkpoint
    assert resumed["val"] == full["val"][1:]
    assert r0["validate"] == pytest.approx(full["val"][-1], rel=1e-6)  # trainer.validate after fit: same weights
    assert r0["state_keys_match"] and r0["state_equal"]  # merged shards cover the model; both runs end equal


def _assert_clear_set_up_errors(errors):
    """A module without the protocol, too few layers and an unsplittable batch are named."""
    assert errors["protocol"].startswith("TypeError: strategy='memkit_pipeline' needs the LightningModule")
    assert errors["stages"].startswith("ValueError: num_stages=2 exceeds the 1 layers")
    assert errors["batch"].startswith("ValueError: a batch of 6 samples does not split into microbatches=4")


def _assert_clear_checkpoint_errors(errors, tmp_path):
    """A checkpoint of another model and a directory another writer holds are refused, naming both."""
    saved = str(tmp_path / "ckpt" / "epoch=0-step=3.ckpt")
    assert errors["layers"] == (  # the same words on both ranks (checked above), naming the checkpoint
        f"CheckpointError: {saved}: cannot resume: a checkpoint of another model: it holds a model of 5 pipeline "
        "layers (stages of [2, 3]); this model has 6")
    assert errors["width"] == (f"CheckpointError: {saved}: cannot resume: a checkpoint of another model: "
                               "'tok_emb.weight' has shape (256, 16) in the checkpoint and (256, 32) in this model")
    locked = tmp_path / "locked"
    assert errors["locked"].startswith(f"CheckpointError: {locked}")
    assert f"another writer holds {locked / '.memkit-writer.lock'} (host" in errors["locked"]
    assert f"pid {os.getpid()}, run id 'other-run'" in errors["locked"] and "nothing was written" in errors["locked"]
    assert errors["locked_files"] == [".memkit-writer.lock"]  # the other run's directory is untouched


def test_two_process_fit_matches_single_process_and_resumes_exactly(tmp_path):
    """TinyLM on 2 ranks: the same losses as plain training, identical losses after resume, clear errors."""
    for code, out in ranks.wait(ranks.launch(WORKER, [str(tmp_path)], 2, TEST_PID=str(os.getpid())), 150, "fit"):
        assert code == 0, out[-4000:]
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    ref = r0.pop("reference")
    _assert_the_fit_matches_one_process_and_resumes_exactly(r0, r1, ref)
    _assert_clear_set_up_errors(r0["errors"])
    _assert_clear_checkpoint_errors(r0["errors"], tmp_path)


@pytest.mark.cuda
@pytest.mark.parametrize("fused", ["false", "true"])
def test_cuda_fit_through_the_cli(tmp_path, fused):
    """``memkit fit`` with the example config on one GPU (nccl), with and without the fused loss."""
    config = ROOT / "examples" / "configs" / "tiny_lm_pipeline.yaml"
    cmd = [
        sys.executable, "-m", "lightning_memkit.cli", "fit", "--config", str(config),
        "--trainer.accelerator", "gpu", "--trainer.devices", "1", "--trainer.max_steps", "6",
        "--trainer.val_check_interval", "3", "--trainer.enable_progress_bar", "false",
        "--trainer.default_root_dir", str(tmp_path), "--trainer.strategy.init_args.fused_loss", fused,
    ]
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=PYPATH))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "memkit_pipeline: 1f1b, 1 stages" in done.stdout + done.stderr


def test_a_checkpoint_of_another_pipeline_size_is_refused_naming_both(tmp_path):
    """Saved by pipelines of 1 rank, loaded by pipelines of 2: refused before anything is restored."""
    from lightning_memkit.pipeline import checkpoint as ckpt

    meta = {"schedule": "1f1b", "microbatches": 4, "stages_per_rank": 1, "sizes": [3], "data_parallel": 1}
    ckpt.save_sharded(tmp_path / "c.ckpt", {"state_dict": {"w": torch.zeros(2)}}, meta=meta)
    strategy = MemkitPipelineStrategy(parallel_devices=[torch.device("cpu")] * 2,
                                      cluster_environment=LightningEnvironment())
    assert strategy.mesh_shape == (1, 2)
    with pytest.raises(ValueError, match=r"saved by pipelines of 1 rank\(s\); this run has pipeline_parallel_size=2 "
                                         r"\(any number of replicas loads it\)"):
        strategy._load_own_shard(tmp_path / "c.ckpt", weights_only=False)
    assert strategy._restored is None  # nothing taken from the refused checkpoint


def test_the_mesh_yaml_of_the_docs_builds_a_2x2_mesh_through_lightning_cli(tmp_path):
    import re

    import yaml

    from lightning_memkit.config.lightning_cli import MemkitCLI

    page = (ROOT / "docs" / "pipeline.md").read_text()
    block = next(b for b in re.findall(r"```yaml\n(.*?)```", page, re.S) if "pipeline_parallel_size" in b)
    config = yaml.safe_load(block)
    config["trainer"]["default_root_dir"] = str(tmp_path)
    path = tmp_path / "mesh.yaml"
    path.write_text(yaml.safe_dump(config))
    cli = MemkitCLI(args=["--config", str(path)], run=False)
    strategy = cli.trainer.strategy
    assert isinstance(strategy, MemkitPipelineStrategy)
    assert strategy.mesh_shape == (2, 2) and strategy.config.data_parallel == "ddp"
    assert cli.trainer.gradient_clip_val == 1.0
