"""One rank of the FSDP / ModelParallelStrategy callback tests. Run by tests/callbacks/test_callbacks_fsdp.py.

    LOCAL_RANK=0 NODE_RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 \
        python _fsdp_worker.py {fsdp,model_parallel} {checkpointing,release,boundary} OUT

Writes OUT/rank<r>.json. ``fsdp`` is Lightning's ``FSDPStrategy`` (FSDP1, blocks wrapped by
``auto_wrap_policy``); Lightning refuses it on CPU and FSDP1 needs ``device_id`` there, so a subclass
passes ``device_id=cpu`` (FSDP1 itself runs on CPU with gloo). ``model_parallel`` is
``ModelParallelStrategy(data_parallel_size=2)`` with ``fully_shard`` (FSDP2) on each block and the root.
"""

from __future__ import annotations

import json
import sys
import warnings
from datetime import timedelta
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
from torch.utils.data import DataLoader, TensorDataset

from lightning_memkit.callbacks import ActivationCheckpointing, PhaseMemoryRelease, StageBoundaryRelease
from lightning_memkit.demo import TinyMoE
from lightning_memkit.demo.moe import MoEBlock
from lightning_memkit.demo.tiny_lm import Block, TinyLM
from lightning_memkit.memory import LivePeak, is_checkpointed, release_stage_boundaries

warnings.filterwarnings("ignore")
torch.set_num_threads(1)
SEQ, BATCH, STEPS = 8, 4, 3
QUIET = dict(max_steps=STEPS, logger=False, enable_progress_bar=False, enable_model_summary=False,
             enable_checkpointing=False)
VALIDATE = dict(limit_val_batches=1, val_check_interval=STEPS, num_sanity_val_steps=0)


class CPUFSDPStrategy(FSDPStrategy):
    """``FSDPStrategy`` on CPU: each ``FullyShardedDataParallel`` gets ``device_id=cpu``."""

    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        import torch.distributed.fsdp as fsdp

        original = fsdp.FullyShardedDataParallel

        class OnCPU(original):
            def __init__(self, module, *args, device_id=None, **kwargs):
                super().__init__(module, *args, device_id=torch.device("cpu"), **kwargs)

        fsdp.FullyShardedDataParallel = OnCPU  # what Lightning's _setup_model imports
        try:
            return super()._setup_model(model)
        finally:
            fsdp.FullyShardedDataParallel = original


def sharded(cls: type, kind: str) -> type:
    class Sharded(cls):
        def configure_model(self):
            if kind == "model_parallel":
                from torch.distributed.fsdp import fully_shard

                mesh = self.device_mesh["data_parallel"]
                for b in self.blocks:
                    fully_shard(b, mesh=mesh)
                fully_shard(self, mesh=mesh)

    Sharded.__name__ = cls.__name__
    return Sharded


def tiny_lm(kind: str) -> TinyLM:
    torch.manual_seed(0)
    return sharded(TinyLM, kind)(d_model=16, n_layers=2, n_heads=2, seq_len=SEQ, lr=1e-2)


def tiny_moe(kind: str) -> TinyMoE:
    torch.manual_seed(0)
    return sharded(TinyMoE, kind)(d_model=16, n_layers=2, n_heads=2, seq_len=SEQ, n_experts=4, top_k=2, d_expert=8,
                                  exchange="copy", pad_to_multiple=24)


def loader() -> DataLoader:
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 256, (2 * BATCH * (STEPS + 1), SEQ + 1), generator=g)
    return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=BATCH)


def strategy(kind: str, block: type, **kwargs):
    if kind == "fsdp":
        return CPUFSDPStrategy(auto_wrap_policy={block}, timeout=timedelta(seconds=120), **kwargs)
    return ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)


def fit(kind: str, model: pl.LightningModule, callbacks: list, block: type = Block, validate: bool = False,
        **kwargs) -> None:
    """Train on two ranks; ``validate``: one validation batch after the last step, so the fit ends on a forward
    without backward (FSDP keeps the root unit gathered)."""
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy(kind, block, **kwargs), callbacks=callbacks,
                         **QUIET, **(VALIDATE if validate else {}))
    trainer.fit(model, loader(), loader() if validate else None)


class Steps(Callback):
    """Loss and the LivePeak of each training step (forward, backward and optimizer step) on this rank."""

    def __init__(self):
        self.losses, self.peaks, self.recomputed, self._live = [], [], [], None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._live = LivePeak().__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._live.__exit__(None, None, None)
        self.peaks.append(self._live.peak_bytes)
        self.losses.append(float(outputs["loss"]))
        self.recomputed.append(sorted(type(m).__name__ for m in pl_module.modules() if is_checkpointed(m)))


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def flat_params(model: torch.nn.Module) -> list[torch.Tensor]:
    from torch.distributed.fsdp import FullyShardedDataParallel

    return [m._flat_param for m in model.modules() if isinstance(m, FullyShardedDataParallel)]


def checkpointing(kind: str) -> dict:
    out = {}
    for name, callbacks in (("plain", []), ("auto", [ActivationCheckpointing()]),
                            ("policy", [ActivationCheckpointing(policy={Block})])):
        steps, model = Steps(), tiny_lm(kind)
        fit(kind, model, [steps, *callbacks])
        out[name] = {"losses": steps.losses, "peaks": steps.peaks, "recomputed": steps.recomputed,
                     "checkpointed": callbacks[0].checkpointed if callbacks else [],
                     "left_after_fit": sum(is_checkpointed(m) for m in model.modules())}
    try:  # the whole model holds the FSDP units: recompute around them is refused
        fit(kind, tiny_lm(kind), [ActivationCheckpointing(policy=lambda name, module: name == "")])
    except ValueError as err:
        out["around_units"] = str(err)
    return out


class Output(Callback):
    """At the end of fit: the model's output on one batch (after the callbacks listed before it)."""

    def teardown(self, trainer, pl_module, stage):
        with torch.no_grad():
            self.output = trainer.strategy.model(next(iter(loader()))[0]).numpy().copy()


class Before(Callback):
    """At the end of fit, before PhaseMemoryRelease: how many parameters have optimizer state on this rank."""

    def teardown(self, trainer, pl_module, stage):
        self.states = len(trainer.strategy.optimizers[0].state)


class After(Output):
    """After PhaseMemoryRelease: gradients left, every parameter shard still allocated, and the output."""

    def __init__(self, kind: str):
        self.kind = kind

    def teardown(self, trainer, pl_module, stage):
        model = trainer.strategy.model
        self.grads_left = sum(p.grad is not None for p in [*pl_module.parameters(), *flat_params(model)])
        shards = [local(p) for p in [*pl_module.parameters(), *flat_params(model)]]
        self.shards_allocated = all(t.untyped_storage().nbytes() >= t.numel() * t.element_size() for t in shards)
        if self.kind == "model_parallel":  # FSDP2: the modules hold the DTensor shards again
            self.sharded = all(hasattr(p, "to_local") for p in pl_module.parameters())
        else:
            self.sharded = None
        super().teardown(trainer, pl_module, stage)


def release(kind: str) -> dict:
    reference = Output()  # the same training without the release
    fit(kind, tiny_lm(kind), [reference])
    before, rel, after = Before(), PhaseMemoryRelease(tolerance_bytes=0), After(kind)
    fit(kind, tiny_lm(kind), [before, rel, after])
    # ending on validation: FSDP2 keeps its root unit gathered, FSDP1 with SHARD_GRAD_OP every unit
    gathered, resharded = PhaseMemoryRelease(tolerance_bytes=0), Output()
    shard_grad_op = {"sharding_strategy": "SHARD_GRAD_OP"} if kind == "fsdp" else {}
    fit(kind, tiny_lm(kind), [gathered, resharded], validate=True, **shard_grad_op)
    keys = ("optimizer_state_bytes", "grad_bytes", "unsharded_bytes", "retained_bytes")
    out = {"result": {k: getattr(rel.results[0], k) for k in keys},
           "gathered": {k: getattr(gathered.results[0], k) for k in keys}, "gathered_effect": gathered.memory_effect(),
           "states": before.states, "grads_left": after.grads_left, "shards_allocated": after.shards_allocated,
           "sharded_after": after.sharded, "same_output": bool((after.output == reference.output).all()),
           "same_output_resharded": bool((resharded.output == reference.output).all())}
    for name, extra in (("single", {}), ("single_validated", VALIDATE)):  # the same fits on one device, unsharded
        single = PhaseMemoryRelease(tolerance_bytes=0)
        pl.Trainer(accelerator="cpu", devices=1, callbacks=[single], **QUIET, **extra).fit(
            tiny_lm("none"), loader(), loader() if extra else None)
        out[name] = {k: getattr(single.results[0], k) for k in keys}
    return out


def boundary(kind: str) -> dict:
    out = {}
    for name, callbacks in (("plain", []), ("release", [StageBoundaryRelease()])):
        steps = Steps()
        fit(kind, tiny_moe(kind), [steps, *callbacks], block=MoEBlock)
        out[name] = {"losses": steps.losses, "peaks": steps.peaks}
        if callbacks:
            cb = callbacks[0]
            out[name].update(released_bytes=cb.released_bytes, released=cb.released, kept=cb.kept)
    # this rank's batches (Lightning's DistributedSampler, no shuffle) on one device, unsharded
    rank, model, single = torch.distributed.get_rank(), tiny_moe("none"), 0
    sampler = torch.utils.data.DistributedSampler(loader().dataset, num_replicas=2, rank=rank, shuffle=False)
    for step, batch in enumerate(DataLoader(loader().dataset, batch_size=BATCH, sampler=sampler)):
        if step == STEPS:
            break
        with release_stage_boundaries() as stats:
            model._loss(batch)[1].backward()
        single += stats.released_bytes
    out["single_released_bytes"] = single
    return out


def main() -> None:
    kind, scenario, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    result = {"checkpointing": checkpointing, "release": release, "boundary": boundary}[scenario](kind)
    rank = torch.distributed.get_rank()
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    print(f"rank {rank} ok", flush=True)


if __name__ == "__main__":
    main()
