"""Test set-up: run Triton kernels in the interpreter when there is no GPU, and fix Hypothesis's draws.

TRITON_INTERPRET must be set before any module defining a `@triton.jit` kernel is imported;
pytest imports this file first.

Every Hypothesis test draws the same examples on every run (CI must not draw new inputs each time):
the profile loaded here is derandomized (examples seeded from each test's own code) and keeps no
example database, and every `@settings(...)` a test adds inherits that from it.
"""

import os

try:
    from hypothesis import settings as _hypothesis_settings
except ImportError:  # the test extra is not installed: no Hypothesis test runs either
    _hypothesis_settings = None
else:
    _hypothesis_settings.register_profile("moe-place", derandomize=True, database=None)
    _hypothesis_settings.load_profile("moe-place")


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


if not _has_cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    import pytest

    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
