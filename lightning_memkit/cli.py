"""The ``memkit`` command: Lightning's CLI with a memory report at the end of ``fit``.

``memkit`` is :class:`lightning.pytorch.cli.LightningCLI` with any LightningModule / LightningDataModule
selectable by ``class_path`` (default: :class:`~lightning_memkit.demo.TinyLM` on
:class:`~lightning_memkit.demo.ByteTextDataModule`). After ``fit`` it prints, on global rank 0, one report
built from the callbacks found on the trainer: the :class:`~lightning_memkit.callbacks.PeakMemoryMonitor`
summary, the latest ``SavedTensorProfiler`` table with the paths of its JSON/PNG files, and the training
loss of the first and the last optimizer step (as logged: not divided by ``accumulate_grad_batches``).

``validate``, ``test`` and ``predict`` run as in Lightning (``predict`` then prints what it predicted);
``memkit compare --config C ...`` is :func:`lightning_memkit.compare.main`; ``memkit estimate ...`` (the
predicted memory of a training step, nothing allocated) is :func:`lightning_memkit.estimate_cli.main`.

A bad configuration value (unknown key, wrong type, bad ``class_path``, or a ``ValueError``/``TypeError``
raised by a constructor) is a :class:`ConfigError`: ``memkit`` prints it on one or two lines, naming the
key and what is allowed, and exits with status 2; so do a ``--config`` file that is not YAML (one line
naming the file, line and column) and an unknown subcommand (one line listing them). ``--debug``
(anywhere on the command line) or the environment variable ``MEMKIT_DEBUG=1`` shows the full traceback
instead. Errors raised while training always show their traceback.

Usage::

    memkit fit --config examples/configs/tiny_lm.yaml
    memkit fit --config examples/configs/tiny_lm.yaml --trainer.max_steps 20 --model.n_layers 2
    memkit test --config examples/configs/tiny_lm.yaml --trainer.limit_test_batches 2
    memkit --help     # every subcommand, one line each
    memkit fit --help
"""

from __future__ import annotations

import importlib
import os
import re
import sys
import warnings
from argparse import ArgumentError
from collections.abc import Sequence
from typing import Any

import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.cli import ArgsType, LightningArgumentParser, LightningCLI

from lightning_memkit.callbacks.peak_memory_monitor import PeakMemoryMonitor
from lightning_memkit.validation import check_int

__all__ = [
    "ConfigError", "MemkitCLI", "LossTracker", "SUBCOMMANDS", "check_config_syntax", "describe_config_error",
    "describe_predictions", "describe_yaml_error", "memory_report", "main", "usage",
]

DEFAULT_MODEL = "lightning_memkit.demo.TinyLM"
DEFAULT_DATA = "lightning_memkit.demo.ByteTextDataModule"


class LossTracker(Callback):
    """Keeps the training loss of the first and the last optimizer step of a fit, as the logger shows it.

    The loss is the one ``training_step`` returned (``outputs["loss"]`` or a tensor output) on the batch that
    ended an optimizer step, before Lightning's division by ``accumulate_grad_batches``. ``steps`` counts the
    optimizer steps of the fit (``trainer.global_step``'s increase), ``micro_batches`` the training batches.
    """

    def __init__(self) -> None:
        self.first: float | None = None
        self.last: float | None = None
        self.steps = 0
        self.micro_batches = 0
        self.accumulate = 1
        self._global_step = 0

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:  # after a resume's restore
        self.first = self.last = None
        self.steps = self.micro_batches = 0
        self.accumulate = trainer.accumulate_grad_batches
        self._global_step = trainer.global_step

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.micro_batches += 1
        stepped = trainer.global_step - self._global_step
        self._global_step = trainer.global_step
        if stepped <= 0:
            return
        self.steps += stepped
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor) and loss.numel() == 1:
            value = _undivided(loss, self.accumulate if pl_module.automatic_optimization else 1)
            if self.first is None:
                self.first = value
            self.last = value

    def summary(self) -> str | None:
        """``train loss: first F -> last L over N optimizer steps`` (and the micro-batches under accumulation)."""
        if self.first is None:
            return None
        line = f"train loss: first {self.first:.4f} -> last {self.last:.4f} over {self.steps} optimizer steps"
        if self.accumulate > 1:
            line += f" ({self.micro_batches} micro-batches, accumulate_grad_batches={self.accumulate})"
        return line


def _undivided(loss: torch.Tensor, accumulate: int) -> float:
    """``loss`` times ``accumulate``, rounded back to its dtype: the value ``training_step`` returned (and logged)."""
    loss = loss.detach()
    return float(loss) if accumulate == 1 else float((loss.double() * accumulate).to(loss.dtype))


def _saved_tensor_profiler_type() -> type | None:
    """The ``SavedTensorProfiler`` class, or ``None`` where it cannot be imported."""
    try:
        from lightning_memkit.callbacks.saved_tensor_profiler import SavedTensorProfiler
    except Exception:  # an optional part of the report: never stop the CLI over it
        return None
    return SavedTensorProfiler


def memory_report(trainer: Trainer) -> list[Any]:
    """Renderables (rich tables and strings) describing the memory of the last fit of ``trainer``."""
    from lightning_memkit.report import memory_effects

    monitors = [cb for cb in trainer.callbacks if isinstance(cb, PeakMemoryMonitor)]
    profiler_type = _saved_tensor_profiler_type()
    profilers = [cb for cb in trainer.callbacks if profiler_type is not None and isinstance(cb, profiler_type)]
    parts: list[Any] = _static_table(trainer, monitors)
    parts += [monitor.table() for monitor in monitors]
    effects = memory_effects(trainer)  # now, after teardown: PhaseMemoryRelease has released by then
    if effects:
        parts.append("\n".join(effects))
    for profiler in profilers:
        parts += _profiler_report(profiler)
    if not monitors and not profilers:
        parts.append("No memkit memory callback ran: add PeakMemoryMonitor or SavedTensorProfiler to the callbacks.")
    parts += [line for cb in trainer.callbacks if isinstance(cb, LossTracker) and (line := cb.summary())]
    return parts


def _static_table(trainer: Trainer, monitors: list[PeakMemoryMonitor]) -> list[Any]:
    """The static byte table a monitor made at fit start, else one made now from the module (``[]`` if none)."""
    from lightning_memkit.memory.report import static_memory_table

    static = next((m.static_table for m in monitors if m.static_table is not None), None)
    if static is None and trainer.lightning_module is not None:
        static = static_memory_table(trainer.lightning_module, trainer.optimizers)
    return [] if static is None else [static.table()]


def _profiler_report(profiler: Any) -> list[str]:
    """A ``SavedTensorProfiler``'s latest table and the paths of the files it wrote."""
    report = getattr(profiler, "last_report", None)
    if report is None:
        return ["SavedTensorProfiler: no step was profiled."]
    parts = [str(report)]
    written = [str(p) for p in getattr(profiler, "written", [])]
    if written:
        parts.append("Saved-tensor report written to:\n" + "\n".join(f"  {p}" for p in written))
    return parts


def report_console() -> Any:
    """A ``rich`` console for reports: the terminal's width, or 120 columns in a log file or a pipe."""
    from rich.console import Console

    console = Console()
    return console if console.is_terminal else Console(width=120)


class ConfigError(ValueError):
    """A bad value in a ``memkit`` configuration; the message names the key and what is allowed.

    Example::

        >>> from lightning_memkit.cli import ConfigError, describe_config_error
        >>> try:
        ...     raise ValueError("TinyLM(n_layers=-1): must be an int >= 1")
        ... except ValueError as err:
        ...     print(describe_config_error(err, {"model": {"class_path": "lightning_memkit.demo.TinyLM"}}))
        model.init_args.n_layers: TinyLM(n_layers=-1): must be an int >= 1
        >>> issubclass(ConfigError, ValueError)
        True

    ``hint=False``: ``memkit`` prints the message alone, without the line pointing to ``--help``.
    """

    def __init__(self, message: str, *, hint: bool = True) -> None:
        super().__init__(message)
        self.hint = hint


# errors raised while building the objects of a configuration (not while running them)
_CONSTRUCTION_ERRORS = (ValueError, TypeError, ImportError, AttributeError, MisconfigurationException)
_PARSER_KEY = re.compile(r'Parser key "([^"]+)"')
_CLASS_PATH = re.compile(r"Problem with given class_path '([^']+)'")
_OWNER = re.compile(r"^(\w+)\((\w+)=")
_NOISE = re.compile(
    r"^\s*(- )?(Expected a <class 'NoneType'>|Given value|Subtypes:|Does not validate|Errors:|Not a valid subclass"
    r"|Subclass types expect|- a |Problem with given class_path|Parser key)"
)
_LEAF_SPEC_WARNING = r"`isinstance\(treespec, LeafSpec\)` is deprecated"


def _chain(err: BaseException) -> list[BaseException]:
    """``err`` and its causes, outermost first."""
    out: list[BaseException] = []
    while err is not None and all(err is not e for e in out):
        out.append(err)
        err = err.__cause__ or err.__context__
    return out


def _root_message(err: BaseException) -> str:
    """The meaningful lines of ``err`` on one line, jsonargparse's union bookkeeping dropped."""
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip() and not _NOISE.match(ln)]
    text = " ".join(lines) or type(err).__name__
    text = re.sub(r"Expected an? <class '([\w.]+)'>", r"expected \1", text)
    return re.sub(r"<class '([\w.]+)'>", r"\1", text)


def _init_args(class_path: str) -> list[str]:
    """Names of the ``__init__`` arguments of ``class_path`` (empty where it cannot be imported)."""
    import inspect

    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
        params = inspect.signature(cls.__init__).parameters.values()
    except Exception:  # noqa: BLE001 - only a hint in an error message
        return []
    return [p.name for p in params if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def _owner_key(config: Any, class_name: str, prefix: str = "") -> str | None:
    """Dotted path in ``config`` (nested dicts/lists) of the entry whose ``class_path`` names ``class_name``."""
    if isinstance(config, dict):
        path = config.get("class_path")
        if isinstance(path, str) and path.rpartition(".")[2] == class_name:
            return prefix
        items = config.items()
    elif isinstance(config, (list, tuple)):
        items = ((f"[{i}]", v) for i, v in enumerate(config))
    else:
        return None
    for k, v in items:
        key = f"{prefix}{k}" if str(k).startswith("[") else f"{prefix}.{k}" if prefix else str(k)
        found = _owner_key(v, class_name, key)
        if found is not None:
            return found
    return None


def describe_config_error(err: BaseException, config: Any = None) -> str:
    """One line naming the configuration key behind ``err`` and what went wrong (see :class:`ConfigError`).

    ``config``: the parsed configuration as nested dicts, to find the key of a class whose constructor raised.
    """
    chain = _chain(err)
    outer = str(chain[0])
    keys = list(dict.fromkeys(_PARSER_KEY.findall(outer)))
    root = _root_message(chain[-1])
    class_path = next((m.group(1) for e in chain if (m := _CLASS_PATH.search(str(e)))), None)
    if class_path and "is not accepted" in root:
        accepted = _init_args(class_path)
        root += f" by {class_path}" + (f"; accepted: {', '.join(accepted)}" if accepted else "")
    elif class_path and isinstance(chain[-1], (ImportError, AttributeError)):
        root = f"class_path {class_path!r} cannot be imported: {root}"
    key = ".".join(keys)
    owner = _OWNER.match(root)
    if not key and owner and config is not None:
        found = _owner_key(config, owner.group(1))
        key = f"{found}.init_args.{owner.group(2)}" if found else ""
    return f"{key}: {root}" if key else root


class MemkitCLI(LightningCLI):
    """``LightningCLI`` whose ``fit`` ends with :func:`memory_report` printed once, on global rank 0.

    So that the report is the one place the summary appears, ``PeakMemoryMonitor`` callbacks on the
    trainer are switched to ``verbose=False`` before ``fit``. One option is added to Lightning's:
    ``torch_num_threads`` (top level of the YAML, or ``--torch_num_threads``), applied with
    ``torch.set_num_threads`` for the run and restored afterwards.

    Configuration mistakes raise :class:`ConfigError` (a ``ValueError``) with a one-line message, from the
    parser (unknown key, wrong type, bad ``class_path``) or from a constructor. The ``config.yaml`` that
    Lightning saves next to the logs is overwritten by the next run in the same directory. ``predict``
    prints the kind and shape of what it predicted.

    Example::

        from lightning_memkit.cli import MemkitCLI

        MemkitCLI(args=["fit", "--config", "examples/configs/tiny_lm.yaml", "--trainer.max_steps", "5"])
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("subclass_mode_model", True)
        kwargs.setdefault("subclass_mode_data", True)
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        defaults = dict(kwargs.pop("trainer_defaults", None) or {})
        extra = defaults.get("callbacks", [])
        defaults["callbacks"] = [*(extra if isinstance(extra, list) else [extra]), LossTracker()]
        threads = torch.get_num_threads()
        try:
            with warnings.catch_warnings():  # Lightning's own pytree helper calls a deprecated torch class
                warnings.filterwarnings("ignore", message=_LEAF_SPEC_WARNING, category=FutureWarning)
                super().__init__(*args, trainer_defaults=defaults, **kwargs)
        finally:
            torch.set_num_threads(threads)  # `torch_num_threads` applies to this run only

    def init_parser(self, **kwargs: Any) -> LightningArgumentParser:
        kwargs.setdefault("exit_on_error", False)  # parse errors become a ConfigError (short), not usage + exit
        kwargs.setdefault("allow_abbrev", False)  # `--trainer.max_step` is a mistake, not `--trainer.max_steps`
        return super().init_parser(**kwargs)

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_argument(
            "--torch_num_threads", type=int | None, default=None,
            help="torch.set_num_threads for this run (default: leave PyTorch's choice). 1 is fastest on a CPU "
            "whose cores are busy with other work.",
        )
        parser.set_defaults({"model": {"class_path": DEFAULT_MODEL}, "data": {"class_path": DEFAULT_DATA}})

    def parse_arguments(self, parser: LightningArgumentParser, args: ArgsType) -> None:
        check_config_syntax(sys.argv[1:] if args is None else args)
        try:
            super().parse_arguments(parser, args)
        except ArgumentError as err:
            raise ConfigError(describe_config_error(err)) from err

    def _config_dict(self) -> Any:
        config = self.config.get(self.subcommand) if self.subcommand else self.config
        try:
            return config.as_dict()
        except Exception:  # noqa: BLE001 - only used to name a key in an error message
            return None

    def before_instantiate_classes(self) -> None:
        threads = self._get(self.config, "torch_num_threads")
        if threads is None:
            return
        try:
            threads = check_int(threads, "torch_num_threads", minimum=1, allow_none=True, owner="MemkitCLI")
        except ValueError as err:
            raise ConfigError(f"torch_num_threads: {err}") from err
        torch.set_num_threads(threads)

    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except ConfigError:
            raise
        except _CONSTRUCTION_ERRORS as err:
            raise ConfigError(describe_config_error(err, self._config_dict())) from err

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        try:
            return super().instantiate_trainer(**kwargs)
        except _CONSTRUCTION_ERRORS as err:
            raise ConfigError(f"trainer: {describe_config_error(err, self._config_dict())}") from err

    def before_fit(self) -> None:
        for cb in self.trainer.callbacks:
            if isinstance(cb, PeakMemoryMonitor):
                cb.verbose = False

    def after_fit(self) -> None:
        if not self.trainer.is_global_zero:
            return
        from rich.rule import Rule

        console = report_console()
        console.print(Rule("memkit memory report"))
        for part in memory_report(self.trainer):
            if isinstance(part, str):  # plain text (paths included) is printed as is, never wrapped
                console.print(part, markup=False, highlight=False, soft_wrap=True)
            else:
                console.print(part)

    def after_predict(self) -> None:
        if self.trainer.is_global_zero:
            print(describe_predictions(self.trainer.predict_loop.predictions))


def describe_predictions(predictions: Any) -> str:
    """One line on what ``trainer.predict`` returned: batch count, then dtype and shape of the first batch.

    Example::

        >>> import torch
        >>> from lightning_memkit.cli import describe_predictions
        >>> describe_predictions([torch.zeros(4, 8, dtype=torch.long), torch.zeros(2, 8, dtype=torch.long)])
        'predict: 2 batches, 6 samples; first batch: torch.int64 tensor of shape (4, 8)'
    """
    batches = list(predictions or [])
    if batches and isinstance(batches[0], list):  # several predict dataloaders: one list per loader
        batches = [b for loader in batches for b in loader]
    if not batches:
        return "predict: no batch predicted"
    first = batches[0]
    if not all(isinstance(b, torch.Tensor) for b in batches):
        return f"predict: {len(batches)} batches; first batch: {type(first).__name__}"
    samples = sum(b.shape[0] if b.dim() else 1 for b in batches)
    return (f"predict: {len(batches)} batches, {samples} samples; first batch: {first.dtype} tensor of shape "
            f"{tuple(first.shape)}")


def check_config_syntax(args: Any) -> None:
    """Refuse a ``--config``/``-c`` file of the command line ``args`` that is not YAML: a one-line
    :class:`ConfigError` naming the file, line and column (the parser's own message names ``"<unicode string>"``).
    Anything but a list of strings, and config values that are not files, are left to the parser."""
    if not isinstance(args, (list, tuple)):
        return
    args = [str(a) for a in args]
    given = [value for flag, value in zip(args, args[1:], strict=False) if flag in ("--config", "-c")]
    given += [a.partition("=")[2] for a in args if a.startswith("--config=")]
    for path in (p for p in given if os.path.isfile(p)):
        _check_yaml_file(path)


def _check_yaml_file(path: str) -> None:
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError):  # the parser's error names the file
        return
    try:
        yaml.compose(text, Loader=yaml.SafeLoader)  # syntax only: nothing constructed
    except yaml.MarkedYAMLError as err:
        raise ConfigError(describe_yaml_error(path, err), hint=False) from err


def describe_yaml_error(path: str, err: Any) -> str:
    """One line for a ``yaml.MarkedYAMLError`` of the file ``path``: file, line, column, problem and context.

    Example::

        >>> import yaml
        >>> from lightning_memkit.cli import describe_yaml_error
        >>> try:
        ...     yaml.safe_load("a: [1, 2")
        ... except yaml.MarkedYAMLError as err:
        ...     print(describe_yaml_error("b.yaml", err))
        --config b.yaml: invalid YAML at line 1, column 9: ... (while parsing a flow sequence at line 1, column 4)
    """
    if err.problem:
        what = err.problem + (f" ({err.context}{_at(err.context_mark)})" if err.context else "")
        where = _at(err.problem_mark or err.context_mark)
    else:
        what, where = str(err.context), _at(err.context_mark)
    return f"--config {path}: invalid YAML{where}: {' '.join(what.split())}"


def _at(mark: Any) -> str:
    """`` at line L, column C`` (1-based) of a yaml ``Mark``; empty for ``None``."""
    return "" if mark is None else f" at line {mark.line + 1}, column {mark.column + 1}"


def parse_subcommand(parser: Any, argv: Sequence[str] | None) -> tuple[Any, list[str]]:
    """``(args, overrides)`` of a ``memkit`` subcommand's ``argparse`` parser: ``-h``/``--help`` prints its help
    and exits; a parse error is a :class:`ConfigError`; unknown ``--key value`` pairs are returned as overrides."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        parser.print_help()
        raise SystemExit(0)
    try:
        return parser.parse_known_args(argv)
    except ArgumentError as err:
        raise ConfigError(str(err)) from err

def _debug_requested(argv: list[str]) -> bool:
    return "--debug" in argv or os.environ.get("MEMKIT_DEBUG", "").strip().lower() not in ("", "0", "false", "no")


SUBCOMMANDS = {
    "fit": "train, then print the memory report (step peaks, saved tensors, first and last loss)",
    "validate": "one evaluation epoch over the validation set",
    "test": "one evaluation epoch over the test set",
    "predict": "run inference and print the kind and shape of what was predicted",
    "compare": "train a config without and with its memkit memory features: peak bytes per phase",
    "estimate": "predict the device memory of a training step, nothing allocated",
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

    ``memkit compare ...`` goes to :func:`lightning_memkit.compare.main`, ``memkit estimate ...`` to
    :func:`lightning_memkit.estimate_cli.main`, the other :data:`SUBCOMMANDS` to :class:`MemkitCLI`; ``memkit``
    alone (on stderr, exit 2) and ``memkit --help`` print :func:`usage`, an unknown subcommand is an error.
    A :class:`ConfigError` prints ``memkit: error: ...`` on stderr and exits with status 2, unless ``--debug``
    is given (removed before parsing) or ``MEMKIT_DEBUG=1`` is set: then it propagates with its traceback.
    """
    from_sys = args is None
    argv = [str(a) for a in (sys.argv[1:] if from_sys else args)]
    debug = _debug_requested(argv)
    if "--debug" in argv:
        argv = [a for a in argv if a != "--debug"]
        if from_sys:  # processes that Lightning launches re-run sys.argv: they learn of --debug from the env
            sys.argv[1:] = argv
            os.environ["MEMKIT_DEBUG"] = "1"
    try:
        _check_subcommand(argv)
        _run_subcommand(argv, from_sys)
    except ConfigError as err:
        if debug:
            raise
        command = f"memkit {argv[0]}" if argv and argv[0] in SUBCOMMANDS else "memkit"
        print(f"{command}: error: {err}", file=sys.stderr)
        if getattr(err, "hint", True):
            print(f"  see `{command} --help` for the accepted options; add --debug for the full traceback",
                  file=sys.stderr)
        raise SystemExit(2) from None


def _run_subcommand(argv: list[str], from_sys: bool) -> None:
    if argv[0] == "compare":
        from lightning_memkit.compare import main as compare_main

        compare_main(argv[1:])
    elif argv[0] == "estimate":
        from lightning_memkit.estimate_cli import main as estimate_main

        estimate_main(argv[1:])
    else:
        MemkitCLI(args=None if from_sys else argv)


if __name__ == "__main__":
    main()
