"""Shared helpers for tests that run real subprocesses."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent / "scripts"


@pytest.fixture
def isolated_home(tmp_path, monkeypatch):
    """A fresh cache directory, so no test sees another's (or the user's) recommendations."""
    home = tmp_path / "mpadvise-home"
    monkeypatch.setenv("MPADVISE_HOME", str(home))
    monkeypatch.delenv("MPADVISE_POLICY", raising=False)
    return home


@pytest.fixture
def cli():
    """Run ``mpadvise ARGS`` in a subprocess: ``cli("trial", "train.py")``."""
    return run_cli


def run_cli(*args: str, timeout: float = 300, env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``mpadvise ARGS`` in a subprocess, as a user runs it."""
    full_env = dict(os.environ if env is None else env)
    full_env.setdefault("COLUMNS", "200")
    return subprocess.run(
        [sys.executable, "-m", "advisor.cli", *args],
        capture_output=True, text=True, timeout=timeout, env=full_env, cwd=cwd or ROOT,
    )
