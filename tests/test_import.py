"""Importing lightning_memkit: lazy (no Lightning for the pure-torch parts), quiet, fast, and registering
``strategy="memkit_pipeline"`` and ``"memkit_fsdp2"`` whichever of it and Lightning comes first, the name alone enough
for a Trainer."""

import os
import subprocess
import sys
import textwrap

import pytest
import ranks

import lightning_memkit

ADAPTERS = {
    "ActivationCheckpointing": "lightning_memkit.callbacks",
    "ActivationOffloading": "lightning_memkit.callbacks",
    "AllocatorWarmupGuard": "lightning_memkit.callbacks",
    "OffloadOptimizer": "lightning_memkit.callbacks",
    "Optimizer8bit": "lightning_memkit.callbacks",
    "OptimizerInBackward": "lightning_memkit.callbacks",
    "PeakMemoryMonitor": "lightning_memkit.callbacks",
    "PhaseMemoryRelease": "lightning_memkit.callbacks",
    "SavedTensorProfiler": "lightning_memkit.callbacks",
    "StageBoundaryRelease": "lightning_memkit.callbacks",
    "NoSaveBitsandbytesPrecision": "lightning_memkit.plugins",
    "MemkitPipelineStrategy": "lightning_memkit.strategies",
}
CORE = {
    "cross_entropy": "lightning_memkit.ops", "linear_cross_entropy": "lightning_memkit.ops",
    "lm_head_loss": "lightning_memkit.ops", "padded_index_gather": "lightning_memkit.ops",
    "LivePeak": "lightning_memkit.memory", "DeferredFree": "lightning_memkit.memory",
    "release_storage": "lightning_memkit.memory", "profile_saved_tensors": "lightning_memkit.memory",
    "LayerCost": "lightning_memkit.pipeline", "Partition": "lightning_memkit.pipeline",
    "partition_layers": "lightning_memkit.pipeline", "dequantize_mxfp4": "lightning_memkit.loading",
    "load_mxfp4_into": "lightning_memkit.loading", "stream_dequantize": "lightning_memkit.loading",
}


def forked(snippets: dict[str, str | tuple[str, str]], preload: tuple[str, ...], parallel: bool = True,
           ) -> dict[str, subprocess.CompletedProcess]:
    """Each snippet (code, or code and a warnings action, as ``-W`` would set) run as ``python -c`` would run it, in a
    process of its own forked from a zygote that has imported ``preload`` and nothing else (all at once with
    ``parallel``, else one after the other)."""
    zygote, env = ranks.Zygote(preload), dict(os.environ, PYTHONPATH=ranks.PYPATH)
    try:
        done = {}
        for name, code in snippets.items():
            code, warn = (code, "") if isinstance(code, str) else code
            code = textwrap.dedent(code)
            if warn:
                code = f"import warnings\nwarnings.simplefilter({warn!r})\n" + code
            done[name] = zygote.start(["-c", code], env, stderr_to_stdout=False)
            if not parallel:
                done[name].wait(timeout=240)
        return {name: subprocess.CompletedProcess(name, proc.wait(timeout=240), *proc.communicate())
                for name, proc in done.items()}
    finally:
        zygote.close()


PURE_TORCH = ["lightning_memkit", "lightning_memkit.ops", "lightning_memkit.memory", "lightning_memkit.measure",
              "lightning_memkit.release", "lightning_memkit.recompute"]
HEAVY = ("lightning.", "pytorch_lightning", "transformers", "bitsandbytes", "torch.distributed.pipelining")


@pytest.fixture(scope="module")
def pure_imports() -> dict[str, subprocess.CompletedProcess]:
    """Per module of PURE_TORCH, imported alone beyond ``import torch``: its import time, then the heavy modules it
    loaded (one after the other, so that the times do not compete)."""
    code = """
        import sys, time
        t0 = time.perf_counter()
        import {}
        print(time.perf_counter() - t0)
        print(sorted(m for m in sys.modules if m == "lightning" or m.startswith({!r})))
    """
    return forked({module: code.format(module, HEAVY) for module in PURE_TORCH}, ("torch",), parallel=False)


@pytest.mark.parametrize("module", PURE_TORCH)
def test_pure_torch_imports_load_no_lightning_and_are_fast(module, pure_imports):
    proc = pure_imports[module]
    assert proc.returncode == 0, proc.stderr
    took, heavy = proc.stdout.splitlines()
    assert heavy == "[]"
    assert float(took) < 1.5, f"import {module} took {took} s beyond import torch"


def test_every_public_name_resolves_lazily_to_its_home():
    assert set(ADAPTERS) | set(CORE) <= set(lightning_memkit.__all__)
    assert set(lightning_memkit.__all__) <= set(dir(lightning_memkit))
    import importlib

    for name, home in {**CORE, **ADAPTERS}.items():
        assert getattr(lightning_memkit, name) is getattr(importlib.import_module(home), name), name
    with pytest.raises(AttributeError, match="module 'lightning_memkit' has no attribute 'nope'"):
        lightning_memkit.nope  # noqa: B018


def test_an_import_error_inside_the_package_propagates(monkeypatch):
    monkeypatch.delitem(lightning_memkit.__dict__, "NoSaveBitsandbytesPrecision", raising=False)
    monkeypatch.setitem(sys.modules, "lightning_memkit.plugins", None)  # a broken subpackage
    with pytest.raises(ImportError, match="lightning_memkit.plugins"):
        lightning_memkit.NoSaveBitsandbytesPrecision  # noqa: B018


REGISTRY_CHECK = """
    from lightning.pytorch import Trainer
    from lightning.pytorch.strategies import StrategyRegistry
    hooks = [f for f in sys.meta_path if type(f).__module__ == "lightning_memkit"]
    trainer = Trainer(strategy="memkit_pipeline", accelerator="cpu", devices=1, logger=False,
                      enable_progress_bar=False, enable_model_summary=False)  # the name alone, nothing else imported
    sharded = Trainer(strategy="memkit_fsdp2", accelerator="cpu", devices=1, logger=False,
                      enable_progress_bar=False, enable_model_summary=False)
    from lightning_memkit.strategies import MemkitPipelineStrategy
    import lightning.pytorch as pl
    print(type(trainer.strategy) is MemkitPipelineStrategy, "memkit_pipeline" in StrategyRegistry, hooks,
          type(pl.__loader__).__name__, type(pl.__spec__.loader).__name__, type(sharded.strategy).__name__)
"""


ORDERS = [
    "import lightning.pytorch\nimport lightning_memkit",                  # Lightning first: registered at once
    "import lightning_memkit\nimport lightning.pytorch",                  # memkit first: by the one-shot hook
    "import lightning_memkit.ops\nfrom lightning.pytorch import Trainer",  # a pure-torch part first: the same
    "from lightning_memkit.strategies import MemkitPipelineStrategy",   # the strategy module imports Lightning
    # the same hook reached through other modules; each order costs a fresh interpreter importing Lightning
    pytest.param("import lightning_memkit\nimport lightning", marks=pytest.mark.slow),  # the top-level package
    pytest.param("import lightning_memkit\nfrom lightning.pytorch.strategies import StrategyRegistry",
                 marks=pytest.mark.slow),                                 # via a submodule
    pytest.param("from lightning_memkit.callbacks import PeakMemoryMonitor", marks=pytest.mark.slow),
]
_ORDER_TEXT = [o.values[0] if hasattr(o, "values") else o for o in ORDERS]


HOOK_CHECK = """
    import sys
    before = list(sys.meta_path)
    import lightning_memkit, lightning_memkit.ops, lightning_memkit.memory
    import importlib; importlib.reload(lightning_memkit)  # imported again: still one hook
    print([type(f).__name__ for f in sys.meta_path if f not in before], "lightning" in sys.modules)
"""
CALLBACKS_REGISTER = """
    import sys
    import lightning_memkit
    from lightning.pytorch import Trainer
    from lightning.pytorch.strategies import StrategyRegistry
    print("memkit_pipeline" in StrategyRegistry)
    from lightning_memkit.callbacks import PeakMemoryMonitor  # registers a factory; the strategy is not imported
    print("memkit_pipeline" in StrategyRegistry, "lightning_memkit.strategies.pipeline" in sys.modules)
    trainer = Trainer(strategy="memkit_pipeline", accelerator="cpu", devices=1, logger=False,
                      enable_progress_bar=False, enable_model_summary=False)
    print(type(trainer.strategy).__name__)
"""
EVERY_SUBMODULE = """
    import importlib, pkgutil
    import lightning_memkit
    names = [m.name for m in pkgutil.walk_packages(lightning_memkit.__path__, "lightning_memkit.")]
    assert len(names) > 40, names
    for name in names:
        importlib.import_module(name)
"""


@pytest.fixture(scope="module")
def fresh() -> dict[str, subprocess.CompletedProcess]:
    """The import orders that run here, the hook check and the import of every submodule (with ``-W default``),
    each in a process of its own, all at once. Their zygote has imported torch and the two libraries that make most
    of Lightning's import time, torch._dynamo and torchmetrics (neither imports Lightning nor this package): each
    process still imports Lightning itself, in 0.2 s instead of 3.5 s."""
    run_slow = os.environ.get("MEMKIT_RUN_SLOW", "") == "1"  # as tests/conftest.py reads it
    orders = _ORDER_TEXT if run_slow else [o for o in ORDERS if isinstance(o, str)]
    snippets = {first: "import sys\n" + first + textwrap.dedent(REGISTRY_CHECK) for first in orders}
    return forked({**snippets, "hook": HOOK_CHECK, "callbacks": CALLBACKS_REGISTER,
                   "every submodule": (EVERY_SUBMODULE, "default")},
                  ("torch", "torch._dynamo", "torchmetrics"))


@pytest.mark.parametrize("first", ORDERS)
def test_memkit_pipeline_is_registered_whichever_is_imported_first(first, fresh):
    assert fresh[first].returncode == 0, fresh[first].stderr
    # the one-shot hook gone once Lightning is imported; lightning.pytorch keeps its own loader
    assert fresh[first].stdout.split("\n")[-2] == ("True True [] SourceFileLoader SourceFileLoader "
                                                  "MemkitFSDP2Strategy")


def test_importing_the_package_installs_one_import_hook_and_imports_no_lightning(fresh):
    assert fresh["hook"].returncode == 0, fresh["hook"].stderr
    assert fresh["hook"].stdout.strip() == "['_RegisterAfterImport'] False"


def test_a_part_that_imports_lightning_registers_the_strategy_without_importing_it(fresh):
    assert fresh["callbacks"].returncode == 0, fresh["callbacks"].stderr
    # registered by the hook once Lightning was imported, again (idempotent) by the callbacks; not imported until used
    assert fresh["callbacks"].stdout.split() == ["True", "True", "False", "MemkitPipelineStrategy"]


def test_importing_every_submodule_prints_nothing(fresh):
    proc = fresh["every submodule"]
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "" and proc.stderr == ""
