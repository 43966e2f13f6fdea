# Two commands do all set-up: `make demo` and `make test`. Each builds .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# The CPU build of torch served here; override, e.g. `make test TORCH_SPEC="torch>=2.6"`.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.memkit-installed
BENCH_STAMP := $(VENV)/.memkit-bench-installed

.PHONY: demo test bench lint venv clean gpu-check gpu-wheels

# A download cut off mid-way does not fail the set-up: pip resumes it (--resume-retries, once pip is upgraded) and
# each install runs up to three times.
PIP_INSTALL := $(PY) -m pip install -q --retries 10 --timeout 60
RESUME := --resume-retries 20
DEV_EXTRAS := -e ".[test,hf]"
BENCH_EXTRAS := -e ".[test,hf,bench]"
retry = for i in 1 2 3; do $(1) && break; [ $$i -lt 3 ] || exit 1; echo "install failed, again ($$i of 3)" >&2; sleep 15; done

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(call retry,$(PIP_INSTALL) --upgrade pip)
	$(call retry,$(PIP_INSTALL) $(RESUME) "$(TORCH_SPEC)")
	$(call retry,$(PIP_INSTALL) $(RESUME) $(DEV_EXTRAS))
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/memkit fit --config examples/configs/tiny_lm.yaml
	$(VENV)/bin/memkit compare --config examples/configs/tiny_lm.yaml

# Lint, the tests and the package's docstring examples. Tests marked slow (several processes, long runs) are
# skipped: `make test MEMKIT_RUN_SLOW=1` (what .ci/run does) runs them too. The tests run in TEST_WORKERS
# processes (pytest-xdist; each test module stays in one of them); `make test TEST_WORKERS=0` runs them in this one.
# The run writes bytecode caches (__pycache__/, ignored by git) even where PYTHONDONTWRITEBYTECODE is set: it starts
# about a hundred Python processes, and each would compile the package again (over a second each).
TEST_WORKERS ?= 2
test: $(STAMP)
	$(VENV)/bin/ruff check lightning_memkit tests benchmarks examples
	PYTHONDONTWRITEBYTECODE= $(PY) -m compileall -q -j 0 lightning_memkit tests benchmarks examples > /dev/null
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -q -p no:cacheprovider --durations=15 \
		$(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadscope) $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests" >&2; exit 1; fi; exit $$rc

$(BENCH_STAMP): $(STAMP)
	$(call retry,$(PIP_INSTALL) $(RESUME) $(BENCH_EXTRAS))
	touch $(BENCH_STAMP)

# The benchmarks, with their peers installed (the `bench` extra).
bench: $(BENCH_STAMP)
	$(PY) -m benchmarks.run $(BENCH_ARGS)

# On a lent GPU machine with no network: that machine's own Python (GPU_PYTHON), the wheels of `make gpu-wheels`
# installed from .gpu-wheels/ into a temporary folder, every CUDA test, doc block and benchmark entry; results go to
# benchmarks/results/*-cuda.json, the pages, runs/gpu-check/ and, when OUT is set, to $(OUT) as they come.
# `make gpu-check DRY_RUN=1` lists the steps and their expected times (any machine); QUICK=1 runs the quick subset.
GPU_PYTHON ?= python3
gpu-check:
	$(GPU_PYTHON) -m benchmarks.gpu_check $(if $(DRY_RUN),--dry-run) $(if $(QUICK),--quick) \
		$(if $(wildcard .gpu-wheels/*.whl),--wheels .gpu-wheels) $(if $(OUT),--out "$(OUT)") $(GPU_CHECK_ARGS)

# The wheels the GPU machine lacks, for Linux x86-64 and Python 3.12, at this environment's versions (needs PyPI).
gpu-wheels: $(STAMP)
	$(PY) -m benchmarks.gpu_wheels .gpu-wheels

lint: $(STAMP)
	$(VENV)/bin/ruff check lightning_memkit tests benchmarks examples

clean:
	rm -rf $(VENV) lightning_logs runs .pytest_cache
