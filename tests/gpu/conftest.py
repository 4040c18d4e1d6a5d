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
