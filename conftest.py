"""Collection rules for the whole repository (the test suite's fixtures live in tests/conftest.py)."""

import importlib.util

# The Triton kernels import triton at module level; where it is not installed (it ships for Linux only),
# ``--doctest-modules`` skips them instead of failing to import them. The ops load them only on demand.
collect_ignore_glob = [] if importlib.util.find_spec("triton") else ["lightning_memkit/ops/triton/*.py"]
