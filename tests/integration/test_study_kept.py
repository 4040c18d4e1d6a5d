"""A rerun of a tune never deletes its stored study's finished trials unasked: without a
terminal it refuses before any trial (exit 2) and names --resume and --fresh; on a terminal it
asks; --fresh deletes on purpose. Real subprocess tunes, a real SQLite study."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _terminal import answer_on_terminal

from advisor.tune import study_status

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent / "scripts"
COMMON = ["--trials", "1", "--steps", "32", "--warmup", "2", "--no-priors", "-m", "bf16-mixed", "--no-cache",
          "--json"]

pytestmark = pytest.mark.slow


@pytest.fixture
def counted_script(tmp_path: Path) -> Path:
    """tiny_ok.py, which also appends a line to $RUNS_FILE each time a trial starts it."""
    script = tmp_path / "train.py"
    script.write_text("import os\nwith open(os.environ['RUNS_FILE'], 'a') as f:\n    f.write('run\\n')\n"
                      + (SCRIPTS / "tiny_ok.py").read_text())
    return script


def _env(home: Path, tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "MPADVISE_HOME": str(home), "COLUMNS": "200", "RUNS_FILE": str(tmp_path / "runs.txt")}


def _tune(script: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "advisor.cli", "tune", str(script), *COMMON, *args, "--", "40"],
                          cwd=ROOT, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=600)


def _runs(tmp_path: Path) -> int:
    path = tmp_path / "runs.txt"
    return len(path.read_text().splitlines()) if path.exists() else 0


def _complete(home: Path) -> int:
    """The stored study's trials that measured a candidate (what a fresh start would lose)."""
    [study] = study_status(f"sqlite:///{home / 'studies.db'}")
    return study["measured"]


def test_a_rerun_without_a_terminal_keeps_the_study_and_fresh_deletes_it(counted_script, isolated_home, tmp_path):
    env = _env(isolated_home, tmp_path)
    first = _tune(counted_script, env)
    assert first.returncode == 0, first.stderr
    kept = _complete(isolated_home)
    assert kept >= 1
    runs = _runs(tmp_path)

    again = _tune(counted_script, env)
    assert again.returncode == 2, again.stderr
    assert "Traceback" not in again.stderr and again.stdout == ""
    errors = [ln for ln in again.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, again.stderr
    assert f"holds {kept} finished trial" in errors[0] and "--resume" in errors[0] and "--fresh" in errors[0]
    name = json.loads(first.stdout)["study_name"]
    assert repr(name) in errors[0] and "studies.db" in errors[0]
    assert _runs(tmp_path) == runs, "refused before any trial, the fp32 reference included"
    assert _complete(isolated_home) == kept

    fresh = _tune(counted_script, env, "--fresh")
    assert fresh.returncode == 0, fresh.stderr
    assert json.loads(fresh.stdout)["trials_resumed"] == 0

    both = _tune(counted_script, env, "--fresh", "--resume")
    assert both.returncode == 2 and "--resume and --fresh cannot be used together" in both.stderr, both.stderr


def test_a_study_without_finished_trials_is_replaced_silently(counted_script, isolated_home, tmp_path):
    import optuna

    isolated_home.mkdir(parents=True)
    storage = f"sqlite:///{isolated_home / 'studies.db'}"
    env = _env(isolated_home, tmp_path)
    first = _tune(counted_script, env, "--fresh")
    assert first.returncode == 0, first.stderr
    name = json.loads(first.stdout)["study_name"]
    optuna.delete_study(study_name=name, storage=storage)
    optuna.create_study(study_name=name, storage=storage)  # made, but nothing finished in it
    again = _tune(counted_script, env)
    assert again.returncode == 0, again.stderr


def _on_terminal(script: Path, env: dict[str, str], answer: str) -> tuple[int, str]:
    """The tune with a pseudo-terminal as stdin and stderr: answer its question, return the exit
    code and what it wrote to the terminal."""
    return answer_on_terminal([sys.executable, "-m", "advisor.cli", "tune", str(script), *COMMON, "--", "40"], answer,
                              cwd=ROOT, env=env, stdout_too=False, timeout=600)


def test_on_a_terminal_the_tune_asks_before_deleting(counted_script, isolated_home, tmp_path):
    env = _env(isolated_home, tmp_path)
    first = _tune(counted_script, env)
    assert first.returncode == 0, first.stderr
    kept = _complete(isolated_home)
    runs = _runs(tmp_path)

    code, text = _on_terminal(counted_script, env, "n")
    assert "[y/N]" in text and f"holds {kept} finished trial" in text and "(--resume continues them)" in text, text
    assert code == 1 and "nothing run" in text and "--resume" in text, text
    assert _runs(tmp_path) == runs and _complete(isolated_home) == kept

    code, text = _on_terminal(counted_script, env, "y")
    assert code == 0, text
    assert _runs(tmp_path) > runs


