"""Real GPU tests: each skips, with the reason, where CUDA is absent."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        available = torch.cuda.is_available()
    except ImportError:  # pragma: no cover
        available = False
    if available:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; none is visible here (torch.cuda.is_available() is False)")
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(skip)


@pytest.fixture
def second_gpu() -> str:
    """``"cuda:1"``, or a skip that says why where CUDA shows fewer than two devices."""
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count < 2:
        pytest.skip(f"needs 2 CUDA GPUs to run a trial on cuda:1; this machine shows {count}")
    return "cuda:1"
