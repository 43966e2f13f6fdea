"""Every shipped ``examples/configs/hf_*.yaml`` trains its tiny HF model through the ``memkit`` CLI (shortened)."""

from pathlib import Path

import pytest
import yaml

pytest.importorskip("transformers")

from lightning_memkit.cli.main import main

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "examples" / "configs").glob("hf_*.yaml"))


def _devices(path: Path) -> int:
    devices = yaml.safe_load(path.read_text()).get("trainer", {}).get("devices", 1)
    return devices if isinstance(devices, int) else 1


def test_there_are_hf_configs():
    assert len(CONFIGS) >= 1


@pytest.mark.parametrize("config", [c for c in CONFIGS if _devices(c) == 1], ids=lambda p: p.stem)
def test_single_process_hf_config_trains(config, tmp_path, capsys):
    main(args=["fit", "--config", str(config), "--trainer.max_steps", "4", "--trainer.default_root_dir", str(tmp_path),
               "--trainer.enable_progress_bar", "false", "--trainer.logger", "false"])
    out = capsys.readouterr().out
    assert "memkit memory report" in out and "over 4 optimizer steps" in out
