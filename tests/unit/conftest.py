"""Fixtures for the unit tests that read and write the recommendation cache."""

from __future__ import annotations

from pathlib import Path

import pytest

from advisor.cache import _store
from advisor.trial import _child


@pytest.fixture
def cache_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A private cache directory, no MPADVISE_POLICY, and a fresh "warned once" memory."""
    directory = tmp_path / "home"
    monkeypatch.setenv("MPADVISE_HOME", str(directory))
    monkeypatch.delenv("MPADVISE_POLICY", raising=False)
    monkeypatch.setattr(_store, "_warned_no_cache", set())
    return directory


@pytest.fixture
def exits(monkeypatch) -> list[int]:
    """What the trial child would have exited with, instead of ending the test process."""
    codes: list[int] = []
    monkeypatch.setattr(_child, "end_trial_process", codes.append)
    monkeypatch.setattr(_child.atexit, "register", lambda fn: None)
    return codes
