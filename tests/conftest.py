"""Fixtures and hooks: the torch thread count, the `exactness` marker, the real GGUF target.

Plain helpers (tiny models, exact distributions, engine drivers) live in helpers.py."""
from __future__ import annotations

import os

import specdec  # noqa: F401  (first: applies $SPECDEC_ISA before torch computes anything)
import pytest
import torch


# under pytest-xdist (`make test` runs one worker per core) each worker computes on one thread: two
# workers with two threads each would oversubscribe the cores, and most tests are single-threaded Python
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1) // WORKERS))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Greedy-equality tests of every proposer carry the promise of exactness: mark them `exactness`
    (CI runs that marker again under SPECDEC_ISA=avx2, the portable kernels)."""
    for item in items:
        if "greedy" in item.name and "equals_plain" in item.name:
            item.add_marker(pytest.mark.exactness)


KERNEL_LIMITS = ("SPECDEC_ISA", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")


@pytest.fixture(autouse=True)
def kernel_limits_stay_as_they_were():
    """A test that leaves a kernel limit in the environment changes every later subprocess of its worker (a
    server started afterwards picked other kernels): it fails here, not the test that meets the leak."""
    before = {k: os.environ.get(k) for k in KERNEL_LIMITS}
    yield
    assert {k: os.environ.get(k) for k in KERNEL_LIMITS} == before, "a test left a kernel limit in os.environ"


@pytest.fixture(scope="session")
def smollm2():
    """(generator factory input) the real default target in fp32: model, tokenizer."""
    from specdec.api import load_model
    return load_model("smollm2-135m", "float32")
