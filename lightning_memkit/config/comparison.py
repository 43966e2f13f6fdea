"""``memkit compare``: the same config trained twice, with and without memkit's memory features, per phase.

:func:`compare` runs a LightningCLI configuration for a few optimizer steps twice in this process: once
as given (**memkit**) and once with memkit's memory features removed (**baseline**): every
``lightning_memkit`` callback, every ``lightning_memkit`` plugin (the precision plugin: the baseline then
trains at ``trainer.precision``), and ``memkit_pipeline`` replaced by Lightning's default strategy. The
measuring callbacks (``PeakMemoryMonitor``, ``SavedTensorProfiler``) are removed from both runs, and
validation, checkpointing and logging are turned off in both, so that the two runs differ only by the
features. Features that live in the model's own code or init arguments (a fused loss option, calls to
``stage_boundary``) stay in both runs.

Each run is measured from before the model is built to after ``fit`` returns, by one
:class:`~lightning_memkit.memory.LivePeak` (exact bytes of storage created by the run, on every
device), with the high-water mark restarted at each phase boundary:

- **setup/load**: building the model, trainer and data, then ``fit`` up to the first batch (weights,
  strategy and precision set-up, checkpoint or MXFP4 loads, ``configure_optimizers``); the model's parameters
  and buffers count from the moment it is built, also those no op allocated (a safetensors checkpoint
  memory-mapped in the dtype it is loaded in);
- **forward+backward**: from each batch's start to ``on_before_optimizer_step`` (the largest over steps);
- **optimizer step**: from there to the batch's end (optimizer state is created at the first step);
- **between phases**: the bytes still alive after ``fit`` has returned, which the next phase (``test``,
  another fold) starts with.

On CUDA each phase also reports ``torch.cuda.max_memory_allocated`` over the same span (allocator
view, workspaces included). Configs that need several processes (``devices`` x ``num_nodes`` > 1) are
refused: both runs happen in this one process.

Example (from a checkout: the config is one of the shipped examples)::

    >>> import tempfile
    >>> from lightning_memkit.config.comparison import compare
    >>> small = ["--model.d_model", "32", "--model.n_layers", "2", "--data.batch_size", "4"]
    >>> result = compare("examples/configs/tiny_lm.yaml", steps=2, out_dir=tempfile.mkdtemp(), overrides=small)
    memkit compare: baseline run (2 steps) ...
    memkit compare: memkit run (2 steps) ...
    >>> result.features
    ['ActivationCheckpointing', 'PhaseMemoryRelease']
    >>> [row.phase for row in result.rows]
    ['setup/load', 'forward+backward', 'optimizer step', 'between phases', 'whole run']
    >>> result.rows[1].memkit_bytes < result.rows[1].baseline_bytes  # forward+backward, with recompute
    True
"""

from __future__ import annotations

import copy
import gc
import json
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from lightning_memkit.common.validation import check_int
from lightning_memkit.config.errors import class_name
from lightning_memkit.config.lightning_cli import parse_config, quiet

__all__ = ["Comparison", "PhaseRow", "RunResult", "compare", "split_features"]

PHASES = ("setup/load", "forward+backward", "optimizer step", "between phases")
MEASURING = {"PeakMemoryMonitor", "SavedTensorProfiler"}
_PIPELINE_NAMES = {"memkit_pipeline"}
_QUIET_TRAINER = {
    "enable_checkpointing": False, "logger": False, "enable_progress_bar": False, "enable_model_summary": False,
    "num_sanity_val_steps": 0, "limit_val_batches": 0, "val_check_interval": None, "check_val_every_n_epoch": None,
}


@dataclass
class PhaseRow:
    """One phase: peak bytes of both runs (``LivePeak``; ``*_cuda`` from ``max_memory_allocated`` on CUDA)."""

    phase: str
    baseline_bytes: int
    memkit_bytes: int
    baseline_cuda: int | None = None
    memkit_cuda: int | None = None

    @property
    def saved_bytes(self) -> int:
        return self.baseline_bytes - self.memkit_bytes

    @property
    def ratio(self) -> float | None:
        return self.memkit_bytes / self.baseline_bytes if self.baseline_bytes else None


@dataclass
class RunResult:
    """What one run measured: peak bytes per phase, its time, its losses and (memkit run) the feature lines."""

    peaks: dict[str, int]
    cuda_peaks: dict[str, int] | None
    seconds: float
    steps: int
    loss_first: float | None
    loss_last: float | None
    effects: list[str] = field(default_factory=list)


@dataclass
class Comparison:
    """The result of :func:`compare`: one :class:`PhaseRow` per phase plus a ``whole run`` row."""

    config: str
    device: str
    steps: int
    features: list[str]
    rows: list[PhaseRow]
    baseline: RunResult
    memkit: RunResult
    written: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        rows = [{**asdict(r), "saved_bytes": r.saved_bytes, "ratio": r.ratio} for r in self.rows]
        return {"config": self.config, "device": self.device, "steps": self.steps, "features": self.features,
                "measured_with": "LivePeak" + (" and torch.cuda.max_memory_allocated" if self._cuda else ""),
                "phases": rows, "baseline": asdict(self.baseline), "memkit": asdict(self.memkit)}

    @property
    def _cuda(self) -> bool:
        return self.baseline.cuda_peaks is not None

    def table(self):
        """A ``rich`` table: per phase, both peaks, the bytes saved and the ratio."""
        from rich.table import Table

        table = Table(title=f"memkit compare: {Path(self.config).name}, {self.steps} steps on {self.device}",
                      caption=f"features: {', '.join(self.features)}",
                      title_justify="left", caption_justify="left")
        table.add_column("phase", no_wrap=True)
        table.add_column("baseline (B)", justify="right", no_wrap=True)
        table.add_column("memkit (B)", justify="right", no_wrap=True)
        table.add_column("saved (B)", justify="right", no_wrap=True)
        table.add_column("ratio", justify="right", no_wrap=True)
        if self._cuda:
            table.add_column("cuda baseline (B)", justify="right", no_wrap=True)
            table.add_column("cuda memkit (B)", justify="right", no_wrap=True)
        for r in self.rows:
            cells = [r.phase, f"{r.baseline_bytes:,}", f"{r.memkit_bytes:,}", f"{r.saved_bytes:,}",
                     "-" if r.ratio is None else f"{r.ratio:.3f}x"]
            if self._cuda:
                cells += [f"{r.baseline_cuda:,}", f"{r.memkit_cuda:,}"]
            table.add_row(*cells)
        return table

    def summary(self) -> str:
        """Lines under the table: time and loss of each run, then what each feature did."""
        lines = []
        for name, run in (("baseline", self.baseline), ("memkit", self.memkit)):
            loss = ("" if run.loss_first is None
                    else f", train loss {run.loss_first:.4f} -> {run.loss_last:.4f}")
            lines.append(f"{name}: {run.steps} steps in {run.seconds:.2f} s{loss}")
        if self.baseline.seconds > 0:
            lines.append(f"memkit time / baseline time: {self.memkit.seconds / self.baseline.seconds:.2f}x "
                         "(both runs measured by LivePeak, which slows every op alike)")
        lines += self.memkit.effects
        lines += [f"written: {p}" for p in self.written]
        return "\n".join(lines)

    def __str__(self) -> str:
        from lightning_memkit.measure.report import render_text

        return render_text(self.table()).rstrip() + "\n" + self.summary()

    def plot(self, path: str | Path) -> Path:
        """A grouped bar chart of both peaks per phase (MiB), the ratio above each pair; returns ``path``."""
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt

        path = Path(path)
        fig, ax = plt.subplots(figsize=(8, 4.2))
        xs = range(len(self.rows))
        mib = 2 ** 20
        ax.bar([x - 0.2 for x in xs], [r.baseline_bytes / mib for r in self.rows], 0.4, label="baseline")
        ax.bar([x + 0.2 for x in xs], [r.memkit_bytes / mib for r in self.rows], 0.4, label="memkit")
        for x, r in zip(xs, self.rows, strict=True):
            if r.ratio is not None:
                top = max(r.baseline_bytes, r.memkit_bytes) / mib
                ax.annotate(f"{r.ratio:.2f}x", (x, top), ha="center", va="bottom", fontsize=9)
        ax.set_xticks(list(xs), [r.phase for r in self.rows])
        ax.set_ylabel(f"peak MiB on {self.device} (LivePeak)")
        ax.set_title(f"{Path(self.config).name}: {', '.join(self.features) or 'no feature'}", fontsize=10)
        ax.legend()
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return path




def _is_memkit(entry: Any) -> bool:
    path = entry.get("class_path") if isinstance(entry, dict) else entry
    return isinstance(path, str) and (path.startswith("lightning_memkit.") or path in _PIPELINE_NAMES)


def _as_list(value: Any) -> list[Any]:
    return [] if value is None else list(value) if isinstance(value, (list, tuple)) else [value]


def split_features(config: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """``(memkit_config, baseline_config, feature_names)`` from a parsed config (nested dicts, not mutated).

    Both copies lose the measuring callbacks; the baseline also loses every other ``lightning_memkit``
    callback and plugin, and a memkit strategy becomes ``"auto"``.

    Example::

        >>> cfg = {"trainer": {"strategy": "memkit_pipeline", "callbacks": [
        ...     {"class_path": "lightning_memkit.callbacks.PeakMemoryMonitor"},
        ...     {"class_path": "lightning_memkit.callbacks.PhaseMemoryRelease"},
        ...     {"class_path": "lightning.pytorch.callbacks.LearningRateMonitor"}]}}
        >>> mk, base, names = split_features(cfg)
        >>> names, base["trainer"]["strategy"], [class_name(c) for c in base["trainer"]["callbacks"]]
        (['PhaseMemoryRelease', 'memkit_pipeline'], 'auto', ['LearningRateMonitor'])
        >>> [class_name(c) for c in mk["trainer"]["callbacks"]]
        ['PhaseMemoryRelease', 'LearningRateMonitor']
    """
    memkit = copy.deepcopy(config)
    trainer = memkit.setdefault("trainer", {})
    callbacks = [c for c in _as_list(trainer.get("callbacks")) if class_name(c) not in MEASURING]
    trainer["callbacks"] = callbacks
    features = [class_name(c) for c in callbacks if _is_memkit(c)]
    plugins = _as_list(trainer.get("plugins"))
    features += [class_name(p) for p in plugins if _is_memkit(p)]
    strategy = trainer.get("strategy")
    if _is_memkit(strategy):
        features.append(class_name(strategy))
    baseline = copy.deepcopy(memkit)
    base_trainer = baseline["trainer"]
    base_trainer["callbacks"] = [c for c in callbacks if not _is_memkit(c)]
    base_trainer["plugins"] = [p for p in plugins if not _is_memkit(p)] or None
    if _is_memkit(strategy):
        base_trainer["strategy"] = "auto"
    return memkit, baseline, [f for f in features if f]


class _PhaseMeter:
    """Restarts the tracker's high-water mark at each phase boundary and keeps each phase's peak."""

    def __init__(self, tracker: Any, device: torch.device):
        self.tracker = tracker
        self.device = device
        self.cuda = device.type == "cuda"
        self.peaks = dict.fromkeys(PHASES, 0)
        self.cuda_peaks = dict.fromkeys(PHASES, 0) if self.cuda else None
        self.phase = PHASES[0]

    def _device_bytes(self, attr: str) -> int:
        d = self.tracker.by_device.get(str(self.device))
        return 0 if d is None else getattr(d, attr)

    def boundary(self, next_phase: str | None) -> None:
        """Close the current phase (keep the larger of its peaks) and start ``next_phase``."""
        self.peaks[self.phase] = max(self.peaks[self.phase], self._device_bytes("peak"))
        if self.cuda:
            index = self.device.index or 0
            self.cuda_peaks[self.phase] = max(self.cuda_peaks[self.phase], torch.cuda.max_memory_allocated(index))
            torch.cuda.reset_peak_memory_stats(index)
        self.tracker.reset_peak()
        if next_phase is not None:
            self.phase = next_phase

    def finish(self) -> None:
        """After ``fit``: close the last phase and record what is still alive as ``between phases``."""
        self.boundary(None)
        self.peaks["between phases"] = self._device_bytes("live")
        if self.cuda:
            self.cuda_peaks["between phases"] = torch.cuda.memory_allocated(self.device.index or 0)


def _meter_callback(meter: _PhaseMeter) -> Any:
    from lightning.pytorch.callbacks import Callback

    class PhaseMeter(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            meter.boundary("forward+backward")

        def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
            meter.boundary("optimizer step")

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            meter.boundary("forward+backward")

    return PhaseMeter()


def _run(config: dict[str, Any], path: Path, label: str) -> RunResult:
    """Train ``config`` (written to ``path``) and measure it; the CLI objects are dropped before returning."""
    from lightning_memkit.config.errors import ConfigError
    from lightning_memkit.config.lightning_cli import LossTracker, MemkitCLI
    from lightning_memkit.measure.live_peak import LivePeak
    from lightning_memkit.measure.report import memory_effects

    path.write_text(json.dumps(config))  # JSON is YAML: LightningCLI reads it as a config file
    threads = torch.get_num_threads()
    gc.collect()
    with quiet(), LivePeak() as tracker:
        cli = MemkitCLI(args=["--config", str(path)], run=False)
        # weights made outside the ops LivePeak sees (a safetensors checkpoint memory-mapped in its own dtype)
        tracker.track([*cli.model.parameters(), *cli.model.buffers()])
        trainer = cli.trainer
        if trainer.world_size > 1:
            raise ConfigError(
                f"trainer: {label} run needs {trainer.world_size} processes (devices x num_nodes); memkit compare "
                "runs both runs in one process: set --trainer.devices 1"
            )
        meter = _PhaseMeter(tracker, trainer.strategy.root_device)
        trainer.callbacks.append(_meter_callback(meter))
        if config.get("torch_num_threads"):
            torch.set_num_threads(int(config["torch_num_threads"]))
        start = time.perf_counter()
        try:
            trainer.fit(cli.model, datamodule=cli.datamodule)
        finally:
            torch.set_num_threads(threads)
        seconds = time.perf_counter() - start
        meter.finish()
        effects = memory_effects(trainer) if label == "memkit" else []
        tracker_cb = next((cb for cb in trainer.callbacks if isinstance(cb, LossTracker)), None)
        result = RunResult(
            peaks=meter.peaks, cuda_peaks=meter.cuda_peaks, seconds=seconds, steps=trainer.global_step,
            loss_first=getattr(tracker_cb, "first", None), loss_last=getattr(tracker_cb, "last", None),
            effects=effects,
        )
        del cli, trainer, meter, tracker_cb
    gc.collect()
    return result






def compare(
    config: str | Path, steps: int = 5, out_dir: str | Path | None = None, overrides: Sequence[str] = ()
) -> Comparison:
    """Train ``config`` for ``steps`` optimizer steps without and with its memkit features; see the module doc.

    Args:
        config: a ``memkit``/LightningCLI YAML file.
        steps: optimizer steps per run (``trainer.max_steps``), at least 2 so that the optimizer state exists.
        out_dir: where ``compare.json`` and ``compare.png`` go (default ``runs/compare/<config stem>``).
        overrides: extra command-line arguments for the config, e.g. ``["--model.n_layers", "2"]``.

    Raises:
        ConfigError: a missing config file, bad ``steps``, a config with no memkit memory feature, a bad
            value in the config, or a config that needs several processes.
    """
    from lightning_memkit.config.errors import ConfigError

    config = Path(config)
    if not config.is_file():
        raise ConfigError(f"--config: no such file: {config}")
    try:
        steps = check_int(steps, "steps", minimum=2, owner="compare")
    except ValueError as err:
        raise ConfigError(f"--steps: {err}") from err
    overrides = [str(a) for a in overrides]
    parsed = parse_config(config, overrides)
    memkit_cfg, baseline_cfg, features = split_features(parsed)
    if not features:
        raise ConfigError(
            f"--config: {config} turns on no memkit memory feature (a lightning_memkit callback other than "
            f"{' or '.join(sorted(MEASURING))}, a lightning_memkit plugin, or memkit_pipeline): nothing to compare"
        )
    _check_one_process(memkit_cfg["trainer"])
    out = Path(out_dir) if out_dir is not None else Path("runs") / "compare" / config.stem
    for cfg in (memkit_cfg, baseline_cfg):
        cfg["trainer"].update(_QUIET_TRAINER, max_steps=steps, max_epochs=-1, default_root_dir=str(out))
        cfg["trainer"]["max_time"] = None
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label, cfg in (("baseline", baseline_cfg), ("memkit", memkit_cfg)):
            print(f"memkit compare: {label} run ({steps} steps) ...", flush=True)
            runs[label] = _run(cfg, Path(tmp) / f"{label}.json", label)
    device = _device_name(memkit_cfg)
    rows = [_row(phase, runs) for phase in PHASES]
    rows.append(_whole_run(rows[:3], runs))
    result = Comparison(config=str(config), device=device, steps=steps, features=features, rows=rows,
                        baseline=runs["baseline"], memkit=runs["memkit"])
    out.mkdir(parents=True, exist_ok=True)
    result.written = [str(out / "compare.json"), str(out / "compare.png")]
    (out / "compare.json").write_text(json.dumps(result.to_dict(), indent=2) + "\n")
    result.plot(out / "compare.png")
    return result


def _check_one_process(trainer: dict[str, Any]) -> None:
    """Refuse, before anything runs, a config whose ``devices`` x ``num_nodes`` asks for several processes."""
    from lightning_memkit.config.errors import ConfigError

    devices, nodes = trainer.get("devices", "auto"), trainer.get("num_nodes") or 1
    count = len(devices) if isinstance(devices, (list, tuple)) else devices
    if isinstance(count, str) and "," in count:
        count = len([d for d in count.split(",") if d.strip()])
    elif isinstance(count, str) and count.strip().lstrip("-").isdigit():
        count = int(count)
    if (isinstance(count, int) and count * nodes > 1) or nodes > 1:
        raise ConfigError(
            f"trainer.devices: {devices!r} x num_nodes {nodes} needs several processes; memkit compare runs both "
            "runs in this one process: add --trainer.devices 1"
        )


def _device_name(config: dict[str, Any]) -> str:
    accelerator = str(config.get("trainer", {}).get("accelerator") or "auto")
    if accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available()):
        return "cuda"
    return accelerator if accelerator != "auto" else "cpu"


def _row(phase: str, runs: dict[str, RunResult]) -> PhaseRow:
    base, mk = runs["baseline"], runs["memkit"]
    return PhaseRow(
        phase, base.peaks[phase], mk.peaks[phase],
        None if base.cuda_peaks is None else base.cuda_peaks[phase],
        None if mk.cuda_peaks is None else mk.cuda_peaks[phase],
    )


def _whole_run(rows: list[PhaseRow], runs: dict[str, RunResult]) -> PhaseRow:
    cuda = runs["baseline"].cuda_peaks is not None
    return PhaseRow(
        "whole run", max(r.baseline_bytes for r in rows), max(r.memkit_bytes for r in rows),
        max(r.baseline_cuda for r in rows) if cuda else None, max(r.memkit_cuda for r in rows) if cuda else None,
    )




