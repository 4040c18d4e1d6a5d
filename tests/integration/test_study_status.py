"""``mpadvise study status``: what a study storage holds, read without writing, against a real
SQLite file and a real PostgreSQL server.

The studies are made by the real search (``run_search``) with a fake trial runner, plus a
trial another worker holds running, as a shared study looks mid-tune.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sqlite3
import stat
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
from _postgres import postgres_server, postgres_url  # noqa: F401  (fixtures)

from advisor.tune._options import TuneOptions
from advisor.tune._search import run_search
from advisor.tune._space import Candidate, Measured, SearchSpace
from advisor.tune._storage import STORAGE_ENV, storage_url
from advisor.tune._study import TRIAL_ATTR_CLAIM, candidate_to
from advisor.tune._study_status import study_status
from probes import MpadviseError

ROOT = Path(__file__).resolve().parents[2]
FP32, BF16, PURE = Candidate("fp32"), Candidate("bf16-mixed"), Candidate("bf16-true")
SPACE = SearchSpace(("fp32", "bf16-mixed", "bf16-true"), (64,), 64)
GOODPUT = {"fp32": 100.0, "bf16-mixed": 180.0}
OTHER = "other-node:4242"


def _make_study(url: str, name: str) -> None:
    """A study where this worker measured fp32 and bf16-mixed, and another runs bf16-true."""
    def run(candidate: Candidate) -> Measured:
        return Measured(candidate, GOODPUT[candidate.mode], True, True, outcome="ok")

    options = TuneOptions(storage=url, resume=True, no_priors=True, trials=1)
    run_search(SPACE, run, options, first=[FP32, BF16], reference_goodput=100.0, dtype_ratio={}, study_name=name,
               known={FP32: run(FP32)}, hardware="ab" * 8, sleep=lambda s: None)
    study = optuna.load_study(study_name=name, storage=storage_url(url))
    trial = study.ask({"mode": optuna.distributions.CategoricalDistribution(list(SPACE.modes))})
    trial.set_user_attr(TRIAL_ATTR_CLAIM, {**candidate_to(PURE), "trial": trial.number, "worker": OTHER})


def _status(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if k not in (STORAGE_ENV, "MPADVISE_STORAGE_FILE")}
    return subprocess.run([sys.executable, "-m", "advisor.cli", "study", "status", *args], capture_output=True,
                          text=True, env={**environ, "COLUMNS": "250", **env}, cwd=ROOT, timeout=120)


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _check_summary(summary: dict) -> None:
    assert summary["hardware"] == "ab" * 8
    assert summary["trials"]["complete"] == 2 and summary["trials"]["running"] == 1
    assert OTHER in summary["workers"] and len(summary["workers"]) == 2
    assert summary["best"]["label"] == "bf16-mixed" and summary["best"]["goodput"] == 180.0


@pytest.mark.slow
def test_status_of_an_sqlite_storage_lists_its_studies_and_writes_nothing(tmp_path):
    db = tmp_path / "studies.db"
    url = f"sqlite:///{db}"
    _make_study(url, "one")
    _make_study(url, "two")
    before, mode = _digest(db), stat.S_IMODE(db.stat().st_mode)
    listed = _status("--storage", url, "--json")
    assert listed.returncode == 0, listed.stderr
    data = json.loads(listed.stdout)
    assert data["storage"] == url and [s["study"] for s in data["studies"]] == ["one", "two"]
    for summary in data["studies"]:
        _check_summary(summary)
    one = _status("--study", "two", **{STORAGE_ENV: url})  # the storage from the environment, as a table
    assert one.returncode == 0, one.stderr
    assert "two" in one.stdout and "bf16-mixed: 180.0 samples/s" in one.stdout and OTHER in one.stdout
    assert _digest(db) == before and stat.S_IMODE(db.stat().st_mode) == mode  # read, never written

    missing = _status("--storage", url, "--study", "three")
    assert missing.returncode == 1 and missing.stderr.count("\n") == 1 and "no study 'three'" in missing.stderr
    absent = _status("--storage", f"sqlite:///{tmp_path / 'none.db'}")
    assert absent.returncode == 2 and "does not exist" in absent.stderr and "Traceback" not in absent.stderr
    assert not (tmp_path / "none.db").exists()


@pytest.mark.slow
@pytest.mark.postgres
def test_status_of_a_postgresql_storage(postgres_url):  # noqa: F811
    _make_study(postgres_url, "shared")
    listed = _status("--storage", postgres_url, "--json")
    assert listed.returncode == 0, listed.stderr
    data = json.loads(listed.stdout)
    assert [s["study"] for s in data["studies"]] == ["shared"]
    _check_summary(data["studies"][0])
    # The trial another worker runs is still running: status failed nothing as stale.
    study = optuna.load_study(study_name="shared", storage=storage_url(postgres_url))
    assert len(study.get_trials(states=(optuna.trial.TrialState.RUNNING,))) == 1


@pytest.mark.slow
@pytest.mark.postgres
def test_status_of_an_empty_database_and_an_unreachable_server(postgres_server):  # noqa: F811
    empty = postgres_server.create_database("status_empty")
    listed = _status("--storage", empty, "--json")
    assert listed.returncode == 0 and json.loads(listed.stdout)["studies"] == []
    url = empty.replace(f"{postgres_server.port}", "1").replace("postgres@", "postgres:s3cr/et@")
    down = _status("--storage", url)
    assert down.returncode == 1 and "Traceback" not in down.stderr and "s3cr" not in down.stderr
    lines = [ln for ln in down.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "cannot open the Optuna study storage 'postgresql://postgres:***@127.0.0.1:1/" in lines[0]


def test_status_of_a_storage_a_tune_is_still_making_writes_nothing(tmp_path):
    # A tune makes its storage in steps: the tables, a version row, then the schema stamp. Optuna's
    # storage opened in between stamps it itself, racing the tune: one of the two failed with
    # "UNIQUE constraint failed: alembic_version.version_num", or "table alembic_version already
    # exists". Status reads such a storage as holding no study yet, and leaves the stamp to the tune.
    db = tmp_path / "studies.db"
    url = f"sqlite:///{db}"
    _make_study(url, "one")
    with contextlib.closing(sqlite3.connect(db)) as connection, connection:
        connection.execute("DELETE FROM alembic_version")
    before = _digest(db)
    assert study_status(url) == []
    with pytest.raises(MpadviseError, match="no study 'one'"):
        study_status(url, "one")
    assert study_status(url, "one", missing_ok=True) == []
    assert _digest(db) == before  # nothing stamped, nothing written
