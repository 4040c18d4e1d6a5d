"""The demo's tune at 80 columns: the answer at a glance on stdout (at most 15 lines, none
wider than the terminal, every command ``mpadvise ...``), progress on stderr; run again, the
same answer with no trial, ending ``already tuned``. A real subprocess tune of examples/mlp.py."""

from __future__ import annotations

import os
from pathlib import Path

import probes
from advisor.cache import cached_answers

ROOT = Path(__file__).resolve().parents[2]


def test_the_demo_answers_in_15_lines_at_80_columns_and_again_without_a_trial(tmp_path, isolated_home, cli):
    env = {**os.environ, "COLUMNS": "80"}
    args = ("tune", str(ROOT / "examples" / "mlp.py"), "--trials", "2", "--out", str(tmp_path / "mlp.toml"))
    first = cli(*args, env=env)
    assert first.returncode == 0, first.stderr
    lines = first.stdout.rstrip("\n").splitlines()
    assert 3 <= len(lines) <= 15, first.stdout
    assert all(len(line) <= 80 for line in lines), first.stdout
    assert lines[0].startswith("winner: ") and any(line.startswith("next: ") for line in lines), first.stdout
    assert "python -m" not in first.stdout and ".venv" not in first.stdout
    assert "search stopped" not in first.stdout and "search stopped" not in first.stderr  # --verbose only
    assert "fp32 (replicate" in first.stderr  # progress goes to stderr
    # The cache keeps fp32's loss per optimizer step with the answer: the run's guard compares with it.
    (answer,) = cached_answers(probes.profile_for(None), ROOT / "examples" / "mlp.py")
    assert len(answer.reference) >= 20 and all(0 < v < 10 for v in answer.reference), answer.reference

    again = cli(*args, env=env)
    assert again.returncode == 0, again.stderr
    assert "fp32 (replicate" not in again.stderr, "no trial ran"
    assert again.stdout.splitlines()[:-1] == lines  # the same answer, read back
    last = again.stdout.splitlines()[-1]
    assert last.startswith("already tuned ") and last.endswith(": mpadvise tune --fresh to tune again"), again.stdout

    verbose = cli(*args, "--verbose", env={**env, "COLUMNS": "200"})
    assert verbose.returncode == 0, verbose.stderr
    for detail in ("search stopped", "FLOPs per step", "cost:", "study '", "continue with: mpadvise tune "):
        assert detail in verbose.stdout, detail
