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


@pytest.fixture
def tuned_winner():
    """Check a tune's JSON report chose as its own measurements say: ``tuned_winner(result)``
    returns the winning candidate's row."""
    return check_tuned_winner


def check_tuned_winner(result: dict) -> dict:
    """The winner's row of a tune's ``--json`` report, once checked against the tune's own numbers.

    What holds on any CPU under any load: exactly one stable, feasible winner, the same one the
    report names; the fastest stable candidate of the search made the final; and the winner
    is the finalists' leader (the re-measured one when gaps were re-measured, else the fastest
    of the search), or a safer finalist within the noise whose tie the tie note explains.

    Returns:
        The winner's row of ``result["candidates"]``.
    """
    rows = result["candidates"]
    table = [(c["label"], c["outcome"], c["goodput"], c["reason"]) for c in rows]
    winners = [c for c in rows if c["winner"]]
    assert len(winners) == 1, table
    winner = winners[0]
    assert winner["stable"] and winner["feasible"] and winner["outcome"] == "ok", table
    assert winner["label"] == result["winner_label"] and winner["mode"] == result["winner"]["mode"], table

    finalists = {f["label"]: f for f in result["finalists"]}
    assert winner["label"] in finalists, (winner["label"], list(finalists))
    fastest = max((c for c in rows if c["stable"] and c["feasible"]), key=lambda c: c["goodput"])
    assert fastest["label"] in finalists, (fastest["label"], list(finalists), table)

    gaps = {label: f["gap_vs_leader"] for label, f in finalists.items() if f["gap_vs_leader"] is not None}
    if gaps:
        (leader,) = [label for label in finalists if label not in gaps]
    else:
        leader = max(finalists.values(), key=lambda f: f["goodput"])["label"]
    if winner["label"] != leader:
        # A safer finalist won a tie with the leader: re-measured, its gap is a tie or unresolved.
        assert f"the safer {winner['label']} wins the tie" in result["tie_note"], (leader, result["tie_note"])
        if gaps:
            assert gaps[winner["label"]]["verdict"] in ("tie", "unresolved"), gaps
    return winner
