"""``MemkitCLI``: Lightning's CLI with a memory report at the end of ``fit``, and configs read as a library.

``MemkitCLI`` is :class:`lightning.pytorch.cli.LightningCLI` with any LightningModule / LightningDataModule
selectable by ``class_path`` (default: :class:`~lightning_memkit.demo.TinyLM` on
:class:`~lightning_memkit.demo.ByteTextDataModule`). After ``fit`` it prints, on global rank 0, one report
built from the callbacks found on the trainer: the :class:`~lightning_memkit.callbacks.PeakMemoryMonitor`
summary, the latest ``SavedTensorProfiler`` table with the paths of its JSON/PNG files, and the training
loss of the first and the last optimizer step (as logged: not divided by ``accumulate_grad_batches``).
:func:`parse_config` reads a config (and ``--key value`` overrides) into plain dicts without running it,
and :func:`instantiate` builds one of its ``class_path`` entries.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import warnings
from argparse import ArgumentError
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.cli import ArgsType, LightningArgumentParser, LightningCLI

from lightning_memkit.callbacks.memory_budget import MemoryBudget
from lightning_memkit.callbacks.peak_memory_monitor import PeakMemoryMonitor
from lightning_memkit.common.class_paths import instantiate
from lightning_memkit.common.step_output import training_loss
from lightning_memkit.common.validation import check_int
from lightning_memkit.config.errors import (
    CONSTRUCTION_ERRORS,
    LEAF_SPEC_WARNING,
    ConfigError,
    check_config_syntax,
    describe_config_error,
    trainer_entries,
)
from lightning_memkit.measure.report import report_console

__all__ = ["DEFAULT_DATA", "DEFAULT_MODEL", "LossTracker", "MemkitCLI", "describe_predictions", "instantiate",
           "memory_report", "parse_config", "quiet"]


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
        loss = training_loss(outputs)
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
    from lightning_memkit.measure.report import memory_effects

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
    from lightning_memkit.measure.report import static_memory_table

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


def _chosen_subcommand(args: Any, run: bool) -> str | None:
    """The subcommand that ``args`` (``None``: the command line) start with, if a run with subcommands is asked for
    and they start with one of Lightning's."""
    if not run:
        return None
    argv = sys.argv[1:] if args is None else args
    if isinstance(argv, (list, tuple)) and argv and argv[0] in LightningCLI.subcommands():
        return argv[0]
    return None


class MemkitCLI(LightningCLI):
    """``LightningCLI`` whose ``fit`` ends with :func:`memory_report` printed once, on global rank 0.

    So that the report is the one place the summary appears, ``PeakMemoryMonitor`` callbacks on the
    trainer are switched to ``verbose=False`` before ``fit``. One option is added to Lightning's:
    ``torch_num_threads`` (top level of the YAML, or ``--torch_num_threads``), applied with
    ``torch.set_num_threads`` for the run and restored afterwards.

    Configuration mistakes raise :class:`ConfigError` (a ``ValueError``) with a one-line message, from the
    parser (unknown key, wrong type, bad ``class_path``) or from a constructor. The ``config.yaml`` that
    Lightning saves next to the logs is overwritten by the next run in the same directory. ``predict``
    prints the kind and shape of what it predicted. Where the arguments start with a subcommand, only that
    subcommand's parser is built (:meth:`subcommands`).

    Example::

        from lightning_memkit.config.lightning_cli import MemkitCLI

        MemkitCLI(args=["fit", "--config", "examples/configs/tiny_lm.yaml", "--trainer.max_steps", "5"])
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._chosen = _chosen_subcommand(kwargs.get("args"), kwargs.get("run", True)) if not args else None
        kwargs.setdefault("subclass_mode_model", True)
        kwargs.setdefault("subclass_mode_data", True)
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        defaults = dict(kwargs.pop("trainer_defaults", None) or {})
        extra = defaults.get("callbacks", [])
        defaults["callbacks"] = [*(extra if isinstance(extra, list) else [extra]), LossTracker()]
        threads = torch.get_num_threads()
        try:
            with warnings.catch_warnings():  # Lightning's own pytree helper calls a deprecated torch class
                warnings.filterwarnings("ignore", message=LEAF_SPEC_WARNING, category=FutureWarning)
                super().__init__(*args, trainer_defaults=defaults, **kwargs)
        finally:
            torch.set_num_threads(threads)  # `torch_num_threads` applies to this run only

    def subcommands(self) -> dict[str, set[str]]:  # type: ignore[override]  # a staticmethod in LightningCLI
        """Lightning's subcommands; only the one the arguments name where they name one (``fit ...``): building the
        parser of each of the others would take half of the start-up, for a parser that is never used."""
        every = LightningCLI.subcommands()
        return {self._chosen: every[self._chosen]} if self._chosen in every else every

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
        parser.add_argument(
            "--budget", type=str | None, default=None,
            help="memkit fit only: fit the run into this much device memory, adding a MemoryBudget callback "
            "(24GiB, 80GB, bytes, or a fraction of the device's memory such as 0.9); refused when the config has a "
            "MemoryBudget already.",
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
        if self._get(self.config, "budget") is not None:  # `memkit fit --budget` became a callback before parsing
            raise ConfigError("budget: only `memkit fit --budget SIZE` takes a budget (it adds a MemoryBudget to the "
                              "callbacks); in a config, list lightning_memkit.callbacks.MemoryBudget under "
                              "trainer.callbacks", hint=False)
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
        except CONSTRUCTION_ERRORS as err:
            raise ConfigError(describe_config_error(err, self._config_dict())) from err

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        _one_budget(self._config_dict())
        try:
            return super().instantiate_trainer(**kwargs)
        except CONSTRUCTION_ERRORS as err:
            raise ConfigError(f"trainer: {describe_config_error(err, self._config_dict())}") from err

    def before_fit(self) -> None:
        from lightning_memkit.common.preflight import run_preflights

        try:  # the callbacks' refusals (ExportAdapters on a model without adapters) before any data or planning
            run_preflights(self.trainer, self.model)
        except ValueError as err:
            raise ConfigError(str(err), hint=False) from err
        arguments = self.config_init[self.subcommand] if self.subcommand else self.config_init
        if arguments.get("ckpt_path") == "last":  # the newest of the run's versions, or one line: never step 0
            from lightning_memkit.config.resume import last_checkpoint

            arguments["ckpt_path"] = str(last_checkpoint(self.trainer))
        for cb in self.trainer.callbacks:
            if isinstance(cb, PeakMemoryMonitor):
                cb.verbose = False
            if isinstance(cb, MemoryBudget) and arguments.get("ckpt_path"):  # the checkpoint's plan: one estimate
                cb.resume_from = str(arguments["ckpt_path"])

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
        >>> from lightning_memkit.config.lightning_cli import describe_predictions
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


def _one_budget(config: Any) -> None:
    """Refuse a second ``MemoryBudget`` (``--budget`` on a config that lists one): two budgets would both plan."""
    budgets = [(i, (c.get("init_args") or {}).get("budget")) for i, c in trainer_entries(config, "callbacks")
               if c["class_path"].rpartition(".")[2] == "MemoryBudget"]
    if len(budgets) > 1:
        where = ", ".join(f"{budget!r} at trainer.callbacks[{i}]" for i, budget in budgets)
        raise ConfigError(f"trainer.callbacks: {len(budgets)} MemoryBudget callbacks ({where}; `--budget` adds one "
                          "to the config's): give one budget", hint=False)


def parse_config(config: Path, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """The whole configuration (``config`` plus ``overrides``: ``["--key", "value", ...]``) as nested dicts, as
    ``memkit fit`` would parse it (validated, defaults filled, class paths in full); nothing is instantiated."""
    import yaml

    from lightning_memkit.config.lightning_cli import MemkitCLI

    class _ParseOnly(MemkitCLI):
        def instantiate_classes(self) -> None:  # parse and validate; build nothing
            pass

    with quiet():
        cli = _ParseOnly(args=["--config", str(config), *overrides], run=False)
    return yaml.safe_load(cli.parser.dump(cli.config, skip_none=False))


_KNOWN_NOISE = (
    r"LightningCLI's args parameter is intended",  # a caller passes its own args; sys.argv holds memkit's
    r"`isinstance\(treespec, LeafSpec\)` is deprecated",
)


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Lightning's start-up notices and known third-party deprecation warnings stay out of the comparison."""
    loggers = [logging.getLogger(name) for name in ("lightning.pytorch", "lightning.fabric")]
    levels = [lg.level for lg in loggers]
    with warnings.catch_warnings():
        for message in _KNOWN_NOISE:
            warnings.filterwarnings("ignore", message=message)
        for lg in loggers:
            lg.setLevel(logging.WARNING)
        try:
            yield
        finally:
            for lg, level in zip(loggers, levels, strict=True):
                lg.setLevel(level)
