"""``memkit export``: the adapters of a training checkpoint in peft's format (see
:func:`lightning_memkit.finetune.export_adapters`), without training: the config's model is built, converted by
its QLoRA plugin as the run converted it, loaded from the checkpoint, and its adapters written."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from lightning_memkit.cli.arguments import parse_subcommand
from lightning_memkit.config.errors import ConfigError, trainer_entries

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="memkit export", exit_on_error=False, allow_abbrev=False,
        description="Write the adapters of a checkpoint in peft's format, with memkit_base.json (how to load the "
        "base). Other --key value arguments override the config as in `memkit fit`.",
    )
    p.add_argument("-c", "--config", default=None, help="the YAML config the checkpoint was trained with (required)")
    p.add_argument("--ckpt_path", default=None, help="a Lightning checkpoint of that run (required)")
    p.add_argument("--output", default=None, help="where the adapters go (default: adapters/ beside the checkpoint, "
                   "merged/ with --merged)")
    p.add_argument("--merged", action="store_true", help="write the whole model instead, each quantized weight "
                   "dequantized with its adapter folded in, in bf16: it serves with transformers alone")
    return p


def main(argv: Sequence[str] | None = None) -> Path:
    """``memkit export --config C --ckpt_path P [--output D] [--key value ...]``; returns the directory written."""
    import torch

    from lightning_memkit.config.lightning_cli import instantiate, parse_config
    from lightning_memkit.finetune import export_adapters, export_merged
    from lightning_memkit.plugins import NoSaveBitsandbytesPrecision

    args, overrides = parse_subcommand(_parser(), argv)
    if args.config is None or args.ckpt_path is None:
        raise ConfigError("--config and --ckpt_path are required: memkit export --config run.yaml --ckpt_path "
                          "last.ckpt", hint=False)
    ckpt = Path(args.ckpt_path)
    if not ckpt.is_file():
        raise ConfigError(f"--ckpt_path: {str(ckpt)!r} is not a file", hint=False)
    config = parse_config(Path(args.config), overrides)
    model = instantiate(config["model"])
    for _, entry in trainer_entries(config, "plugins"):
        plugin = instantiate(entry)
        if isinstance(plugin, NoSaveBitsandbytesPrecision):
            plugin.convert_on_load(model)
    # a Lightning checkpoint holds more than tensors (hyperparameters, loop state): the user's own file
    checkpoint = torch.load(ckpt, map_location="cpu", weights_only=False)
    try:
        model.load_state_dict(checkpoint["state_dict"])
    except (KeyError, RuntimeError, ValueError) as err:
        raise ConfigError(f"--ckpt_path: {str(ckpt)!r} does not load into the config's model: {err}",
                          hint=False) from None
    if args.merged:
        out = export_merged(model, args.output or ckpt.parent / "merged")
        print(f"memkit export: the model of {ckpt}, its adapters merged, written to {out}")
    else:
        out = export_adapters(model, args.output or ckpt.parent / "adapters")
        print(f"memkit export: the adapters of {ckpt} written to {out}")
    return out
