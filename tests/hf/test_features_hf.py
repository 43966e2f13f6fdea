"""The measuring and releasing callbacks on tiny Hugging Face causal LMs, added to the Trainer and nothing else."""

import pytest

transformers = pytest.importorskip("transformers")

from hf_checks import check_measuring_callbacks  # noqa: E402

from lightning_memkit.demo import HFCausalLM  # noqa: E402


@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "gpt_oss"])
def test_monitor_profiler_and_release_on_hf_models(family, tmp_path):
    check_measuring_callbacks(HFCausalLM(family=family, num_layers=2), tmp_path)
