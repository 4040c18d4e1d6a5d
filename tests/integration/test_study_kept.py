"""A rerun of a tune never deletes its stored study's finished trials unasked: a tune that
finished answers again from its study, running no trial (the same JSON, or the report ending
``already tuned``); one with other options continues the study, saying so; --fresh deletes on
purpose. Real subprocess tunes, a real SQLite study."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

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


def _tune(script: Path, env: dict[str, str], *args: str, json_output: bool = True) -> subprocess.CompletedProcess[str]:
    common = COMMON if json_output else [a for a in COMMON if a != "--json"]
    return subprocess.run([sys.executable, "-m", "advisor.cli", "tune", str(script), *common, *args, "--", "40"],
                          cwd=ROOT, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=600)


def _runs(tmp_path: Path) -> int:
    path = tmp_path / "runs.txt"
    return len(path.read_text().splitlines()) if path.exists() else 0


def _complete(home: Path) -> int:
    """The stored study's trials that measured a candidate (what a fresh start would lose)."""
    [study] = study_status(f"sqlite:///{home / 'studies.db'}")
    return study["measured"]


def test_a_finished_tune_run_again_answers_without_a_trial_and_fresh_tunes_again(counted_script, isolated_home,
                                                                                   tmp_path):
    env = _env(isolated_home, tmp_path)
    first = _tune(counted_script, env)
    assert first.returncode == 0, first.stderr
    kept = _complete(isolated_home)
    assert kept >= 1
    runs = _runs(tmp_path)

    again = _tune(counted_script, env)
    assert again.returncode == 0, again.stderr
    assert again.stdout == first.stdout, "the same JSON, read back rather than measured again"
    assert _runs(tmp_path) == runs, "no trial ran, the fp32 reference included"
    assert _complete(isolated_home) == kept

    text = _tune(counted_script, env, json_output=False)
    assert text.returncode == 0, text.stderr
    last = text.stdout.strip().splitlines()[-1]
    assert last.startswith("already tuned ") and last.endswith(": mpadvise tune --fresh to tune again"), text.stdout
    assert _runs(tmp_path) == runs

    fresh = _tune(counted_script, env, "--fresh")
    assert fresh.returncode == 0, fresh.stderr
    assert json.loads(fresh.stdout)["trials_resumed"] == 0
    assert _runs(tmp_path) > runs

    both = _tune(counted_script, env, "--fresh", "--resume")
    assert both.returncode == 2 and "--resume and --fresh cannot be used together" in both.stderr, both.stderr


def test_a_tune_with_other_options_continues_the_study_and_never_deletes_it(counted_script, isolated_home,
                                                                            tmp_path):
    env = _env(isolated_home, tmp_path)
    first = _tune(counted_script, env)
    assert first.returncode == 0, first.stderr
    kept = _complete(isolated_home)
    runs = _runs(tmp_path)

    other = _tune(counted_script, env, "--trials", "2")  # not the options its answer was tuned with
    assert other.returncode == 0, other.stderr
    said = [ln for ln in other.stderr.splitlines() if "resuming study" in ln]
    assert len(said) == 1 and f"{kept} finished trial" in said[0], other.stderr
    assert _runs(tmp_path) > runs and _complete(isolated_home) >= kept
    assert json.loads(other.stdout)["trials_resumed"] >= 1


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
