"""``memkit export``: a checkpoint's adapters written as the fit's own export writes them, and its errors."""

import warnings

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

pytest.importorskip("bitsandbytes")
pytest.importorskip("peft")

from safetensors.torch import load_file  # noqa: E402

from lightning_memkit.cli.main import main  # noqa: E402
from lightning_memkit.demo import ByteTextDataModule  # noqa: E402
from lightning_memkit.demo.hf_models import tiny_hf_causal_lm  # noqa: E402
from lightning_memkit.finetune import ExportAdapters, PretrainedCausalLM  # noqa: E402
from lightning_memkit.plugins import NoSaveBitsandbytesPrecision  # noqa: E402


def _config(tmp_path, base, lora_rank: int) -> str:
    path = tmp_path / "run.yaml"
    path.write_text(f"""
trainer:
  accelerator: cpu
  plugins:
    - class_path: lightning_memkit.plugins.NoSaveBitsandbytesPrecision
      init_args: {{mode: nf4-dq, dtype: bfloat16, lora_rank: {lora_rank}}}
model:
  class_path: lightning_memkit.finetune.PretrainedCausalLM
  init_args: {{model: {base}, dtype: bfloat16, lr: 0.01}}
data:
  class_path: lightning_memkit.demo.ByteTextDataModule
  init_args: {{batch_size: 4, seq_len: 32, batch_format: hf, max_bytes: 20000}}
""")
    return str(path)


def test_the_export_of_a_checkpoint_is_the_fits_own_export(tmp_path):
    base = tmp_path / "base"
    tiny_hf_causal_lm("llama", seed=0, dtype=torch.bfloat16).save_pretrained(base)
    module = PretrainedCausalLM(str(base), dtype="bfloat16", lr=1e-2)
    at_end = ExportAdapters(str(tmp_path / "at_end"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        Trainer(accelerator="cpu", max_steps=2, logger=False, enable_progress_bar=False, enable_model_summary=False,
                limit_val_batches=0, plugins=[NoSaveBitsandbytesPrecision("nf4-dq", "bfloat16", lora_rank=4)],
                callbacks=[at_end, ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)]).fit(
            module, ByteTextDataModule(batch_size=4, seq_len=32, batch_format="hf", max_bytes=20_000))
    main(["export", "--config", _config(tmp_path, base, 4), "--ckpt_path", str(tmp_path / "ckpt" / "last.ckpt"),
          "--output", str(tmp_path / "exported")])
    out = tmp_path / "exported"
    ours, fits = load_file(out / "adapter_model.safetensors"), load_file(at_end.written / "adapter_model.safetensors")
    assert ours.keys() == fits.keys() and all(torch.equal(ours[k], fits[k]) for k in ours)
    for name in ("adapter_config.json", "memkit_base.json"):
        assert (out / name).read_text() == (at_end.written / name).read_text()
    main(["export", "--config", _config(tmp_path, base, 4), "--ckpt_path", str(tmp_path / "ckpt" / "last.ckpt"),
          "--merged"])
    merged = load_file(tmp_path / "ckpt" / "merged" / "model.safetensors")
    assert merged["model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16


def test_export_errors_are_one_line(tmp_path, capsys):
    base = tmp_path / "base"
    tiny_hf_causal_lm("llama", seed=0).save_pretrained(base)
    capsys.readouterr()  # save_pretrained's progress
    for args, message in ((["export", "--config", "x.yaml"], "--config and --ckpt_path are required"),
                          (["export", "--config", _config(tmp_path, base, 4), "--ckpt_path", "nope.ckpt"],
                           "--ckpt_path: 'nope.ckpt' is not a file")):
        with pytest.raises(SystemExit) as exit_info:
            main(args)
        err = capsys.readouterr().err.strip().splitlines()
        assert exit_info.value.code == 2 and len(err) == 1 and message in err[0], err
