"""Fixtures for the unit tests that read and write the recommendation cache, and a benchmark
script loaded as a module."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from advisor.cache import _store
from advisor.trial import _child, _step_window


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
    monkeypatch.setattr(_child, "end_trial_process", codes.append)  # an unsupported candidate
    monkeypatch.setattr(_step_window, "end_trial_process", codes.append)  # a full window, no step
    monkeypatch.setattr(_step_window.atexit, "register", lambda fn: None)
    return codes


@pytest.fixture
def load_bench():
    """Loads ``scripts/NAME.py`` as a module, for its pure functions (the benchmarks themselves
    run for minutes); unloaded when the test ends."""
    loaded: list[str] = []

    def load(name: str):
        path = Path(__file__).resolve().parents[2] / "scripts" / f"{name}.py"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # its dataclasses look their module up there
        loaded.append(name)
        spec.loader.exec_module(module)
        return module

    yield load
    for name in loaded:
        sys.modules.pop(name, None)
