"""``mpadvise tune --dry-run`` shows the search space and the plan and runs nothing: no trial
process, no study, no storage file, no config file, no cache entry; bad options fail as a real
tune's do. Real subprocesses, a real SQLite study."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent / "scripts"


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """A directory with train.py (tiny_ok.py, which appends to $RUNS_FILE whenever it starts)."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "train.py").write_text("import os\nwith open(os.environ['RUNS_FILE'], 'a') as f:\n    f.write('run\\n')\n"
                                   + (SCRIPTS / "tiny_ok.py").read_text())
    return work


def _dry(workdir: Path, home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "MPADVISE_HOME": str(home), "COLUMNS": "200", "RUNS_FILE": str(workdir.parent / "runs.txt")}
    return subprocess.run([sys.executable, "-m", "advisor.cli", "tune", "train.py", "--dry-run", *args], cwd=workdir,
                          env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300)


def test_dry_run_shows_the_space_and_the_plan_and_writes_nothing(workdir, tmp_path):
    home = tmp_path / "home"
    text = _dry(workdir, home, "--trials", "7", "--steps", "30", "--warmup", "3", "--", "40")
    assert text.returncode == 0, text.stderr
    out = text.stdout
    for needle in ("search space", "modes: fp32", "not tf32: needs an NVIDIA GPU", "micro-batch:", "loss scaling",
                   "candidates: at most", "trains with: the loop API", "launch: ", "train.py 40", "trials: 7",
                   "30 measured steps after 3 warm-up", "config file: ", "train.mpadvise.toml", "study: train-",
                   "studies.db", "make the study afresh"):
        assert needle in out, (needle, out)

    data = _dry(workdir, home, "--trials", "7", "-m", "bf16-mixed", "-m", "fp16-mixed", "--resume", "--json", "--",
                "40")
    assert data.returncode == 0, data.stderr
    planned = json.loads(data.stdout)
    assert sorted(planned["space"]["modes"]) == ["bf16-mixed", "fp16-mixed", "fp32"]
    assert planned["space"]["excluded"]["bf16-true"] == "not asked for (--mode)"
    assert planned["space"]["loss_scale"]["modes"] == ["fp16-mixed"] and planned["space"]["candidates"] > 3
    plan = planned["plan"]
    assert plan["trials"] == 7 and plan["resume"] and plan["framework"] is None
    assert plan["launch"][-2:] == [str(workdir / "train.py"), "40"]
    assert plan["config_file"] == str(workdir / "train.mpadvise.toml") and plan["cache"]
    assert plan["study_name"].startswith("train-") and plan["study_action"] == "make the study (none to resume)"

    # Nothing ran, nothing was made: no trial process, no cache directory (no study, no storage
    # file, no cache entry), no config file.
    assert not (tmp_path / "runs.txt").exists()
    assert not home.exists()
    assert sorted(p.name for p in workdir.iterdir()) == ["train.py"]


def test_dry_run_names_a_stored_study_it_would_not_delete(workdir, tmp_path):
    import optuna

    home = tmp_path / "home"
    first = _dry(workdir, home, "--json", "--", "40")
    name = json.loads(first.stdout)["plan"]["study_name"]
    home.mkdir()
    storage = f"sqlite:///{home / 'studies.db'}"
    study = optuna.create_study(study_name=name, storage=storage, direction="maximize")
    study.add_trial(optuna.trial.create_trial(value=1.0, user_attrs={"mpadvise:result": {"source": "run"}}))
    planned = json.loads(_dry(workdir, home, "--json", "--", "40").stdout)["plan"]
    # No answer kept with it (a tune interrupted): the tune would continue it, never delete it unasked.
    assert "continue the stored study's 1 finished trials" in planned["study_action"]
    assert "--fresh" in planned["study_action"]
    assert "continue the stored study (1 finished" in json.loads(
        _dry(workdir, home, "--json", "--resume", "--", "40").stdout)["plan"]["study_action"]
    assert len(optuna.load_study(study_name=name, storage=storage).trials) == 1


@pytest.mark.parametrize(
    ("args", "code", "needle"),
    [
        (["--trials", "0"], 2, "--trials 0 is not allowed"),
        (["-m", "bf17"], 2, "unknown mode"),
        (["-m", "tf32"], 1, "cannot run on"),
        (["--steps", "3", "--warmup", "0"], 2, "use --steps"),
        (["--storage", "nosuchdb://x"], 2, "cannot open the Optuna study storage"),
        (["--out", "other.py"], 2, "not a Python file"),
        (["--submit"], 2, "--dry-run cannot be used with --submit"),
    ],
)
def test_dry_run_refuses_what_a_tune_refuses(workdir, tmp_path, args, code, needle):
    proc = _dry(workdir, tmp_path / "home", *args, "--", "40")
    assert proc.returncode == code, proc.stderr
    assert "Traceback" not in proc.stderr
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and needle in errors[0], proc.stderr
