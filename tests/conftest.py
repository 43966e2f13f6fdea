import os

import pytest
import torch

os.environ.setdefault("PL_DISABLE_FORK", "1")
# One intra-op thread: tests run tiny ops, where thread hand-off costs more than it saves, and a 2-core
# CI machine would otherwise be oversubscribed.
torch.set_num_threads(1)

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
