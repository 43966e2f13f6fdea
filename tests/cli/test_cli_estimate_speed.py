"""memkit estimate --hf-config: composed by default (--full-trace traces every layer), and no Lightning imported."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from lightning_memkit.cli.main import main
from lightning_memkit.config.errors import ConfigError
from lightning_memkit.demo.hf_models import tiny_hf_config

HEAVY = """
import sys
heavy = sorted(m for m in sys.modules if m == "lightning" or m.startswith(("lightning.", "pytorch_lightning")))
"""


IMPORTS = """
import lightning_memkit.cli.main, lightning_memkit.cli.estimate
import lightning_memkit.estimate.hf, lightning_memkit.estimate.compose, lightning_memkit.estimate.plans
from lightning_memkit.config.errors import ConfigError
"""


def _run(body: str) -> str:
    """The Lightning modules imported after running ``body`` in a fresh interpreter."""
    code = textwrap.dedent(body) + HEAVY + "print(heavy)\n"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()[-1]


@pytest.fixture(scope="module")
def command(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[str], subprocess.CompletedProcess, str]:
    """One fresh interpreter (its start-up and imports paid once): the estimate command's and the library's imports,
    the Lightning modules they imported (on stderr), then ``memkit estimate`` of a 2-layer Llama as the
    ``python -m lightning_memkit.cli`` command runs it. Its arguments, the process, and that import line."""
    path = tmp_path_factory.mktemp("command") / "config.json"
    path.write_text(tiny_hf_config("llama", num_layers=2).to_json_string())
    args = ["estimate", "--hf-config", str(path), "--seq-len", "16", "--json"]
    code = IMPORTS + HEAVY + f"""
print("imported:", heavy, file=sys.stderr, flush=True)
import runpy
sys.argv = ["memkit", *{args!r}]
runpy.run_module("lightning_memkit.cli", run_name="__main__", alter_sys=True)  # as `python -m lightning_memkit.cli`
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    imported = next((line for line in proc.stderr.splitlines() if line.startswith("imported: ")), "")
    return args, proc, imported.removeprefix("imported: ")


def test_the_estimate_command_and_library_import_no_lightning(command) -> None:
    assert command[2] == "[]", command[1].stderr


@pytest.mark.slow
def test_an_hf_config_estimate_runs_without_lightning(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(tiny_hf_config("llama", num_layers=20).to_json_string())
    assert _run(f"""
        from lightning_memkit.cli.main import main
        main(["estimate", "--hf-config", {str(path)!r}, "--seq-len", "16", "--json"])
    """) == "[]"


@pytest.mark.slow  # composed and full traces agree in the fast suite: tests/estimate/test_compose.py
def test_composed_by_default_and_the_same_bytes_with_full_trace(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "config.json"
    path.write_text(tiny_hf_config("llama", hidden_size=32, num_layers=17).to_json_string())  # auto: above 16
    args = ["estimate", "--hf-config", str(path), "--seq-len", "16", "--precision", "bf16-true", "--json"]
    main(args)
    composed = json.loads(capsys.readouterr().out)
    main([*args, "--full-trace"])
    full = json.loads(capsys.readouterr().out)
    assert composed["assumptions"][-1].startswith("composed from traces at depths 3, 4, 5 of the 17 decoder layers")
    assert not any("compose" in a for a in full["assumptions"])
    assert composed["phases"] == full["phases"] and composed["peak_bytes"] == full["peak_bytes"]


def test_full_trace_is_refused_where_it_means_nothing(tmp_path: Path) -> None:
    from lightning_memkit.cli.estimate import main as estimate

    path = tmp_path / "config.json"
    path.write_text(tiny_hf_config("llama").to_json_string())
    with pytest.raises(ConfigError, match="--full-trace: only with --hf-config"):
        estimate(["--hf-config", str(path), "--budget", "1GiB", "--full-trace"])


def test_the_console_command_ends_without_teardown_and_prints_everything(command,
                                                                         capsys: pytest.CaptureFixture) -> None:
    """``memkit estimate`` as a command exits right after its output (no interpreter teardown): the output is whole,
    the same as in-process, and the exit status 0."""
    args, proc, _ = command
    assert proc.returncode == 0, proc.stderr
    main(args)
    assert json.loads(proc.stdout)["phases"] == json.loads(capsys.readouterr().out)["phases"]
