"""Many workers tuning one workload through one Optuna study on a real PostgreSQL server.

Each worker is a real ``mpadvise tune --storage postgresql://...`` process with its own cache
(``MPADVISE_HOME``) and its own checkout of the script, as on separate machines of the same
hardware. Heartbeats are one second and the grace period three (``MPADVISE_HEARTBEAT_S``,
``MPADVISE_GRACE_S``), so that a killed worker's trial comes back within seconds.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import optuna
import pytest
from _postgres import postgres_server, postgres_url  # noqa: F401  (fixtures)

from advisor.trial import WARM_ENV
from advisor.tune._storage import GRACE_ENV, HEARTBEAT_ENV, storage_url
from advisor.tune._study import (
    STUDY_ATTR_HARDWARE,
    TRIAL_ATTR_CLAIM,
    TRIAL_ATTR_CLOSED,
    TRIAL_ATTR_RESULT,
)
from advisor.tune._timing import paired_gap

ROOT = Path(__file__).resolve().parents[2]
# The workload every worker tunes: a tiny classifier whose speed is set by a pause per
# micro-batch, so that the winner (bf16-mixed at the script's batch of 6) leads every other
# candidate by 2x or more however busy the machine is, and no close call is re-measured.
SCRIPT = """\
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import advisor

PAUSE_S = {"fp32": 0.04, "bf16-mixed": 0.01}

torch.manual_seed(0)
steps = int(sys.argv[1])
x = torch.randn(1024, 32)
y = (x @ torch.randn(32, 4)).argmax(dim=1)
mp = advisor.load_policy()
net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
model, optimizer = mp.setup(net, torch.optim.AdamW(net.parameters(), lr=3e-3))
data = torch.utils.data.TensorDataset(x, y)
loader = torch.utils.data.DataLoader(data, batch_size=mp.micro_batch_size(6), shuffle=True)
while mp.optimizer_steps < steps:
    for xb, yb in loader:
        xb, yb = mp.to_device(xb, yb)
        with mp.autocast():
            loss = F.cross_entropy(model(xb).float(), yb)
        time.sleep(PAUSE_S[mp.mode])
        mp.step(loss, optimizer)
        if mp.optimizer_steps >= steps:
            break
"""
# Its space: fp32 and bf16-mixed, at the batch of 6 and split into 3s (accumulated back).
SPACE_SIZE = 4
# The shortest window the verdicts judge (32 steps), and no priors, so every run is alike.
TUNE = ["--steps", "32", "--warmup", "2", "--no-priors", "-m", "bf16-mixed", "--json"]
SCRIPT_ARGS = ["--", "60"]
WORKER_TIMEOUT_S = 420
STATE = optuna.trial.TrialState


@dataclass
class Worker:
    """One ``mpadvise tune`` process, with its own cache, checkout and output files."""

    name: str
    proc: subprocess.Popen[bytes]
    home: Path
    script: Path
    out: Path
    err: Path

    def finish(self) -> tuple[int, dict, str]:
        """Wait for it; its exit code, its JSON report ({} when none) and its stderr."""
        code = self.proc.wait(timeout=WORKER_TIMEOUT_S)
        stdout, stderr = self.out.read_text(), self.err.read_text()
        return code, (json.loads(stdout) if stdout.strip() else {}), stderr

    def cached(self) -> list[dict]:
        """What ``mpadvise show --json`` lists in this worker's cache."""
        show = subprocess.run([sys.executable, "-m", "advisor.cli", "show", "--json"], capture_output=True, text=True,
                              env=_env(self.home), cwd=ROOT, timeout=120)
        assert show.returncode == 0, show.stderr
        return json.loads(show.stdout)


def _env(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "MPADVISE_POLICY"}
    env.update({HEARTBEAT_ENV: "1", GRACE_ENV: "3"})
    env.update(MPADVISE_HOME=str(home), COLUMNS="200")
    env.update(extra)  # a test's own settings win, the heartbeat's included
    return env


def _start(tmp_path: Path, name: str, url: str, *, trials: int, **env: str) -> Worker:
    """A worker in its own directory (another checkout of the same script) and session;
    ``env`` is added to its environment."""
    base = tmp_path / name
    base.mkdir()
    script = base / "train.py"
    script.write_text(SCRIPT)
    out, err = base / "tune.json", base / "tune.err"
    with open(out, "wb") as stdout, open(err, "wb") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "advisor.cli", "tune", str(script), "--storage", url, "--trials", str(trials),
             *TUNE, *SCRIPT_ARGS],
            stdout=stdout, stderr=stderr, env=_env(base / "home", **env), cwd=ROOT, start_new_session=True,
        )
    return Worker(name, proc, base / "home", script, out, err)


@functools.cache
def _storage(url: str) -> optuna.storages.RDBStorage:
    """One connection pool per database, however often a test polls it."""
    return optuna.storages.RDBStorage(storage_url(url))


def _study(url: str) -> optuna.Study:
    """The one study the workers share (each test has a database of its own)."""
    names = optuna.get_all_study_names(_storage(url))
    assert len(names) == 1, names
    return optuna.load_study(study_name=names[0], storage=_storage(url))


def _result(trial: optuna.trial.FrozenTrial) -> dict:
    return trial.user_attrs.get(TRIAL_ATTR_RESULT) or {}


def _candidate(data: dict) -> tuple:
    return tuple(data.get(k) for k in ("mode", "micro_batch", "loss_scale", "init_scale", "growth_interval",
                                       "reduce_dtype"))


def _check_accounted_for(trials: list[optuna.trial.FrozenTrial]) -> list[optuna.trial.FrozenTrial]:
    """Every trial finished with a result, closed with a reason, failed for silence and
    retried, or still queued; no candidate run twice. Returns the trials that ran."""
    retried = {t.system_attrs.get("failed_trial") for t in trials}
    for t in trials:
        assert t.state != STATE.RUNNING, f"trial {t.number} was left running"
        if t.state == STATE.COMPLETE:
            assert _result(t), f"trial {t.number} completed without a result"
        elif t.state == STATE.FAIL:
            assert TRIAL_ATTR_CLOSED in t.user_attrs or t.number in retried, f"trial {t.number} failed unaccounted"
        else:
            assert t.state == STATE.WAITING, (t.number, t.state)
    runs = [t for t in trials if _result(t).get("source") == "run"]
    ran = [_candidate(_result(t)) for t in runs]
    assert len(ran) == len(set(ran)), f"a candidate ran twice: {sorted(ran, key=str)}"
    assert all(_result(t)["mode"] != "fp32" or _result(t)["micro_batch"] is not None for t in runs), \
        "fp32 at the script's batch is each worker's own reference, never a search trial"
    return runs


def _check_winner_kept(worker: Worker, report: dict) -> None:
    """The worker wrote the winner beside its script and into its own cache."""
    assert report["winner"] is not None and report["cache_id"] is not None
    assert Path(report["config_file"]) == worker.script.with_name("train.mpadvise.toml")
    assert worker.script.with_name("train.mpadvise.toml").exists()
    assert report["winner"]["mode"] in json.dumps(worker.cached())


def _found(data: object, key: str) -> list:
    """Every value of ``key`` anywhere in ``data`` (nested dicts and lists)."""
    if isinstance(data, dict):
        return [v for k, v in data.items() if k == key] + [x for v in data.values() for x in _found(v, key)]
    if isinstance(data, list):
        return [x for v in data for x in _found(v, key)]
    return []


def _check_own_speedup(worker: Worker, report: dict) -> None:
    """The speed-up the worker reported and cached rests on its own rounds of the winner beside
    its own fp32, never on a figure another worker measured."""
    if report["winner"]["mode"] == "fp32":
        return
    speedup = report["speedup"]
    assert speedup["pairs"] >= 2 and speedup["basis"].startswith("paired re-measurement"), speedup
    winner = next(f for f in report["finalists"] if f["label"] == report["winner_label"])
    pairs = [(w, r) for w, r in zip(winner["rounds"], report["reference_rounds"]) if w is not None and r is not None]
    assert len(pairs) == speedup["pairs"]
    assert paired_gap([w for w, _ in pairs], [r for _, r in pairs]).ratio == pytest.approx(speedup["ratio"], rel=1e-3)
    assert speedup["ratio"] in _found(worker.cached(), "speedup_vs_fp32")


@pytest.mark.slow
@pytest.mark.postgres
def test_two_workers_share_one_study_and_run_each_candidate_once(tmp_path, postgres_url):  # noqa: F811
    # Budgets that cover the space: each worker goes on until every candidate is measured,
    # waiting at the end for the trial the other is still running.
    workers = [_start(tmp_path, name, postgres_url, trials=SPACE_SIZE) for name in ("node-a", "node-b")]
    with _reaped(workers):
        finished = [w.finish() for w in workers]
    for (code, report, stderr), worker in zip(finished, workers):
        assert code == 0, f"{worker.name}: {stderr[-3000:]}"
        assert report["storage"] == postgres_url
    reports = [report for _, report, _ in finished]
    # Two checkouts at different paths: one study, named by content, arguments and hardware.
    assert reports[0]["study_name"] == reports[1]["study_name"]
    assert reports[0]["hardware"]["fingerprint"] in reports[0]["study_name"]

    study = _study(postgres_url)
    assert study.user_attrs[STUDY_ATTR_HARDWARE] == reports[0]["hardware"]["fingerprint"]
    trials = study.get_trials()
    runs = _check_accounted_for(trials)
    # No trial lost: every trial a worker ran is in the study, with its result; together they
    # ran every candidate but fp32 (each worker's own reference) once.
    assert len(runs) == sum(r["trials_run"] for r in reports) == SPACE_SIZE - 1
    assert all(r["trials_run"] >= 1 for r in reports), [r["trials_run"] for r in reports]
    assert {_result(t)["worker"] for t in runs} == {f"{socket.gethostname()}:{w.proc.pid}" for w in workers}
    # The first candidates were queued once, by the worker that made the study.
    reference = {"mode": "fp32", "micro_batch": reports[0]["user_batch"]}
    queued_fp32 = [t for t in trials if t.system_attrs.get("fixed_params") == reference]
    assert len(queued_fp32) == 1
    # Each worker ranked everything the study measured, and kept the winner in its own cache.
    for worker, report in zip(workers, reports):
        assert report["stop_reason"] == f"every candidate of the space was measured ({SPACE_SIZE})"
        assert len({c["label"] for c in report["candidates"]}) == SPACE_SIZE
        assert report["trials_run"] + report["trials_resumed"] == SPACE_SIZE - 1
        _check_winner_kept(worker, report)
        _check_own_speedup(worker, report)


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (its trial subprocess sits in a session of its own)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _kill_machine(worker: Worker) -> None:
    """``kill -9`` the worker and everything it started, as when its machine dies."""
    pids = [worker.proc.pid, *_descendants(worker.proc.pid)]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    worker.proc.wait(timeout=30)


@contextlib.contextmanager
def _reaped(workers: list[Worker]) -> Iterator[None]:
    """Kill whatever of the workers still runs when the block ends (a failed test included)."""
    try:
        yield
    finally:
        for worker in workers:
            if worker.proc.poll() is None:
                _kill_machine(worker)


def _running_trial_of(url: str, worker: Worker, *, timeout: float) -> int:
    """The number of a trial ``worker`` has been running for over a second (a real trial, not
    a proposal told at once)."""
    name = f"{socket.gethostname()}:{worker.proc.pid}"
    deadline, seen, since = time.monotonic() + timeout, None, 0.0
    while time.monotonic() < deadline:
        assert worker.proc.poll() is None, f"{worker.name} ended before running a trial: {worker.err.read_text()[-2000:]}"
        try:
            trials = _study(url).get_trials(states=(STATE.RUNNING,))
        except (AssertionError, KeyError):  # the study is not made yet
            trials = []
        mine = [t.number for t in trials if (t.user_attrs.get(TRIAL_ATTR_CLAIM) or {}).get("worker") == name]
        if seen is not None and seen in mine:
            if time.monotonic() - since >= 1.0:
                return seen
        else:
            seen, since = (mine[0] if mine else None), time.monotonic()
        time.sleep(0.2)
    raise AssertionError(f"{worker.name} ran no trial within {timeout} s")


@pytest.mark.slow
@pytest.mark.postgres
def test_a_killed_workers_trial_is_retried_by_the_other(tmp_path, postgres_url):  # noqa: F811
    # Its trials start cold, so that each runs for seconds (a warm trial of this workload is
    # over in half a second, too soon to be caught running on a loaded machine).
    doomed = _start(tmp_path, "node-a", postgres_url, trials=SPACE_SIZE, **{WARM_ENV: "0"})
    with _reaped([doomed]):
        number = _running_trial_of(postgres_url, doomed, timeout=WORKER_TIMEOUT_S)
        _kill_machine(doomed)
    # The survivor joins a study that holds a dead node's running trial: once the grace period
    # is over it fails that trial as stale and runs the retry. (Started beside the doomed one,
    # it once measured every candidate before the doomed one, slower with cold trials, ran any:
    # there was nothing to kill mid-trial.) Its budget covers every candidate, the retry too.
    survivor = _start(tmp_path, "node-b", postgres_url, trials=SPACE_SIZE)
    with _reaped([survivor]):
        code, report, stderr = survivor.finish()
    assert code == 0, stderr[-3000:]

    trials = _study(postgres_url).get_trials()
    runs = _check_accounted_for(trials)
    killed = next(t for t in trials if t.number == number)
    # Its heartbeats stopped: the survivor failed it as stale (no reason of ours: not closed)...
    assert killed.state == STATE.FAIL and TRIAL_ATTR_CLOSED not in killed.user_attrs
    # ... and Optuna's retry callback queued a copy, which the survivor ran to the end.
    retries = [t for t in trials if t.system_attrs.get("failed_trial") == number]
    assert len(retries) == 1 and retries[0].state == STATE.COMPLETE
    retry = _result(retries[0])
    assert retry["source"] == "run" and retry["worker"] == f"{socket.gethostname()}:{survivor.proc.pid}"
    assert _candidate(retry) == _candidate(killed.user_attrs[TRIAL_ATTR_CLAIM])
    assert [_candidate(_result(t)) for t in runs].count(_candidate(retry)) == 1
    _check_winner_kept(survivor, report)


def _closed_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]  # closed again on leaving: nothing listens there


def _tune_fails(tmp_path: Path, url: str, code: int = 1, **env: str) -> str:
    """Run a tune against ``url`` that must fail before any trial, with exit ``code`` (2: the URL
    itself is wrong; 1: the database it names cannot be used); returns its one error line."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    home = tmp_path / "home"
    proc = subprocess.run([sys.executable, "-m", "advisor.cli", "tune", str(script), "--storage", url, *TUNE,
                           *SCRIPT_ARGS], capture_output=True, text=True, env=_env(home, **env), cwd=ROOT, timeout=300)
    assert proc.returncode == code, proc.stderr
    assert "Traceback" not in proc.stderr and "fp32" not in proc.stderr, proc.stderr  # no trial started
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert not script.with_name("train.mpadvise.toml").exists()
    return lines[0]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("url", "code", "needles"),
    [
        ("nosuchdb://host/studies", 2, ["'nosuchdb://host/studies'", "nosuchdb", "expected a database"]),
        ("postgresql://tuner@host:port/studies", 2, ["'postgresql://tuner@host:port/studies'", "invalid literal"]),
        ("postgresql:/studies", 2, ["Could not parse", "expected a database"]),
        ("postgresql://tuner:s3cret@127.0.0.1:{port}/studies", 1, ["Connection refused", "tuner:***@"]),
    ],
    ids=["unknown-scheme", "bad-port", "malformed", "unreachable"],
)
def test_a_bad_or_unreachable_storage_is_one_line_before_any_trial(tmp_path, url, code, needles):
    # A URL that is not one is a usage error (exit 2); a server that does not answer is not.
    line = _tune_fails(tmp_path, url.format(port=_closed_port()), code)
    assert "cannot open the Optuna study storage" in line
    for needle in needles:
        assert needle in line
    assert "s3cret" not in line


@pytest.mark.slow
def test_a_missing_postgresql_driver_names_the_extra(tmp_path):
    # A psycopg that cannot be imported, ahead of the installed one, as where it is absent.
    shadow = tmp_path / "shadow" / "psycopg"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text('raise ModuleNotFoundError("No module named \'psycopg\'", name="psycopg")\n')
    pythonpath = os.pathsep.join([str(tmp_path / "shadow"), os.environ.get("PYTHONPATH", "")])
    line = _tune_fails(tmp_path, f"postgresql://tuner@127.0.0.1:{_closed_port()}/studies", PYTHONPATH=pythonpath)
    assert 'its database driver psycopg is not installed; pip install "mpadvise[postgres]"' in line


@pytest.mark.slow
@pytest.mark.postgres
def test_a_missing_database_and_a_study_of_other_hardware_are_refused(tmp_path, postgres_server, postgres_url):  # noqa: F811
    missing = postgres_server.url("no_such_database")
    assert 'database "no_such_database" does not exist' in _tune_fails(tmp_path / "missing", missing)

    # The study this tune would join holds trials of other hardware (made by hand under its name).
    from advisor.tune import study_name_for
    from probes import hardware_fingerprint, profile_for

    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    name = study_name_for(script, SCRIPT_ARGS[1:], hardware_fingerprint(profile_for(None)))
    study = optuna.create_study(study_name=name, storage=_storage(postgres_url), direction="maximize")
    study.set_user_attr(STUDY_ATTR_HARDWARE, "0" * 16)
    line = _tune_fails(tmp_path, postgres_url)
    assert f"holds trials measured on hardware {'0' * 16}" in line and "never mix" in line
