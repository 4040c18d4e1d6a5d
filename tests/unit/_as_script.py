"""Make ``load_policy()`` and ``setup()`` believe this process is ``python SCRIPT ARGS``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from advisor import _paths


def run_as(monkeypatch: pytest.MonkeyPatch, script: Path, *args: str) -> None:
    """This test's process runs ``script`` with ``args``, as far as mpadvise can tell."""
    monkeypatch.setattr(_paths, "current_script", lambda: script)
    monkeypatch.setattr(sys, "argv", [str(script), *args])
