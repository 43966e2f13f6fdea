"""``ExportAdapters`` on a model that will have nothing to export is refused at ``setup``, with one line, before any
other work: before ``MemoryBudget`` plans (which can take a minute), whatever order the two are listed in, and in
``memkit fit`` before the fit starts. A model whose adapters come later (the plugin's ``lora_rank``) is not."""

import logging
import warnings

import pytest
from lightning.pytorch import Callback, Trainer

pytest.importorskip("bitsandbytes")
pytest.importorskip("peft")

from lightning_memkit.callbacks import MemoryBudget  # noqa: E402
from lightning_memkit.cli.main import main  # noqa: E402
from lightning_memkit.demo import ByteTextDataModule, HFCausalLM  # noqa: E402
from lightning_memkit.demo.hf_models import tiny_hf_causal_lm  # noqa: E402
from lightning_memkit.finetune import ExportAdapters  # noqa: E402
from lightning_memkit.plugins import NoSaveBitsandbytesPrecision  # noqa: E402

NO_ADAPTERS = ("ExportAdapters: the model has no adapters (train with NoSaveBitsandbytesPrecision(lora_rank=...) or a "
               "peft LoraConfig; a full fine-tune: memkit export --merged, without ExportAdapters in the callbacks)")


class Reached(Callback):
    """Records the hooks reached after ``setup``."""

    def __init__(self) -> None:
        self.hooks: list[str] = []

    def on_fit_start(self, trainer, pl_module):
        self.hooks.append("on_fit_start")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.hooks.append("step")


def _fit(callbacks, plugins=None):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        Trainer(accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                enable_model_summary=False, limit_val_batches=0, callbacks=callbacks, plugins=plugins).fit(
            HFCausalLM("llama"), ByteTextDataModule(batch_size=4, seq_len=32, batch_format="hf", max_bytes=20_000))


@pytest.mark.parametrize("order", ["export_first", "budget_first"])
def test_a_model_without_adapters_is_refused_at_setup_before_the_budget_plans(tmp_path, order):
    budget = MemoryBudget("1GiB")
    export, reached = ExportAdapters(str(tmp_path / "adapters")), Reached()
    callbacks = [export, budget, reached] if order == "export_first" else [budget, export, reached]
    with pytest.raises(ValueError) as raised:
        _fit(callbacks)
    assert str(raised.value) == NO_ADAPTERS and "\n" not in str(raised.value)
    assert budget.plan is None and budget.budget_bytes is None  # MemoryBudget.setup did not start
    assert reached.hooks == [] and export.written is None and not (tmp_path / "adapters").exists()


def test_memkit_fit_refuses_before_the_fit_whatever_the_order(tmp_path, capsys, caplog):
    config = tmp_path / "run.yaml"
    config.write_text(f"""
trainer:
  accelerator: cpu
  max_steps: 2
  logger: false
  enable_progress_bar: false
  default_root_dir: {tmp_path / "run"}
  callbacks:
    - class_path: lightning_memkit.callbacks.MemoryBudget
      init_args: {{budget: 1GiB}}
    - class_path: lightning_memkit.finetune.ExportAdapters
model:
  class_path: lightning_memkit.demo.HFCausalLM
  init_args: {{family: llama}}
data:
  class_path: lightning_memkit.demo.ByteTextDataModule
  init_args: {{batch_size: 4, seq_len: 32, batch_format: hf, max_bytes: 20000}}
""")
    with caplog.at_level(logging.INFO), pytest.raises(SystemExit) as exited:
        main(["fit", "--config", str(config)])
    assert exited.value.code == 2
    captured = capsys.readouterr()
    assert captured.err == f"memkit fit: error: {NO_ADAPTERS}\n"
    assert "MemoryBudget" not in captured.out + caplog.text  # it neither planned nor said it would
    assert not (tmp_path / "run").exists()


def test_adapters_still_to_come_pass_and_experts_adapters_are_refused():
    def trainer(**plugin):
        return Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                       plugins=[NoSaveBitsandbytesPrecision("nf4", "float32", **plugin)] if plugin else None)

    export = ExportAdapters()
    export.preflight(trainer(lora_rank=4), HFCausalLM("llama"))  # the plugin adds them at the strategy's setup
    export.preflight(trainer(), HFCausalLM("llama", peft_lora={"r": 4, "target_modules": ["q_proj"]}))
    converted = NoSaveBitsandbytesPrecision("nf4", "float32", lora_rank=4).convert_module(tiny_hf_causal_lm("llama"))
    export.preflight(trainer(), converted)  # converted already, adapters on
    with pytest.raises(ValueError, match=r"^ExportAdapters: the model has no adapters"):
        export.preflight(trainer(lora_rank=0), HFCausalLM("llama"))
    with pytest.raises(ValueError, match=r"^ExportAdapters: NoSaveBitsandbytesPrecision\(lora_rank=4\) will put "
                                         r"adapters on the MoE experts .*; allowed: "):
        export.preflight(trainer(lora_rank=4), HFCausalLM("qwen3_moe"))
    from lightning_memkit.demo import TinyLM

    with pytest.raises(ValueError, match=r"^ExportAdapters: TinyLM holds 0 transformers models; one is needed$"):
        export.preflight(trainer(), TinyLM())


def test_the_plugins_adapters_still_export_at_the_end(tmp_path):
    export = ExportAdapters(str(tmp_path / "adapters"))
    _fit([export, MemoryBudget("1GiB")], plugins=[NoSaveBitsandbytesPrecision("nf4", "bfloat16", lora_rank=4)])
    assert (export.written / "adapter_model.safetensors").is_file()
