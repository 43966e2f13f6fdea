"""The runnable examples in the docstrings of the storage-accounting and release modules run as written."""

import doctest
import importlib

import pytest

MODULES = [
    "lightning_memkit.validation",
    "lightning_memkit.memory.storage",
    "lightning_memkit.memory.referrers",
    "lightning_memkit.memory.release",
    "lightning_memkit.memory.storage_release",
    "lightning_memkit.memory.deferred_free",
    "lightning_memkit.memory.stage_boundary",
    "lightning_memkit.memory.host_rss",
    "lightning_memkit.memory.report",
    "lightning_memkit.report",
    "lightning_memkit.progress",
    "lightning_memkit.callbacks.activation_checkpointing",
    "lightning_memkit.pipeline.runtime",
    "lightning_memkit.hf.layers",
    "lightning_memkit.hf.fused_loss",
    "lightning_memkit.hf.meta_init",
    "lightning_memkit.hf.qlora",
    "lightning_memkit.hf.pipeline_stages",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0, result
