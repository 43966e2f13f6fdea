"""``memkit estimate``: the command line of :mod:`lightning_memkit.estimate` (HF ``config.json`` or memkit config).

    memkit estimate --hf-config examples/hf_configs/gpt_oss_20b.json --seq-len 4096 --batch-size 1 \\
        --precision bf16-true --activation-checkpointing --fused-loss --optimizer adamw [--json]
    memkit estimate --hf-config ... --pipeline 2 [--microbatches 4]   # per-rank peaks under memkit_pipeline
    memkit estimate --config examples/configs/tiny_lm.yaml [--json] [--model.n_layers 2 ...]
    memkit estimate --hf-config ... --budget 24GiB                     # the cheapest plans that fit
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator, Sequence
from typing import Any

from lightning_memkit.cli.arguments import parse_subcommand
from lightning_memkit.common.validation import check_int, check_number
from lightning_memkit.config.errors import ConfigError
from lightning_memkit.estimate.hf import (
    DEFAULT_LORA_RANK,
    PLUGINS,
    check_choices,
    checkpoint_mode,
    estimate_from_hf_config,
    estimate_hf_pipeline,
    qlora_plugin,
)
from lightning_memkit.estimate.inputs import InputWarning, check_devices, check_pipeline, check_tokens, checked
from lightning_memkit.estimate.step import PRECISIONS, MemoryEstimate
from lightning_memkit.measure.report import report_console

__all__ = ["main"]


_HF_DEFAULTS = {"seq_len": 2048, "batch_size": 1, "precision": "32-true", "optimizer": "adamw",
                "activation_checkpointing": False, "fused_loss": False, "plugin": None,
                "lora_rank": DEFAULT_LORA_RANK, "device": "cuda", "devices": 1}


def _integer(text: str) -> int | str:
    """``argparse`` type of the integer options: digits as an int, anything else (``1e10``) as given, for the
    option's own check to refuse in one line naming it and what it allows."""
    try:
        return int(text)
    except ValueError:
        return text


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="memkit estimate", exit_on_error=False, allow_abbrev=False,
        description="Predict the device memory of a training step (steady state: optimizer state allocated) "
        "without allocating it: the model runs on fake tensors. Give --hf-config or --config; the options "
        "after --hf-config describe the run (a --config says them itself; override its keys as in memkit fit).",
    )
    p.add_argument("-c", "--config", default=None, help="a memkit / LightningCLI YAML config")
    p.add_argument("--hf-config", default=None, help="a Hugging Face config.json of a causal LM")
    p.add_argument("--seq-len", type=_integer, default=None,
                   help="tokens per sequence (default 2048); max (with --hf-config and --budget): the longest that "
                   "fits, and its plans")
    p.add_argument("--batch-size", type=_integer, default=None, help="sequences per batch (default 1)")
    p.add_argument("--precision", default=None, help=f"one of {', '.join(PRECISIONS)} (default 32-true)")
    p.add_argument("--optimizer", default=None, help="adamw (default) or sgd (momentum 0.9)")
    p.add_argument("--activation-checkpointing", nargs="?", const="full", default=None,
                   help="recompute every decoder layer: full (the default when given) or selective (keep matmul "
                   "and attention outputs)")
    p.add_argument("--fused-loss", action="store_true", default=None,
                   help="fused linear cross-entropy: no (B, T, V) logits")
    p.add_argument("--plugin", default=None, help=f"quantized model with LoRA adapters (QLoRA, "
                   f"NoSaveBitsandbytesPrecision in --precision's dtype): one of {', '.join(PLUGINS)}")
    p.add_argument("--lora-rank", type=_integer, default=None,
                   help=f"LoRA rank with --plugin (default {DEFAULT_LORA_RANK})")
    p.add_argument("--device", default=None, help="where the step will run: cuda (default: adds optimizer.step()'s "
                   "foreach temporaries; kernel workspaces and allocator rounding are not counted) or cpu")
    p.add_argument("--budget", default=None, help="device memory available, e.g. 24GiB or 80GB: search the "
                   "feature plans that fit and print the cheapest as LightningCLI YAML fragments")
    p.add_argument("--allow", default=None,
                   help="with --budget: the levers a plan may pull, comma-separated (default: all but optimizer_8bit, "
                   "which changes the numerics): precision, quantization, recompute, offload_activations, fused_loss, "
                   "micro_batch, optimizer_in_backward, offload_optimizer, optimizer_8bit, stages")
    p.add_argument("--host-memory", default=None,
                   help="with --budget: host memory the plans may keep offloaded bytes in, e.g. 128GiB (default: what "
                   "this machine has free now)")
    p.add_argument("--machine", default=None,
                   help="with --budget: the device balance the plans are ranked with: h100, a JSON object of "
                   "gemm_flops, memory_bytes_per_s, link_bytes_per_s (and host_memory_bytes_per_s), or a file holding "
                   "one (default: MEMKIT_MACHINE when set, else this machine's probe; an H100's for --device cuda "
                   "without one)")
    p.add_argument("--margin", type=float, default=None,
                   help="with --budget: a plan fits when its peak plus this fraction is within the budget "
                   "(default 0.05, the estimate's accuracy goal)")
    p.add_argument("--max-plans", type=_integer, default=None, help="with --budget: plans to print (default 3)")
    p.add_argument("--max-estimates", type=_integer, default=None,
                   help="with --budget: stop after this many estimates (default 48; each takes one estimate's time)")
    p.add_argument("--devices", type=_integer, default=None,
                   help="devices the run trains on (default 1): each rank's step sharded over them with FSDP2 "
                        "(memkit_fsdp2); with --budget the search may shard or not")
    p.add_argument("--pipeline", type=_integer, default=None,
                   help="ranks of a memkit_pipeline (1F1B): per-rank peaks of the split it would choose")
    p.add_argument("--microbatches", type=_integer, default=None,
                   help="microbatches per step with --pipeline (default 4, the strategy's; divides --batch-size)")
    p.add_argument("--full-trace", action="store_true",
                   help="with --hf-config: trace every decoder layer instead of composing the step from traces of "
                   "the model cut to a few layers (the default for models of more than 16 layers; same bytes, slower)")
    p.add_argument("--json", action="store_true", help="print the estimate as JSON instead of the table")
    return p


def _check(args: argparse.Namespace) -> None:
    """Refuse contradictory or unsupported options; fill the --hf-config defaults."""

    if (args.config is None) == (args.hf_config is None):
        raise ConfigError("give exactly one of --config path/to/config.yaml or --hf-config path/to/config.json")
    given = [f"--{k.replace('_', '-')}" for k in _HF_DEFAULTS if getattr(args, k) is not None]
    if args.config is not None and given:
        raise ConfigError(f"{', '.join(given)}: with --config the config says these; override its keys instead "
                          "(--trainer.precision bf16-true, --data.init_args.seq_len 512, ...)")
    args.longest = args.seq_len == "max"
    if args.longest:
        if args.hf_config is None or args.budget is None or args.pipeline is not None:
            raise ConfigError("--seq-len max: only with --hf-config and --budget (the memory the sequence must fit), "
                              "without --pipeline")
        args.seq_len = None
    for key, default in _HF_DEFAULTS.items():
        if getattr(args, key) is None:
            setattr(args, key, default)
    check_choices(precision=args.precision, device=args.device, optimizer=args.optimizer)
    check_tokens(args.seq_len, args.batch_size)
    check_devices(args.devices)
    if args.plugin is not None:
        qlora_plugin(args.plugin, args.precision, args.lora_rank)  # raises naming what is allowed
    elif args.config is None and args.lora_rank != DEFAULT_LORA_RANK:
        raise ConfigError("--lora-rank: only with --plugin")
    checkpoint_mode(args.activation_checkpointing)
    if args.full_trace and (args.config is not None or args.pipeline is not None or args.budget is not None):
        raise ConfigError("--full-trace: only with --hf-config, without --pipeline and --budget")
    _check_budget(args)
    _check_pipeline(args)


def _check_budget(args: argparse.Namespace) -> None:
    from lightning_memkit.common.sizes import parse_bytes

    if args.budget is None:
        for key in ("margin", "max_plans", "max_estimates", "allow", "host_memory", "machine"):
            if getattr(args, key) is not None:
                raise ConfigError(f"--{key.replace('_', '-')}: only with --budget")
        return
    if args.pipeline is not None:
        raise ConfigError("--budget and --pipeline: the budget search tries pipeline stages itself; leave out "
                          "--pipeline")
    if args.host_memory is not None:
        try:
            args.host_memory = parse_bytes(args.host_memory)
        except ValueError as err:
            raise ConfigError(f"--host-memory: {err}") from None
    if args.machine is not None:
        from lightning_memkit.measure.machine import machine_balance

        try:
            args.machine = machine_balance(args.machine, "--machine")
        except (TypeError, ValueError) as err:
            raise ConfigError(str(err)) from None
    if args.allow is not None:
        from lightning_memkit.estimate.runs import check_allow

        check_allow(_allow(args.allow), "--allow")  # before any estimate
    try:
        args.budget = parse_bytes(args.budget)
    except ConfigError as err:
        raise ConfigError(f"--budget: {err}") from None
    args.margin = checked(check_number, 0.05 if args.margin is None else args.margin, "--margin", minimum=0,
                          maximum=1, max_inclusive=False)
    args.max_plans = checked(check_int, 3 if args.max_plans is None else args.max_plans, "--max-plans", minimum=1)
    # at least the run as given and the strongest plan
    args.max_estimates = checked(check_int, 48 if args.max_estimates is None else args.max_estimates,
                                 "--max-estimates", minimum=2)


def _check_pipeline(args: argparse.Namespace) -> None:

    if args.pipeline is None:
        if args.microbatches is not None:
            raise ConfigError("--microbatches: only with --pipeline N")
        return
    if args.config is not None:
        raise ConfigError("--pipeline: only with --hf-config (a --config sets its strategy itself)")
    args.microbatches = check_pipeline(args.pipeline, 4 if args.microbatches is None else args.microbatches,
                                       args.batch_size)


def main(argv: Sequence[str] | None = None) -> Any:
    """``memkit estimate ...``: print the table (or ``--json``); bad arguments raise ``ConfigError``.

    Returns the :class:`~lightning_memkit.memory.MemoryEstimate`, :class:`PipelineEstimate` or, with
    ``--budget``, :class:`~lightning_memkit.estimate.plans.SearchResult`.
    """

    args, overrides = parse_subcommand(_parser(), argv)
    _check(args)
    if args.hf_config is not None and overrides:
        raise ConfigError(f"unrecognized arguments: {' '.join(overrides)}")
    with _input_warnings_on_stderr():
        if args.longest:
            return _longest(args)
        if args.budget is not None:
            return _search(args, overrides)
        est = _estimate(args, overrides)
    if args.json:
        print(est.to_json())
        return est
    console = report_console()
    if isinstance(est, MemoryEstimate):
        console.print(est.table())
    console.print(est.notes(), markup=False, highlight=False, soft_wrap=True)
    return est


def _estimate(args: argparse.Namespace, overrides: Sequence[str]) -> Any:
    """The estimate the checked ``args`` ask for: of an HF config (pipeline stages or one device) or a config."""
    if args.config is not None:
        from lightning_memkit.estimate.config import estimate_from_config  # Lightning: only for a --config

        return estimate_from_config(args.config, overrides)
    run = (dict(stages=args.pipeline, microbatches=args.microbatches, plugin=args.plugin, lora_rank=args.lora_rank)
           if args.pipeline else
           dict(plugin=args.plugin, lora_rank=args.lora_rank, device=args.device, devices=args.devices,
                compose=False if args.full_trace else "auto"))
    fn = estimate_hf_pipeline if args.pipeline else estimate_from_hf_config
    return fn(args.hf_config, seq_len=args.seq_len, batch_size=args.batch_size, precision=args.precision,
              optimizer=args.optimizer, activation_checkpointing=args.activation_checkpointing,
              fused_loss=args.fused_loss, **run)


@contextlib.contextmanager
def _input_warnings_on_stderr() -> Iterator[None]:
    """Each :class:`~lightning_memkit.estimate.inputs.InputWarning` once, as a ``memkit estimate: ...`` line on
    stderr (as the ``--budget`` progress lines); other warnings as Python shows them."""
    import warnings

    shown, printed = warnings.showwarning, set()

    def show(message: Any, category: type, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
        if not issubclass(category, InputWarning):
            shown(message, category, filename, lineno, file, line)
        elif str(message) not in printed:  # once, though a --budget search reads the config for each estimate
            printed.add(str(message))
            print(f"memkit estimate: {message}", file=sys.stderr, flush=True)

    with warnings.catch_warnings():
        warnings.simplefilter("always", InputWarning)
        warnings.showwarning = show
        yield


def _allow(text: str | None) -> list[str] | None:
    return None if text is None else [a.strip() for a in text.split(",") if a.strip()]


def _hf_run(args: argparse.Namespace, seq_len: int) -> Any:
    from lightning_memkit.estimate.hf_run import HFRun

    return HFRun(args.hf_config, seq_len=seq_len, batch_size=args.batch_size, precision=args.precision,
                 optimizer=args.optimizer, activation_checkpointing=args.activation_checkpointing,
                 fused_loss=args.fused_loss, plugin=args.plugin, lora_rank=args.lora_rank, device=args.device,
                 allow=_allow(args.allow), devices=args.devices)


def _longest(args: argparse.Namespace) -> Any:
    """``--seq-len max``: the longest sequence that fits the budget, and its plans."""
    import json

    from lightning_memkit.estimate.longest import longest_sequence

    def say(line: str) -> None:
        print(f"memkit estimate: {line}", file=sys.stderr, flush=True)

    step = 1024 if args.budget >= 2**30 else 128  # tokens: a GiB budget's lengths to 1,024, a tiny one's to 128
    try:
        result = longest_sequence(lambda tokens: _hf_run(args, tokens), args.budget, lower=step, granularity=step,
                                  margin=args.margin, host_budget=args.host_memory, machine=args.machine,
                                  progress=say, max_plans=args.max_plans, max_estimates=args.max_estimates)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    print(json.dumps(result.to_dict(), indent=2) if args.json else result)
    return result


def _search(args: argparse.Namespace, overrides: Sequence[str]) -> Any:
    """``--budget``: the plan search, with a line per estimate on stderr."""

    from lightning_memkit.estimate.config_run import ConfigRun
    from lightning_memkit.estimate.plans import search_plans

    if args.hf_config is not None:
        run = _hf_run(args, args.seq_len)
    else:
        run = ConfigRun(args.config, list(overrides), allow=_allow(args.allow))
    result = search_plans(run, args.budget, margin=args.margin, max_plans=args.max_plans,
                          max_estimates=args.max_estimates, host_budget=args.host_memory, machine=args.machine,
                          progress=lambda line: print(f"memkit estimate: {line}", file=sys.stderr, flush=True))
    print(result.to_json() if args.json else result)
    return result

