"""A causal LM from an HF ``config.json`` as ``memkit estimate --hf-config`` runs it, as a run for the planner.

Example::

    >>> import pathlib, tempfile
    >>> from lightning_memkit.demo.hf_models import tiny_hf_config
    >>> from lightning_memkit.estimate.hf_run import HFRun
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "config.json"
    >>> _ = path.write_text(tiny_hf_config("llama", vocab_size=1000, num_layers=1).to_json_string())
    >>> run = HFRun(path, seq_len=64, batch_size=4)
    >>> plan = run.base.replace(recompute="full", micro_batch=2)
    >>> run.fragment(plan)["trainer"]["accumulate_grad_batches"], run.notes(plan)[1]
    (2, "and set your data module's batch size to 2")
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from lightning_memkit.estimate.levers import Plan, lever
from lightning_memkit.estimate.runs import LeverRun, check_allow
from lightning_memkit.estimate.step_spec import StepSpec

__all__ = ["HFRun"]


class HFRun(LeverRun):
    """A causal LM from an HF ``config.json`` as ``memkit estimate --hf-config`` runs it; ``base`` is that run."""

    kind = "hf"
    has_causal_lm = True

    def __init__(self, path: str | Path, seq_len: int = 2048, batch_size: int = 1, precision: str = "32-true",
                 optimizer: str = "adamw", activation_checkpointing: bool | str = False, fused_loss: bool = False,
                 plugin: str | None = None, lora_rank: int = 16, device: str = "cuda",
                 allow: Sequence[str] | None = None, devices: int = 1):
        from lightning_memkit.estimate.hf_step import check_choices, checkpoint_mode
        from lightning_memkit.estimate.inputs import check_devices, check_positions, check_tokens, read_hf_config
        from lightning_memkit.estimate.levers.quantization import qlora_plugin

        check_choices(precision=precision, optimizer=optimizer, device=device)
        mode = checkpoint_mode(activation_checkpointing)
        qlora_plugin(plugin, precision, lora_rank)
        seq_len, batch_size = check_tokens(seq_len, batch_size)
        self.devices = check_devices(devices)
        self.allow = check_allow(allow)
        self.config = read_hf_config(path)  # checked before the first estimate
        check_positions(seq_len, self.config, path)
        self.path, self.seq_len, self.optimizer, self.lora_rank = Path(path), seq_len, optimizer, lora_rank
        self.device, self.target, self.optimizer_name = device, device, optimizer
        self.batch_size = batch_size
        self.base = Plan(precision=precision, quantization=plugin,
                         recompute=mode, fused_loss=bool(fused_loss),
                         micro_batch=batch_size)

    def new_step(self) -> StepSpec:
        from lightning_memkit.estimate.hf_step import decoder_layer_policy

        step = super().new_step()
        step.policy, step.lora_rank = decoder_layer_policy, self.lora_rank  # recomputed: the decoder layers
        return step

    def estimate(self, plan: Plan) -> Any:
        from lightning_memkit.estimate.hf_step import estimate_hf_step, estimate_pipeline_step

        step = self.step_spec(plan)
        if step.world.pipeline > 1:
            return estimate_pipeline_step(self.config, step, microbatches=self.batch_size, seq_len=self.seq_len,
                                          batch_size=self.batch_size, optimizer=self.optimizer)
        return estimate_hf_step(self.config, step, seq_len=self.seq_len, optimizer=self.optimizer)

    def pipelines(self) -> Iterator[Plan]:
        """Pipeline plans with every single-device feature on (a quantization as given), at most ``devices`` stages
        where the run names its devices, for the models ``memkit_pipeline`` splits (``causal_lm_config_problems``
        finds nothing)."""
        from lightning_memkit.hf.pipeline_stages import causal_lm_config_problems

        if not causal_lm_config_problems(self.config):
            layers = int(getattr(self.config, "num_hidden_layers", 0) or 0)
            # the levers the pipeline's estimate models: every other lever as given
            precision = lever("precision").options(self.base["precision"], self)[-1]  # the strongest
            most = self.devices if self.devices > 1 else layers  # the devices given bound the stages
            for stages in [s for s in (2, 4, 8) if s <= min(layers, most)]:
                yield self.base.replace(precision=precision, recompute="full", fused_loss=True,
                                        micro_batch=self.batch_size, stages=stages)


    def notes(self, plan: Plan) -> list[str]:
        notes = ["add these callbacks to your own list (a later --config replaces the whole list)"
                 if self.written(plan).callbacks else "a fragment of your trainer config"]
        if plan["micro_batch"] != self.batch_size:
            notes.append(f"and set your data module's batch size to {plan['micro_batch']}")
        return notes
