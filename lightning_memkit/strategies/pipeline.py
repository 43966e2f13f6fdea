"""``strategy="memkit_pipeline"``: pipeline parallelism on ``torch.distributed.pipelining`` with memory-balanced stages.

The LightningModule lists its layers in order and names its loss (the layer protocol)::

    class MyLM(LightningModule):
        def pipeline_layers(self) -> nn.ModuleList: ...          # embedding first, head last; each takes and
                                                                 # returns a tensor or a tuple of tensors
        def pipeline_loss(self, output, target) -> Tensor: ...   # mean loss of one microbatch
        def pipeline_inputs(self, batch) -> tuple[Any, Any]: ... # optional; default: batch is (inputs, target)

or it holds a Hugging Face decoder-only causal LM (one transformers ``PreTrainedModel`` among its modules with
``.model.embed_tokens``, ``.model.layers``, ``.model.norm``, ``.model.rotary_emb`` and ``.lm_head``, of any family
whose stages reproduce it: :func:`~lightning_memkit.hf.pipeline_stages.causal_lm_problems` and the probe of
:func:`~lightning_memkit.hf.pipeline_stages.causal_lm_stages`) and reads dict batches
(``input_ids``, ``labels``, optional ``attention_mask``): the strategy then splits it with
:func:`~lightning_memkit.hf.pipeline_stages.causal_lm_stages` and trains it on HF's own loss (router aux loss
included); see that module for what crosses the stage boundaries. The explicit protocol wins where both exist.

At setup the strategy measures each layer's memory on one microbatch of the first training batch (rank 0,
RNG untouched), splits the layers with :func:`~lightning_memkit.pipeline.partition_layers`, keeps this
rank's stages (the other layers move to the ``meta`` device) and restricts every optimizer to this rank's
parameters. ``training_step`` runs the whole microbatched forward and backward through the schedule and
returns the mean loss (broadcast from the last stage, logged as ``train_loss``); Lightning's own
backward is skipped (its ``on_before_backward``/``on_after_backward`` hooks still run). Validation and
test run forward only and log ``val_loss``/``test_loss``; predict returns the last layer's output (an
LM's logits) for each batch on every rank. Checkpoints are crash-consistent directories (one
shard per rank, committed by a ``manifest.json``; see :mod:`lightning_memkit.pipeline.checkpoint`); resuming
restores the same split.

The LightningModule's own ``training_step``/``validation_step``/``predict_step`` are not called, and after ``fit`` each
rank holds only its layers (:func:`load_pipeline_state_dict` merges a checkpoint's shards).

Example::

    from lightning.pytorch import Trainer
    import lightning_memkit  # registers "memkit_pipeline"

    trainer = Trainer(accelerator="cpu", devices=4, strategy="memkit_pipeline", max_steps=100)
    # or: strategy=MemkitPipelineStrategy(schedule="dualpipev", microbatches=8)
"""

from __future__ import annotations

import atexit
import gc
import pickle
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from lightning_memkit.common.batches import rng_untouched
from lightning_memkit.common.progress import WorkProgress, progress_enabled
from lightning_memkit.common.validation import check_choice
from lightning_memkit.pipeline import (
    Partition,
    evaluate_partition,
    parameter_balanced_partition,
    partition_layers,
    static_cost,
    uniform_partition,
    writer_lock,
)
from lightning_memkit.pipeline import checkpoint as ckpt_format
from lightning_memkit.pipeline.checkpoint_match import model_mismatch
from lightning_memkit.pipeline.config import PipelineConfig
from lightning_memkit.pipeline.cost import shared_parameter_costs
from lightning_memkit.pipeline.gradients import (
    average_gradients,
    broadcast_tensors,
    clip_global_norm,
    sum_gradients,
)
from lightning_memkit.pipeline.runtime import (
    PipelineRuntime,
    check_microbatches,
    measure_pipeline_costs,
    split_batch_size,
)
from lightning_memkit.pipeline.sharding import full_state, reshard_optimizer_state, shard_stage_modules
from lightning_memkit.strategies.process_group import ProcessGroupStrategy

__all__ = ["MemkitPipelineStrategy", "load_pipeline_state_dict", "PROTOCOL"]

PROTOCOL = ("pipeline_layers", "pipeline_loss")
_HF_LAYOUT = (
    "a transformers decoder-only causal LM (a PreTrainedModel with .model.embed_tokens, .model.layers, .model.norm, "
    ".model.rotary_emb and an nn.Linear .lm_head)"
)
_OWNER = "MemkitPipelineStrategy"
_START_METHODS = ("popen", "spawn", "fork", "forkserver")


@dataclass(frozen=True)
class _Plan:
    """What the runtime runs: the ordered layers, the loss, whether the head is fused, and the batch split."""

    layers: list[nn.Module]
    loss_fn: Callable[[Any, Any], torch.Tensor] | None
    fused_head: bool
    inputs: Callable[[Any], Any]
    source: str  # what the layers come from, for error messages


class MemkitPipelineStrategy(ProcessGroupStrategy):
    """Pipeline-parallel training on a 2-D mesh: memory-balanced stages, data-parallel replicas, sharded checkpoints.

    The ``devices x num_nodes`` ranks form a :class:`~torch.distributed.device_mesh.DeviceMesh` of shape
    ``(dp, pp)``: ``pp = pipeline_parallel_size`` ranks run one pipeline (default: all of them), and
    ``dp = world / pp`` pipeline replicas each read their own shard of the data (a ``DistributedSampler`` over
    the ``dp`` dimension, injected as Lightning does for DDP) and average their gradients before every optimizer
    step. Processes start and talk through :class:`~lightning_memkit.strategies.process_group.ProcessGroupStrategy`
    (Lightning's launchers, ``init_process_group``, the collectives); the model is never wrapped: each rank keeps
    its stages. With one replica no sampler is injected: every rank reads the loader's own batches.

    Args:
        schedule, microbatches, partition, stages_per_rank, max_bytes_per_rank, fused_loss, router_aux,
            pipeline_parallel_size, data_parallel, timeout: the options of
            :class:`~lightning_memkit.pipeline.config.PipelineConfig` (validated there, kept as ``self.config``).
        process_group_backend: default ``gloo`` on CPU, ``nccl`` on CUDA.
        start_method: how Lightning starts the processes (``"popen"`` re-runs the script, ``"spawn"``...).

    ``gradient_clip_val`` clips by the global norm over every stage and replica
    (``gradient_clip_algorithm="norm"``) or by value, as one process would.

    Example (YAML for LightningCLI)::

        trainer:
          devices: 4
          strategy:
            class_path: lightning_memkit.strategies.MemkitPipelineStrategy
            init_args: {schedule: 1f1b, microbatches: 4, pipeline_parallel_size: 2}
    """

    strategy_name = "memkit_pipeline"

    def __init__(
        self,
        schedule: str = "1f1b",
        microbatches: int = 4,
        partition: str | list[int] = "memory",
        stages_per_rank: int | None = None,
        max_bytes_per_rank: int | None = None,
        fused_loss: bool = False,
        router_aux: str = "exact",
        pipeline_parallel_size: int | None = None,
        data_parallel: str = "ddp",
        timeout: float | timedelta | None = None,
        process_group_backend: str | None = None,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
    ) -> None:
        try:
            self.config = PipelineConfig(
                schedule=schedule, microbatches=microbatches, partition=partition, stages_per_rank=stages_per_rank,
                max_bytes_per_rank=max_bytes_per_rank, fused_loss=fused_loss, router_aux=router_aux, timeout=timeout,
                pipeline_parallel_size=pipeline_parallel_size, data_parallel=data_parallel,
            )
        except (TypeError, ValueError, NotImplementedError) as err:  # name the class the user called
            raise type(err)(str(err).replace("PipelineConfig(", f"{_OWNER}(")) from None
        check_choice(start_method, "start_method", _START_METHODS, owner=_OWNER)
        super().__init__(
            timeout=self.config.timeout, process_group_backend=process_group_backend, start_method=start_method,
            accelerator=accelerator, parallel_devices=parallel_devices, cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io, precision_plugin=precision_plugin,
        )
        self.mesh: Any = None  # the (dp, pp) DeviceMesh once the processes are connected
        self.partition: Partition | None = None
        self._runtime: PipelineRuntime | None = None
        self._restored: dict[str, Any] | None = None
        self._loaded_keys: set[str] | None = None
        self._pending: list[tuple[nn.Parameter, torch.Tensor | None]] = []
        self._hf_name: str | None = None  # the Hugging Face causal LM's module name when the protocol is absent
        self._plan: _Plan | None = None
        self._tie_groups: list[tuple[nn.Parameter, Any]] = []
        self._not_owned: set[int] = set()
        self._run_id = ckpt_format.new_save_id()  # owns the writer lock of the directories this run saves into
        self._locked: set[Path] = set()

    # the options, read-only (one home: self.config)
    schedule = property(lambda self: self.config.schedule)
    microbatches = property(lambda self: self.config.microbatches)
    partition_method = property(lambda self: self.config.partition)
    stages_per_rank = property(lambda self: self.config.stages_per_rank)
    max_bytes_per_rank = property(lambda self: self.config.max_bytes_per_rank)
    fused_loss = property(lambda self: self.config.fused_loss)
    router_aux = property(lambda self: self.config.router_aux)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        if cls.strategy_name not in strategy_registry:
            strategy_registry.register(
                cls.strategy_name,
                cls,
                description="Pipeline parallelism with memory-balanced stages (lightning_memkit)",
            )

    @property
    def runtime(self) -> PipelineRuntime | None:
        """This rank's :class:`~lightning_memkit.pipeline.runtime.PipelineRuntime` once set up."""
        return self._runtime

    @property
    def mesh_shape(self) -> tuple[int, int]:
        """``(dp, pp)``: pipeline replicas and ranks per pipeline, from ``devices x num_nodes`` and the config."""
        return self.config.mesh_shape(self.num_nodes * self.num_processes)

    @property
    def is_distributed(self) -> bool:
        """Whether several pipeline replicas split the data (then Lightning injects a ``DistributedSampler``)."""
        return self.mesh_shape[0] > 1

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """One data shard per pipeline replica: every rank of a pipeline reads the same batches."""
        dp, pp = self.mesh_shape
        return {"num_replicas": dp, "rank": self.global_rank // pp}

    def setup_environment(self) -> None:
        super().setup_environment()  # accelerator, world ranks, process group
        from torch.distributed.device_mesh import init_device_mesh

        dp, pp = self.mesh_shape
        self.mesh = init_device_mesh(self.root_device.type, (dp, pp), mesh_dim_names=("dp", "pp"))
        _destroy_process_group_at_exit()

    # -- model -----------------------------------------------------------------------------------------------
    def connect(self, model: Any) -> None:
        """Check that the strategy can split ``model``: the layer protocol, or else one Hugging Face causal LM."""
        defined = [name for name in PROTOCOL if callable(getattr(model, name, None))]
        self._hf_name = None
        if not defined:
            self._hf_name = self._find_hf_model(model)
        else:
            missing = [name for name in self._required() if name not in defined]
            if missing:
                raise TypeError(self._protocol_message(model, missing))
        super().connect(model)

    def _required(self) -> list[str]:
        """The protocol methods this strategy needs (no ``pipeline_loss`` with ``fused_loss=True``)."""
        return [name for name in PROTOCOL if not (self.fused_loss and name == "pipeline_loss")]

    def _protocol_message(self, model: Any, missing: list[str], why: str | None = None) -> str:
        message = (
            f"strategy='memkit_pipeline' needs the LightningModule {type(model).__name__} to implement "
            f"{', '.join(missing)}: pipeline_layers() -> nn.ModuleList of layers in order (a tensor or a tuple of "
            "tensors in, the same out) and pipeline_loss(output, target) -> scalar loss of one microbatch"
        )
        return message if why is None else f"{message}; or to hold {_HF_LAYOUT}, but {why}"

    def _find_hf_model(self, model: Any) -> str:
        from lightning_memkit.hf.pipeline_stages import find_causal_lm

        try:
            name, _ = find_causal_lm(model)
        except LookupError as err:
            raise TypeError(self._protocol_message(model, self._required(), str(err))) from None
        return name

    def _build_plan(self) -> _Plan:
        module = self.lightning_module
        if self._hf_name is not None:
            from lightning_memkit.hf.pipeline_stages import causal_lm_stages

            stages = causal_lm_stages(module.get_submodule(self._hf_name), fused_loss=self.fused_loss,
                                      router_aux=self.router_aux)
            plan = _Plan(list(stages.layers), stages.loss, False, stages.inputs,
                         f"the Hugging Face model {self._hf_name or type(module).__name__}")
        else:
            loss = None if self.fused_loss else module.pipeline_loss
            plan = _Plan(self._protocol_layers(), loss, self.fused_loss, self._protocol_inputs, "pipeline_layers()")
        self._check_orphans(plan)
        return plan

    def _protocol_layers(self) -> list[nn.Module]:
        layers = self.lightning_module.pipeline_layers()
        if isinstance(layers, nn.Module) and not isinstance(layers, (nn.ModuleList, nn.Sequential)):
            raise TypeError(f"pipeline_layers() must return an nn.ModuleList, got {type(layers).__name__}")
        layers = list(layers)
        for i, layer in enumerate(layers):
            if not isinstance(layer, nn.Module):
                raise TypeError(f"pipeline_layers()[{i}] must be an nn.Module, got {type(layer).__name__}")
        return layers

    def _check_orphans(self, plan: _Plan) -> None:
        covered = {id(p) for layer in plan.layers for p in layer.parameters()}
        orphans = [n for n, p in self.lightning_module.named_parameters() if p.requires_grad and id(p) not in covered]
        if orphans:
            raise ValueError(
                f"parameters outside {plan.source} would never train: {', '.join(orphans[:5])}"
                + (" ..." if len(orphans) > 5 else "")
                + f"; include their modules in {plan.source} or freeze them"
            )

    def _protocol_inputs(self, batch: Any) -> tuple[Any, Any]:
        module = self.lightning_module
        if callable(getattr(module, "pipeline_inputs", None)):
            pair = module.pipeline_inputs(batch)
        else:
            pair = batch
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise TypeError(
                "the batch must be an (inputs, target) pair, or the LightningModule must implement "
                f"pipeline_inputs(batch) -> (inputs, target); got {type(pair).__name__}"
            )
        return pair[0], pair[1]

    def _inputs(self, batch: Any) -> tuple[Any, Any]:
        if self._plan is None:
            raise RuntimeError("MemkitPipelineStrategy is not set up: run it through a Trainer")
        return self._plan.inputs(batch)

    def model_to_device(self) -> None:
        if self._runtime is not None:
            for m in self._runtime.modules:
                m.to(self.root_device)

    # -- setup -----------------------------------------------------------------------------------------------
    def setup(self, trainer: Any) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            self._check_training_config(trainer)
        self.precision_plugin.convert_module(self.model)
        plan = self._plan = self._build_plan()
        if fitting:
            self.setup_optimizers(trainer)
        partition = self._make_partition(trainer, plan.layers)
        self.partition = partition
        self._runtime = PipelineRuntime(
            plan.layers, partition, loss_fn=plan.loss_fn, device=self.root_device, fused_head=plan.fused_head,
            group=self.mesh["pp"].get_group(), prepare=self._prepare_stages,
        )
        if fitting and self._sharded:
            self.setup_optimizers(trainer)  # FSDP2 replaced the parameters: the optimizer must hold the new ones
        local = {id(p) for p in self._runtime.parameters()}
        for opt in self.optimizers:
            for group in opt.param_groups:
                group["params"] = [p for p in group["params"] if id(p) in local]
        self._check_restored_keys()
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)
        if self.is_global_zero:
            peaks = ", ".join(f"{b / 2**20:.2f}" for b in partition.predicted_peak_bytes)
            rank_zero_info(
                f"memkit_pipeline: {partition.schedule}, {partition.num_stages} stages of {list(partition.sizes)} "
                f"layers ({partition.method}); predicted peak per rank [MiB]: {peaks}"
            )

    @property
    def splits_hf_model(self) -> bool:
        """Whether the model is a Hugging Face causal LM the strategy cuts itself (then ``fused_loss`` applies)."""
        return self._hf_name is not None

    def predict_partition(self, trainer: Any, microbatches: int | None = None,
                          fused_loss: bool | None = None) -> Partition:
        """The split ``setup`` would choose with these options and each rank's predicted peak, measured as setup
        measures (``partition="memory"``: one batch of the training loader and the model's optimizer, measured;
        the other partitions count weights and optimizer state only): for planning before ``setup``, on
        every rank (rank 0 measures, the others receive the result). The options are unchanged; pass the
        result to :meth:`use_plan` to run it.

        Example (a callback's ``setup``, before the strategy's)::

            partition = trainer.strategy.predict_partition(trainer, microbatches=8)
            max(partition.predicted_peak_bytes)  # the busiest rank's peak
        """
        config, plan, previous = self.config, self._plan, self.partition
        try:
            self.config = replace(config,
                                  microbatches=config.microbatches if microbatches is None else microbatches,
                                  fused_loss=config.fused_loss if fused_loss is None else fused_loss)
            self.partition, self._plan = None, self._build_plan()
            if not self.optimizers:
                self.setup_optimizers(trainer)  # their state is part of each rank's peak
            return self._make_partition(trainer, self._plan.layers)
        finally:
            self.config, self._plan, self.partition = config, plan, previous

    def use_plan(self, partition: Partition, fused_loss: bool) -> None:
        """Run ``partition`` (from :meth:`predict_partition`): its microbatches and split, and ``fused_loss``."""
        self.config = replace(self.config, microbatches=partition.microbatches, fused_loss=fused_loss)
        self.partition = partition

    @property
    def _sharded(self) -> bool:
        """Whether the stages are sharded over the replicas (``data_parallel="fsdp"`` with more than one)."""
        return self.config.data_parallel == "fsdp" and self.mesh_shape[0] > 1

    def _prepare_stages(self, runtime: PipelineRuntime) -> None:
        """Before torch's stages exist: connect tied parameters, align the replicas, shard over them (FSDP)."""
        ties = self._connect_ties(runtime)
        self._sync_replicas(runtime)
        if self._sharded:
            shard_stage_modules(runtime.modules, self.mesh["dp"])
        layers = self._plan.layers if self._plan is not None else []
        pp_rank = self.global_rank % self.mesh_shape[1]
        # the parameter objects the local layers hold now (fully_shard replaces them by DTensor parameters)
        self._tie_groups = [(tie.local_param(layers, runtime.layer_indices), group) for tie, group in ties]
        self._not_owned = {id(p) for (p, _), (tie, _) in zip(self._tie_groups, ties) if pp_rank != tie.ranks[0]}

    def _connect_ties(self, runtime: PipelineRuntime) -> list[tuple[Any, Any]]:
        """A process group per tied parameter and replica (every rank creates all, in order); this rank's ties.

        Each tie starts from the value of its first rank, so that both ends hold the same tensor.
        """
        dp, pp = self.mesh_shape
        replica, pp_rank = divmod(self.global_rank, pp)
        mine = []
        for tie in runtime.ties:
            groups = [torch.distributed.new_group([d * pp + r for r in tie.ranks]) for d in range(dp)]
            if pp_rank in tie.ranks:
                mine.append((tie, groups[replica]))
                broadcast_tensors([tie.param], src=replica * pp + tie.ranks[0], group=groups[replica])
        return mine

    def _sync_replicas(self, runtime: PipelineRuntime) -> None:
        """Every replica starts from the first replica's weights and buffers (as DDP does at set-up)."""
        dp, pp = self.mesh_shape
        if dp > 1:
            tensors = [*runtime.parameters(), *(b for m in runtime.modules for b in m.buffers())]
            broadcast_tensors(tensors, src=self.global_rank % pp, group=self.mesh["dp"].get_group())

    def memory_effect(self) -> str:
        """One line: the stages, their layers and the predicted peak of each stage and rank, in bytes."""
        partition = self.partition
        if partition is None:
            return "memkit_pipeline: not set up (no partition)"
        stages = ", ".join(f"{b:,}" for b in partition.stage_peak_bytes)
        ranks = ", ".join(f"{b:,}" for b in partition.predicted_peak_bytes)
        return (f"memkit_pipeline: {partition.num_stages} stages of {list(partition.sizes)} layers "
                f"({partition.method}, {partition.schedule}); predicted peak per stage [bytes]: {stages}; per rank: "
                f"{ranks} (predicted from the measured layer costs, not measured during training)")

    def _check_training_config(self, trainer: Any) -> None:
        module = self.lightning_module
        if not module.automatic_optimization:
            raise ValueError(
                "strategy='memkit_pipeline' runs forward and backward itself: use automatic optimization "
                "(LightningModule.automatic_optimization = True)"
            )
        if getattr(self.precision_plugin, "scaler", None) is not None:
            raise ValueError("strategy='memkit_pipeline' does not support a gradient scaler (precision='16-mixed'); "
                             "use 'bf16-mixed', 'bf16-true' or '32-true'")

    def _make_partition(self, trainer: Any, layers: list[nn.Module]) -> Partition:
        """The split of ``layers`` into stages: kept, restored, given, static or measured (``"memory"``)."""
        world = self.mesh_shape[1]  # ranks per pipeline
        num_stages = world * self.stages_per_rank
        check_microbatches(self.schedule, num_stages, self.microbatches, world)
        kwargs = dict(schedule=self.schedule, microbatches=self.microbatches, stages_per_rank=self.stages_per_rank,
                      data_parallel_size=self.mesh_shape[0], sharded=self.config.data_parallel == "fsdp")
        optimizer = list(self.optimizers) or None
        previous = self.partition
        if previous is not None and previous.num_stages == num_stages and previous.boundaries[-1] == len(layers):
            return previous  # fit, then validate/test with the same trainer: the layers are already split
        _refuse_meta_layers(layers)
        kwargs["ties"] = shared_parameter_costs(layers, optimizer)  # tied embeddings: once on a rank holding both
        static = self._static_partition(layers, num_stages, optimizer, kwargs)
        if static is not None:
            return static
        result: Any = None
        if self.is_global_zero:
            try:
                result = self._memory_partition(trainer, layers, num_stages, optimizer, kwargs)
            except Exception as err:  # noqa: BLE001 - re-raised on every rank below
                result = err if _picklable(err) else RuntimeError(f"{type(err).__name__}: {err}")
        result = self.broadcast(result, src=0)
        if isinstance(result, Exception):
            raise result
        return result

    def _static_partition(self, layers: list[nn.Module], num_stages: int, optimizer: Any,
                          kwargs: dict[str, Any]) -> Partition | None:
        """The split that needs no measurement (restored, explicit sizes, uniform, parameters), else ``None``."""
        method = self.partition_method
        if self._restored is None and method == "memory":
            return None
        costs = [static_cost(m, optimizer) for m in layers]
        if self._restored is not None:
            return evaluate_partition(costs, self._restored["sizes"], **kwargs)
        if isinstance(method, tuple):
            if len(method) != num_stages:
                raise ValueError(
                    f"partition={list(method)} lists {len(method)} stages, but {self.mesh_shape[1]} ranks per "
                    f"pipeline x {self.stages_per_rank} stage(s) per rank = {num_stages}"
                )
            return evaluate_partition(costs, list(method), **kwargs)
        fn = uniform_partition if method == "uniform" else parameter_balanced_partition
        return fn(costs, num_stages, **kwargs)

    def _memory_partition(self, trainer, layers, num_stages, optimizer, kwargs) -> Partition:
        inputs, target = self._inputs(self._sample_batch(trainer))
        first = next(t for t in (inputs if isinstance(inputs, (tuple, list)) else (inputs,)) if torch.is_tensor(t))
        mb = split_batch_size(first.shape[0], self.microbatches)
        inputs = move_data_to_device(_slice(inputs, mb), self.root_device)
        target = move_data_to_device(_slice(target, mb), self.root_device)
        plan = self._plan
        assert plan is not None
        progress = WorkProgress("memkit_pipeline measuring layer", total=len(layers),
                                enabled=progress_enabled(trainer))
        hooks = [layer.register_forward_hook(lambda m, *_: progress.step(type(m).__name__)) for layer in layers]
        try:
            with rng_untouched(self.root_device):
                costs = measure_pipeline_costs(
                    layers, inputs, target, loss_fn=plan.loss_fn, optimizer=optimizer, fused_head=plan.fused_head,
                    device=self.root_device,
                )
        finally:
            for hook in hooks:
                hook.remove()
        if plan.fused_head:  # the head is measured through the fused loss, without a forward call of its own
            progress.step(f"{type(layers[-1]).__name__} (with the fused loss)")
        return partition_layers(costs, num_stages, max_bytes_per_rank=self.max_bytes_per_rank, **kwargs)

    def _sample_batch(self, trainer: Any) -> Any:
        loops = {
            TrainerFn.FITTING: trainer.fit_loop,
            TrainerFn.VALIDATING: trainer.validate_loop,
            TrainerFn.TESTING: trainer.test_loop,
            TrainerFn.PREDICTING: trainer.predict_loop,
        }
        source = getattr(loops.get(trainer.state.fn), "_data_source", None)
        hint = "or pass partition='uniform', 'parameters' or explicit sizes to MemkitPipelineStrategy"
        if source is None or not source.is_defined():
            raise ValueError(f"partition='memory' measures one batch of the dataloader, but none is attached; {hint}")
        with rng_untouched(self.root_device):  # the training run's random states (torch, random, numpy) untouched
            loaders = source.dataloader()
            if isinstance(loaders, Mapping):
                loaders = next(iter(loaders.values()))
            elif isinstance(loaders, (list, tuple)):
                loaders = loaders[0]
            try:
                return next(iter(loaders))
            except StopIteration:
                raise ValueError(f"partition='memory' needs one batch, but the dataloader is empty; {hint}") from None

    # -- steps -----------------------------------------------------------------------------------------------
    def _runtime_or_raise(self) -> PipelineRuntime:
        if self._runtime is None:
            raise RuntimeError("MemkitPipelineStrategy is not set up: run it through a Trainer")
        return self._runtime

    def training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Run the schedule (forward and backward of every microbatch) and return the mean loss.

        Lightning's closure zeroes the gradients *after* ``training_step`` at the first batch of each
        accumulation window; the gradients computed here are set aside until :meth:`backward` so that they
        survive it (and stale ones are dropped before the schedule runs, which saves their memory).
        """
        runtime = self._runtime_or_raise()
        batch = args[0] if args else kwargs["batch"]
        inputs, target = self._inputs(batch)
        trainer = self.lightning_module.trainer
        params = list(runtime.parameters())
        window_start = trainer.fit_loop.epoch_loop.batch_idx % trainer.accumulate_grad_batches == 0
        if window_start:
            for p in params:
                p.grad = None
        with self.precision_plugin.train_step_context():
            loss = runtime.train_step(inputs, target, grad_accumulation=trainer.accumulate_grad_batches)
        if window_start:
            self._pending = [(p, p.grad) for p in params]
            for p in params:
                p.grad = None
        loss = self._replica_mean(loss)
        self.lightning_module.log("train_loss", loss, prog_bar=True)
        return loss

    def _replica_mean(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` (equal on the ranks of one pipeline) averaged over the pipeline replicas."""
        if self.mesh_shape[0] == 1:
            return value
        return self.reduce(value.detach(), group=self.mesh["dp"].get_group(), reduce_op="mean")

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        """Lightning's step, after the gradients are averaged over the replicas and clipped by the global norm.

        Both happen in the closure, right after the last backward of the accumulation window, so that Lightning's
        own clipping (run next, on this rank's gradients) sees the synchronized ones: by value it is then exact, and
        by norm it finds them already within the limit.
        """

        def synced() -> Any:
            result = closure()
            for param, group in self._tie_groups:  # both ends of a tie add their gradients and step alike
                sum_gradients([param], group)
            params = [p for p in self._runtime_or_raise().parameters() if p.grad is not None]
            if self.mesh_shape[0] > 1 and not self._sharded:  # FSDP2 reduce-scatters (averages) them itself
                average_gradients(params, self.mesh["dp"].get_group())
            trainer = self.lightning_module.trainer
            by_norm = (trainer.gradient_clip_algorithm or "norm") == "norm"  # None: Lightning's default, the norm
            if trainer.gradient_clip_val and by_norm:  # a tied parameter counts once, on its first rank
                owned = [p for p in params if id(p) not in self._not_owned]
                shared = [p for p in params if id(p) in self._not_owned]
                group = None if self._sharded else self.mesh["pp"].get_group()  # shards: the norm spans dp too
                clip_global_norm(owned, float(trainer.gradient_clip_val), group, device=self.root_device,
                                 also_scale=shared)
            return result

        return super().optimizer_step(optimizer, synced, model, **kwargs)

    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The schedule already ran backward in ``training_step``: put its gradients back, run the hooks around it."""
        module = self.lightning_module
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        pending, self._pending = self._pending, []
        for p, g in pending:
            if g is None:
                continue
            if p.grad is None:
                p.grad = g
            else:
                p.grad.add_(g)
        return self.precision_plugin.post_backward(closure_loss, module)

    def _eval(self, name: str, context: Any, args: tuple, kwargs: dict) -> torch.Tensor:
        runtime = self._runtime_or_raise()
        batch = args[0] if args else kwargs["batch"]
        inputs, target = self._inputs(batch)
        with context:
            loss = self._replica_mean(runtime.eval_step(inputs, target))
        self.lightning_module.log(name, loss, prog_bar=True)
        return loss

    def validation_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self._eval("val_loss", self.precision_plugin.val_step_context(), args, kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self._eval("test_loss", self.precision_plugin.test_step_context(), args, kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        """The last layer's output for the batch (an LM's logits), broadcast from the last stage to every rank.

        The batch has the training format (its target is not used); the module's ``predict_step`` is not called.
        """
        runtime = self._runtime_or_raise()
        inputs, _ = self._inputs(args[0] if args else kwargs["batch"])
        with self.precision_plugin.predict_step_context():
            output = runtime.predict_step(inputs)
        return self.broadcast(output, src=runtime.partition.stage_ranks[-1])

    # -- checkpoints -----------------------------------------------------------------------------------------
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """This rank's share: every entry of the LightningModule's state dict that is not on ``meta``.

        Sharded (FSDP) entries are gathered into full tensors, so that the checkpoint does not depend on ``dp``.
        """
        state = self.lightning_module.state_dict()
        state = {k: v for k, v in state.items() if not (torch.is_tensor(v) and v.device.type == "meta")}
        return full_state(state) if self._sharded else state

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """The optimizer's state dict, its sharded (FSDP) tensors gathered into full ones."""
        state = super().optimizer_state(optimizer)
        return full_state(state) if self._sharded else state

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Lightning's load, then (FSDP) each full state tensor cut to the shard of its parameter."""
        super().load_optimizer_state_dict(checkpoint)
        if self._sharded:
            for optimizer in self.optimizers:
                reshard_optimizer_state(optimizer)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        """Write ``filepath/`` crash-consistently: every rank's shard, a barrier, then rank 0's ``manifest.json``.

        Overwriting a checkpoint in place (``last.ckpt``) never touches the shards the committed manifest lists;
        a crash anywhere in between leaves the previous save loadable (:mod:`lightning_memkit.pipeline.checkpoint`).
        The first save takes the writer lock of the directory that holds the checkpoint (``ModelCheckpoint``'s
        ``dirpath``) for this run, until teardown: another run saving there gets a ``CheckpointError`` naming
        this one before it writes anything. The shards are written by that module, not by a ``checkpoint_io``.
        """
        if storage_options is not None:
            raise TypeError(f"{_OWNER}.save_checkpoint does not take storage_options (got {storage_options!r})")
        path = Path(filepath)
        if path.is_file():
            raise ValueError(f"{path} is a file; a memkit_pipeline checkpoint is a directory of per-rank shards")
        if self.partition is None:
            raise RuntimeError("MemkitPipelineStrategy is not set up: there is no partition to checkpoint yet")
        save_id = self.broadcast(ckpt_format.new_save_id() if self.is_global_zero else None, src=0)
        replica, pp_rank = divmod(self.global_rank, self.mesh_shape[1])
        error = None
        if replica == 0:  # the replicas hold the same weights and optimizer state: the first one writes them
            group = self.mesh["pp"].get_group()
            try:
                ckpt_format.save_sharded(
                    path, checkpoint, rank=pp_rank, world_size=self.mesh_shape[1],
                    global_step=int(checkpoint.get("global_step", 0)), epoch=int(checkpoint.get("epoch", 0)),
                    save_id=save_id, meta=self._partition_meta(), run_id=self._run_id, lock_dir=path.parent,
                    barrier=lambda _name: torch.distributed.barrier(group),
                    all_gather=lambda obj: _all_gather_object(obj, group),
                )
            except ckpt_format.CheckpointError as err:
                error = str(err)
            if pp_rank == 0 and error is None:
                self._locked.add(path.parent)
        failures = [e for e in self._all_gather_object(error) if e is not None]  # the replicas raise it too
        if failures:
            raise ckpt_format.CheckpointError(path, failures[0].removeprefix(f"{path}: "))

    def _partition_meta(self) -> dict[str, Any]:
        part = self.partition
        assert part is not None
        return {"schedule": part.schedule, "microbatches": part.microbatches, "stages_per_rank": part.stages_per_rank,
                "sizes": list(part.sizes), "data_parallel": self.mesh_shape[0]}

    def _all_gather_object(self, obj: Any) -> list[Any]:
        return _all_gather_object(obj, None)

    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        """This rank's shard after checking the checkpoint and that it fits the model, before anything is loaded
        into it; every rank raises the same ``CheckpointError`` if any rank finds a problem."""
        path = Path(checkpoint_path)
        checkpoint, error, save_id = None, None, None
        try:
            save_id, checkpoint = self._load_own_shard(path, weights_only)
        except Exception as err:  # noqa: BLE001 - shared with every rank below, so that none goes on alone
            error = str(err) if isinstance(err, ValueError) else f"{type(err).__name__}: {err}"
        gathered = self._all_gather_object((error, save_id))
        failures = [e for e, _ in gathered if e is not None]
        if failures:
            raise ckpt_format.CheckpointError(path, f"cannot resume: {failures[0].removeprefix(f'{path}: ')}")
        if len({s for _, s in gathered}) > 1:  # a save committed between two ranks' reads
            raise ckpt_format.CheckpointError(path, "cannot resume: it was replaced by another save while the ranks "
                                                    "were reading it; load it again once that run has stopped")
        return checkpoint

    def _load_own_shard(self, path: Path, weights_only: bool | None) -> tuple[str, dict[str, Any]]:
        pp_rank = self.global_rank % self.mesh_shape[1]
        first = ckpt_format.read_manifest(path)
        self._check_split(path, first)  # before a shard is opened: another split is named as such
        manifest, checkpoint = ckpt_format.load_committed_shard(path, pp_rank, weights_only=weights_only)
        if manifest["save_id"] != first["save_id"]:  # replaced meanwhile: the save that was loaded is checked too
            self._check_split(path, manifest)
        convert_for = getattr(self.precision_plugin, "convert_for", None)
        if convert_for is not None:  # a QLoRA checkpoint: its shapes are those of the converted model
            convert_for(self.lightning_module, checkpoint.get("state_dict", {}))
        problem = model_mismatch(manifest["meta"], checkpoint.get("state_dict", {}),
                                 self.lightning_module.state_dict(), len(self._build_plan().layers))
        if problem is not None:
            raise ckpt_format.CheckpointError(path, f"a checkpoint of another model: {problem}")
        self._restored = manifest["meta"]
        return manifest["save_id"], checkpoint

    def _check_split(self, path: Path, manifest: Mapping[str, Any]) -> None:
        """The checkpoint's pipeline size and schedule are this run's (any number of replicas loads it)."""
        meta = manifest["meta"]
        if manifest["world_size"] != self.mesh_shape[1]:
            raise ValueError(
                f"{path} was saved by pipelines of {manifest['world_size']} rank(s); this run has "
                f"pipeline_parallel_size={self.mesh_shape[1]} (any number of replicas loads it). Merge the shards "
                "with load_pipeline_state_dict() to load them into another split"
            )
        if meta.get("schedule") != self.schedule or meta.get("stages_per_rank") != self.stages_per_rank:
            raise ValueError(
                f"{path} holds stages for schedule={meta.get('schedule')!r} ({meta.get('stages_per_rank')} per "
                f"rank); this strategy uses schedule={self.schedule!r} ({self.stages_per_rank} per rank)"
            )

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        state = checkpoint["state_dict"]
        result = self.lightning_module.load_state_dict(state, strict=False)
        if result.unexpected_keys:
            raise KeyError(f"checkpoint shard holds keys the model does not have: {result.unexpected_keys[:5]}")
        self._loaded_keys = set(state)

    def _check_restored_keys(self) -> None:
        if self._loaded_keys is None:
            return
        missing = sorted(set(self.lightning_module_state_dict()) - self._loaded_keys)
        self._loaded_keys = None
        if missing:
            raise KeyError(f"the checkpoint shard of rank {self.global_rank} lacks this rank's entries: {missing[:5]}")

    def remove_checkpoint(self, filepath: _PATH) -> None:
        """Delete a checkpoint of this run (rank 0), after checking that this run still holds the directory's lock."""
        if self.is_global_zero:
            path = Path(filepath)
            if path.parent in self._locked:
                try:
                    writer_lock.acquire(path.parent, self._run_id)
                except writer_lock.LockHeld as err:
                    raise ckpt_format.CheckpointError(path, f"not removed: {err}") from None
            if path.is_dir():
                shutil.rmtree(path)
            else:
                self.checkpoint_io.remove_checkpoint(filepath)

    # -- teardown --------------------------------------------------------------------------------------------
    def teardown(self) -> None:
        """As Lightning's, except that only this rank's layers move to CPU (the rest live on ``meta``)."""
        _optimizers_to_device(self.optimizers, torch.device("cpu"))
        if self._runtime is not None:
            for m in self._runtime.modules:
                m.cpu()
        self.precision_plugin.teardown()
        assert self.accelerator is not None
        self.accelerator.teardown()
        self.checkpoint_io.teardown()
        for directory in self._locked:  # other runs may save here from now on
            writer_lock.release(directory, self._run_id)
        self._locked.clear()
        if self.cluster_environment is not None:
            self.cluster_environment.teardown()


_EXIT_HOOK: list[bool] = []


def _destroy_process_group_at_exit() -> None:
    """Destroy the process group before the interpreter finalizes (once per process).

    Left to interpreter shutdown, a gloo group that carried the schedule's point-to-point sends can be torn
    down with its worker threads still joinable, which aborts the process (``terminate called without an
    active exception``) after training finished.
    """
    if _EXIT_HOOK:
        return
    _EXIT_HOOK.append(True)

    def destroy() -> None:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            gc.collect()  # finished work objects (and the Python callbacks they hold) go while Python still runs
            torch.distributed.destroy_process_group()

    atexit.register(destroy)


def _refuse_meta_layers(layers: list[nn.Module]) -> None:
    """A layer left on ``meta`` by an earlier pipeline run cannot be split again: say how to get the weights back."""
    if any(p.device.type == "meta" for layer in layers for p in layer.parameters()):
        raise ValueError(
            "some of the model's layers live on the meta device (a previous pipeline run kept only its own "
            "stages); load the weights again, e.g. from load_pipeline_state_dict(checkpoint), before a new run"
        )


def _all_gather_object(obj: Any, group: Any) -> list[Any]:
    """``obj`` of every rank of ``group`` (the world by default); ``[obj]`` without a process group."""
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size(group) == 1:
        return [obj]
    out: list[Any] = [None] * torch.distributed.get_world_size(group)
    torch.distributed.all_gather_object(out, obj, group=group)
    return out


def _picklable(obj: Any) -> bool:
    try:
        pickle.dumps(obj)
    except Exception:  # noqa: BLE001 - any failure means "send something simpler"
        return False
    return True


def _slice(x: Any, n: int) -> Any:
    if torch.is_tensor(x):
        return x[:n]
    if isinstance(x, (tuple, list)):
        return type(x)(_slice(t, n) for t in x)
    return x


def load_pipeline_state_dict(path: _PATH) -> dict[str, torch.Tensor]:
    """Merge the per-rank shards of a memkit_pipeline checkpoint into one full ``state_dict`` (on CPU).

    Every shard is checked first (present, listed size and sha256, same save): a bad or incomplete checkpoint
    raises :class:`~lightning_memkit.pipeline.checkpoint.CheckpointError` (a ``ValueError``) naming the file.

    Example::

        model = MyLM()
        model.load_state_dict(load_pipeline_state_dict("checkpoints/epoch=0-step=100.ckpt"))
    """
    return ckpt_format.merge_state_dicts(path, key="state_dict", weights_only=False)  # as before: a trusted file


MemkitPipelineStrategy.register_strategies(StrategyRegistry)  # also when this module is the first to import Lightning
