"""``--seq-len max``: the longest sequence whose step fits, searched on the estimator, checked by real fits: the run
at that length fits the budget, the estimate at 10% more does not."""

from __future__ import annotations

import contextlib
import io
import sys
from pathlib import Path

import pytest

from lightning_memkit.cli.main import main
from lightning_memkit.memory import LivePeak

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).parent))
from test_plans import BASE_CONFIG  # noqa: E402  (the tiny Llama config of the plan tests)

BASE = BASE_CONFIG.replace("batch_size: 4", "batch_size: 1")  # one sequence a step


def test_the_longest_sequence_fits_in_a_real_fit_and_ten_percent_more_does_not(tmp_path, monkeypatch):
    from lightning_memkit.estimate.config_run import ConfigRun
    from lightning_memkit.estimate.longest import longest_sequence

    monkeypatch.chdir(tmp_path)
    base = tmp_path / "base.yaml"
    base.write_text(BASE.replace("ROOT", str(tmp_path / "runs")))

    def run(tokens: int) -> ConfigRun:
        return ConfigRun(base, ["--data.init_args.seq_len", str(tokens)], allow=())

    budget = int(run(512).estimate(run(512).base).peak_bytes * 1.05 * 1.3)
    found = longest_sequence(run, budget, lower=128, granularity=64)
    tokens = found.seq_len
    assert tokens >= 512 and tokens % 64 == 0
    with LivePeak() as live, contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        main(["fit", "--config", str(base), "--data.init_args.seq_len", str(tokens)])
    assert live.peak_bytes <= budget / 1.05 * 1.01  # the real run: within the budget's margin (1% measurement)
    more = int(tokens * 1.1)
    assert run(more).estimate(run(more).base).peak_bytes * 1.05 > budget
    assert found.search.fitting and found.search.fitting[0].peak_bytes * 1.05 <= budget


def test_seq_len_max_from_the_command_line(tmp_path, capsys):
    from lightning_memkit.demo.hf_models import tiny_hf_config

    path = tmp_path / "config.json"
    path.write_text(tiny_hf_config("llama", vocab_size=256, max_position_embeddings=4096).to_json_string())
    main(["estimate", "--hf-config", str(path), "--seq-len", "max", "--budget", "8MiB", "--device", "cpu",
          "--allow", "recompute"])
    out = capsys.readouterr().out
    assert out.startswith("longest sequence that fits: 1,024 tokens; 4 lengths probed")
    with pytest.raises(SystemExit):
        main(["estimate", "--hf-config", str(path), "--seq-len", "max"])
    assert "--seq-len max: only with --hf-config and --budget" in capsys.readouterr().err
