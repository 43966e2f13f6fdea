"""bitsandbytes' import-time notice about its optional CPU kernel is dropped once this package is imported first;
its other messages are kept."""

import logging
import subprocess
import sys

import pytest

from lightning_memkit.common.bitsandbytes_log import CPU_OPS_LOGGER, NOTICE_PREFIX, drop_cpu_kernel_notice


def _stderr(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stderr


@pytest.mark.slow  # two fresh interpreters importing bitsandbytes (11 s)
def test_the_notice_is_not_printed_after_the_package_is_imported():
    pytest.importorskip("bitsandbytes")
    plain = _stderr("import bitsandbytes")
    if NOTICE_PREFIX not in plain:
        pytest.skip("bitsandbytes prints no CPU kernel notice on this machine (it needs AVX512-BF16)")
    assert NOTICE_PREFIX not in _stderr("import lightning_memkit, bitsandbytes; from lightning_memkit.plugins import "
                                        "NoSaveBitsandbytesPrecision as P; P('nf4', 'bfloat16')")


def test_only_that_record_is_dropped_and_the_filter_is_installed_once(caplog):
    drop_cpu_kernel_notice()
    drop_cpu_kernel_notice()
    logger = logging.getLogger(CPU_OPS_LOGGER)
    assert sum(type(f).__name__ == "_DropNotice" for f in logger.filters) == 1
    with caplog.at_level(logging.WARNING, logger=CPU_OPS_LOGGER):
        logger.warning(NOTICE_PREFIX + ": %s. Please make sure ...", "No module named 'kernels'")
        logger.warning("a real problem")
    assert [r.getMessage() for r in caplog.records] == ["a real problem"]
