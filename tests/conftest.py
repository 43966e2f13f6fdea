import gc
import os
import shutil
import tempfile

import pytest
import torch

os.environ.setdefault("PL_DISABLE_FORK", "1")
# the planner's device probe caches its answer in a file: the suite's own, not the user's ~/.cache
os.environ.setdefault("MEMKIT_CACHE_DIR", os.path.join(tempfile.gettempdir(), f"memkit-test-cache-{os.getuid()}"))
# One intra-op thread: tests run tiny ops, where thread hand-off costs more than it saves, and a 2-core
# CI machine would otherwise be oversubscribed.
torch.set_num_threads(1)

HAS_CUDA = torch.cuda.is_available()


RUN_SLOW = os.environ.get("MEMKIT_RUN_SLOW", "") == "1"

#: third-party libraries every test process imports anyway (the test modules do, at collection): imported and then
#: frozen out of the garbage collector's sight before any test module is, see pytest_configure
FROZEN_LIBRARIES = ("lightning.pytorch", "transformers", "peft", "bitsandbytes")
_FROZE = pytest.StashKey[bool]()
_SHARED_ZYGOTE = pytest.StashKey[tuple]()


def pytest_configure(config):
    """In a process that runs tests: the objects that importing torch, Lightning, transformers, peft and bitsandbytes
    made (about 540k) are moved out of the collector's generations (``gc.freeze``), so that each full collection
    walks the tests' own objects only, a tenth of the heap (0.3-0.5 s a collection before, and the release code
    collects at every phase). What is frozen are the libraries' import-time objects; every object of this package
    and of the tests is made later and is searched by ``gc.get_referrers`` as before. ``MEMKIT_TEST_GC_FREEZE=0``
    leaves the collector alone (a test's own pytest run of a few modules, in a process that froze them already)."""
    if getattr(config, "workerinput", None) is None and config.getoption("dist", "no") != "no":
        _serve_the_shared_zygote(config)  # the xdist controller: it runs no test
        return
    if os.environ.get("MEMKIT_TEST_GC_FREEZE", "1") == "0":
        return
    import contextlib
    import importlib
    import io

    for name in FROZEN_LIBRARIES:
        try:  # quiet, as at collection (bitsandbytes reports the CPU kernels it lacks)
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                importlib.import_module(name)
        except ImportError:  # an optional dependency
            pass
    gc.collect()
    gc.freeze()
    config.stash[_FROZE] = True


def _serve_the_shared_zygote(config) -> None:
    """One zygote (``ranks.py``) for every test process of an xdist run instead of one each (its imports take about
    6 s of CPU): started here, before the test processes, which find its socket in their environment."""
    import tempfile
    from pathlib import Path

    import ranks

    if not ranks.zygote_enabled():
        return
    folder = Path(tempfile.mkdtemp(prefix="memkit-zygote-"))
    config.stash[_SHARED_ZYGOTE] = (ranks.serve_shared(folder), folder)


def pytest_unconfigure(config):
    if config.stash.get(_FROZE, False):
        gc.unfreeze()  # the interpreter's shutdown collects everything again, as without the freeze
    zygote, folder = config.stash.get(_SHARED_ZYGOTE, (None, None))
    if zygote is not None:
        zygote.stdin.close()  # its end of input: it kills what still runs and exits
        zygote.wait(timeout=60)
        shutil.rmtree(folder, ignore_errors=True)


def pytest_ignore_collect(collection_path):
    """Only ``test_*.py`` here: ``--doctest-modules`` would import the worker scripts, which run as processes of
    their own (one makes every later import of Lightning fail)."""
    if collection_path.suffix == ".py" and not collection_path.name.startswith("test_"):
        return True
    return None


def pytest_collection_modifyitems(config, items):
    skip_cuda = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_slow = pytest.mark.skip(reason="long run: set MEMKIT_RUN_SLOW=1")
    for item in items:
        if "cuda" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_cuda)
        if "slow" in item.keywords and not RUN_SLOW:
            item.add_marker(skip_slow)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


#: the balance a test that asserts which plan is chosen ranks with, whatever machine runs it (``MEMKIT_MACHINE``)
PINNED_MACHINE = "h100"


@pytest.fixture
def pinned_machine(monkeypatch):
    """Plans ranked with one fixed balance (an H100's) in this test and the processes it starts, not with this
    machine's probe: the plan a test asserts is then the same on any machine (``tests/test_machine_independence.py``
    runs such tests with very different balances forced on them)."""
    monkeypatch.setenv("MEMKIT_MACHINE", PINNED_MACHINE)
    return PINNED_MACHINE


_LAUNCH_VARIABLES = ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def _launch_variables_restored():
    """Lightning's launcher writes LOCAL_RANK, MASTER_PORT, ... into this process during an in-process fit on
    several devices; left there, a later test's `memkit fit` subprocess would think its ranks are already
    launched and wait for a rank that never starts."""
    before = {k: os.environ.get(k) for k in _LAUNCH_VARIABLES}
    yield
    for key, value in before.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(autouse=True)
def _no_live_peak_left_open():
    """Fail the test that leaves a ``LivePeak`` installed, not whichever test happens to run next."""
    from lightning_memkit.measure import live_peak

    yield
    leaked = list(live_peak._ACTIVE)
    if leaked:
        for mode in reversed(leaked):  # close them so later tests start clean
            mode.__exit__(None, None, None)
        pytest.fail(f"{len(leaked)} LivePeak context(s) left open by this test")
