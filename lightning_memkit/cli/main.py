"""The ``memkit`` command: the subcommand table and the dispatch; each subcommand is one thin module.

``fit``, ``validate``, ``test`` and ``predict`` run :class:`~lightning_memkit.config.lightning_cli.MemkitCLI`
(Lightning's CLI, with the memory report after ``fit``); ``memkit compare`` is
:func:`lightning_memkit.cli.compare.main`, ``memkit estimate`` :func:`lightning_memkit.cli.estimate.main`.

A bad configuration value is a :class:`~lightning_memkit.common.errors.ConfigError`: ``memkit`` prints it on
one or two lines, naming the key and what is allowed, and exits with status 2; so do a ``--config`` file that
is not YAML (one line naming the file, line and column) and an unknown subcommand (one line listing them).
``--debug`` (anywhere on the command line) or the environment variable ``MEMKIT_DEBUG=1`` shows the full
traceback instead. Errors raised while training always show their traceback.

Usage::

    memkit fit --config examples/configs/tiny_lm.yaml
    memkit fit --config examples/configs/tiny_lm.yaml --trainer.max_steps 20 --model.n_layers 2
    memkit fit --config examples/configs/tiny_lm.yaml --budget 24MiB   # adds MemoryBudget("24MiB")
    memkit test --config examples/configs/tiny_lm.yaml --trainer.limit_test_batches 2
    memkit --help     # every subcommand, one line each
    memkit fit --help
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

from lightning_memkit.config.errors import ConfigError

if TYPE_CHECKING:  # Lightning is imported by the subcommands that run it, not by `memkit estimate`
    from lightning.pytorch.cli import ArgsType

__all__ = ["SUBCOMMANDS", "budget_arguments", "main", "usage"]




def _debug_requested(argv: list[str]) -> bool:
    return "--debug" in argv or os.environ.get("MEMKIT_DEBUG", "").strip().lower() not in ("", "0", "false", "no")


SUBCOMMANDS = {
    "fit": "train, then print the memory report (step peaks, saved tensors, first and last loss); "
           "--budget SIZE fits the run into SIZE (MemoryBudget)",
    "validate": "one evaluation epoch over the validation set",
    "test": "one evaluation epoch over the test set",
    "predict": "run inference and print the kind and shape of what was predicted",
    "compare": "train a config without and with its memkit memory features: peak bytes per phase",
    "estimate": "predict the device memory of a training step, nothing allocated",
    "export": "write a checkpoint's adapters in peft's format, with how to load their base",
}


def usage() -> str:
    """The help of ``memkit`` itself: every subcommand, one line each."""
    width = max(map(len, SUBCOMMANDS))
    return "\n".join([
        "usage: memkit <subcommand> [--config CONFIG] [--key value ...] [--debug]", "", "subcommands:",
        *(f"  {name:<{width}}  {text}" for name, text in SUBCOMMANDS.items()), "",
        "`memkit <subcommand> --help` lists a subcommand's options; --debug (or MEMKIT_DEBUG=1) shows the full "
        "traceback of a configuration error.",
    ])


def _check_subcommand(argv: list[str]) -> None:
    """Print :func:`usage` for ``memkit`` (exit 2) and ``memkit --help`` (exit 0); refuse an unknown subcommand."""
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(), file=sys.stdout if argv else sys.stderr)
        raise SystemExit(0 if argv else 2)
    leading_options = argv[0].startswith("-")  # `memkit --config C fit`: Lightning's top-level options
    if argv[0] in SUBCOMMANDS or (leading_options and any(a in SUBCOMMANDS for a in argv)):
        return
    got = "no subcommand given" if leading_options else f"unknown subcommand {argv[0]!r}"
    raise ConfigError(f"{got}; choose from {', '.join(SUBCOMMANDS)} (memkit --help)", hint=False)


def main(args: ArgsType = None) -> None:
    """Entry point of the ``memkit`` console script; ``args`` as for ``LightningCLI`` (default: ``sys.argv[1:]``).

    ``memkit compare ...`` goes to :func:`lightning_memkit.cli.compare.main`, ``memkit estimate ...`` to
    :func:`lightning_memkit.cli.estimate.main`, the other :data:`SUBCOMMANDS` to :class:`MemkitCLI`; ``memkit``
    alone (on stderr, exit 2) and ``memkit --help`` print :func:`usage`, an unknown subcommand is an error.
    A :class:`ConfigError` prints ``memkit: error: ...`` on stderr and exits with status 2, a ``MemoryBudget``
    that no plan fits (``NoPlanFits``, at setup or a re-plan) the same with status 1, unless ``--debug`` is given
    (removed before parsing) or ``MEMKIT_DEBUG=1`` is set: then it propagates with its traceback.
    """
    from_sys = args is None
    if from_sys:
        import_from_working_directory()
    argv = [str(a) for a in (sys.argv[1:] if from_sys else args)]
    debug = _debug_requested(argv)
    argv = _without_debug(argv, from_sys)
    try:
        _check_subcommand(argv)
        if argv[0] == "fit" and any(a == "--budget" or a.startswith("--budget=") for a in argv):
            argv = budget_arguments(argv)
            if from_sys:
                sys.argv[1:] = argv
        _run_subcommand(argv, from_sys)
        if from_sys and argv[0] == "estimate":
            _exit_without_teardown()
    except ValueError as err:
        if not debug:
            _exit_on_refusal(err, argv)
        raise


def _without_debug(argv: list[str], from_sys: bool) -> list[str]:
    """``argv`` without ``--debug``; processes that Lightning launches re-run ``sys.argv``: they learn of it from
    ``MEMKIT_DEBUG``."""
    if "--debug" not in argv:
        return argv
    argv = [a for a in argv if a != "--debug"]
    if from_sys:
        sys.argv[1:] = argv
        os.environ["MEMKIT_DEBUG"] = "1"
    return argv


def _exit_on_refusal(err: ValueError, argv: list[str]) -> None:
    """A :class:`ConfigError` (status 2) or a budget no plan fits (``NoPlanFits``: the run's answer, not a crash;
    status 1) printed as one line on stderr, then the exit; any other error returns (the caller raises it)."""
    budget = sys.modules.get("lightning_memkit.callbacks.memory_budget")  # loaded where it raised: nothing imported
    command = f"memkit {argv[0]}" if argv and argv[0] in SUBCOMMANDS else "memkit"
    if budget is not None and isinstance(err, budget.NoPlanFits):
        print(f"{command}: error: {err}\n  add --debug for the full traceback", file=sys.stderr)
        raise SystemExit(1) from None
    if isinstance(err, ConfigError):
        print(f"{command}: error: {err}", file=sys.stderr)
        if getattr(err, "hint", True):
            print(f"  see `{command} --help` for the accepted options; add --debug for the full traceback",
                  file=sys.stderr)
        raise SystemExit(2) from None


def import_from_working_directory() -> None:
    """Put the working directory first on ``sys.path``, as ``python -m`` does, so that a config's ``class_path``
    can name a module beside it (``mylm.MyLM`` for ``./mylm.py``); a console script's path starts with its own
    folder instead. Nothing is imported here."""
    cwd = os.getcwd()
    if not sys.path or sys.path[0] not in ("", cwd):
        sys.path.insert(0, cwd)


def _exit_without_teardown() -> None:
    """End a finished ``memkit estimate`` command now: its output flushed, logging shut down, and the process gone
    without the interpreter's teardown of torch, transformers and Lightning (1 to 2 s on 2 cores, a sixth of a
    QLoRA estimate). The command writes nothing but its output, and its sample processes are joined; in-process
    callers of :func:`main` (``args`` given) return as usual."""
    import logging

    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(0)


def budget_arguments(argv: list[str]) -> list[str]:
    """``memkit fit ... --budget SIZE`` as LightningCLI arguments: a :class:`~lightning_memkit.callbacks.MemoryBudget`
    of ``SIZE`` appended to the trainer's callbacks.

    Example::

        >>> budget_arguments(["fit", "--config", "c.yaml", "--budget", "24GiB"])[3:]
        ['--trainer.callbacks+=lightning_memkit.callbacks.MemoryBudget', '--trainer.callbacks.budget=24GiB']
    """
    out, value, i = [], None, 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--budget" or arg.startswith("--budget="):
            if value is not None:
                raise ConfigError("--budget: given twice; give it once", hint=False)
            value = arg.partition("=")[2] if "=" in arg else (argv[i + 1] if i + 1 < len(argv) else "")
            i += 1 if "=" in arg else 2
            if not value or value.startswith("--"):
                raise ConfigError("--budget: needs a size, e.g. --budget 24GiB (or bytes, or a fraction such as 0.9)",
                                  hint=False)
            continue
        out.append(arg)
        i += 1
    from lightning_memkit.callbacks.memory_budget import check_budget

    try:
        check_budget(value)  # a clear error before anything is built
    except (TypeError, ValueError) as err:
        raise ConfigError(f"--budget: {err}", hint=False) from None
    return [*out, "--trainer.callbacks+=lightning_memkit.callbacks.MemoryBudget", f"--trainer.callbacks.budget={value}"]


def _run_subcommand(argv: list[str], from_sys: bool) -> None:
    if argv[0] == "compare":
        from lightning_memkit.cli.compare import main as compare_main

        compare_main(argv[1:])
    elif argv[0] == "estimate":
        from lightning_memkit.cli.estimate import main as estimate_main

        estimate_main(argv[1:])
    elif argv[0] == "export":
        from lightning_memkit.cli.export import main as export_main

        export_main(argv[1:])
    else:
        from lightning_memkit.config.lightning_cli import MemkitCLI

        MemkitCLI(args=None if from_sys else argv)
