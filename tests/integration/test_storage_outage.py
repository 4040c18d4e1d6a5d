"""A shared study's PostgreSQL server goes away mid-study: the workers wait for it, keep what
they measured meanwhile, and either store every result once it is back or end in one line.

Real ``mpadvise tune`` workers against a real server (``_postgres``), halted (``pg_ctl stop -m
fast``, as a restart would) once a worker has a trial running, so that the
outage falls inside the search, and restarted on the same data directory.
"""

from __future__ import annotations

import time

import pytest
from _postgres import postgres_server, postgres_url  # noqa: F401  (fixtures)
from test_shared_study import (
    SPACE_SIZE,
    WORKER_TIMEOUT_S,
    Worker,
    _check_accounted_for,
    _check_winner_kept,
    _reaped,
    _running_trial_of,
    _start,
    _storage,
    _study,
)

from advisor.trial import WARM_ENV
from advisor.tune._storage import GRACE_ENV, STORAGE_RETRY_ENV

# The workers' own trials start cold (seconds each), so that one can be caught running; a long
# grace, so that the outage never makes a live trial look dead to the other worker.
OUTAGE_ENV = {WARM_ENV: "0", GRACE_ENV: "60"}


def _waits_for_storage(workers: list[Worker], *, timeout: float) -> Worker:
    """The first worker that says it is retrying the unreachable storage."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for worker in workers:
            if "is unreachable" in worker.err.read_text(errors="replace"):
                return worker
        assert any(w.proc.poll() is None for w in workers), "every worker ended before noticing the outage"
        time.sleep(0.2)
    raise AssertionError(f"no worker noticed the outage within {timeout} s")


@pytest.mark.slow
@pytest.mark.postgres
def test_a_server_back_within_the_retry_window_loses_no_measurement(tmp_path, postgres_server, postgres_url):  # noqa: F811
    env = {**OUTAGE_ENV, STORAGE_RETRY_ENV: "600"}
    workers = [_start(tmp_path, name, postgres_url, trials=SPACE_SIZE, **env) for name in ("node-a", "node-b")]
    with _reaped(workers):
        _running_trial_of(postgres_url, workers[0], timeout=WORKER_TIMEOUT_S)
        postgres_server.halt()
        try:
            waiting = _waits_for_storage(workers, timeout=WORKER_TIMEOUT_S)
        finally:
            postgres_server.restart()
            _storage.cache_clear()  # this test's own connections died with the server
        finished = [w.finish() for w in workers]
    for (code, _, stderr), worker in zip(finished, workers):
        assert code == 0, f"{worker.name}: {stderr[-3000:]}"
        assert "Traceback" not in stderr
    assert "the Optuna study storage is back" in waiting.err.read_text()
    reports = [report for _, report, _ in finished]
    runs = _check_accounted_for(_study(postgres_url).get_trials())
    # Every trial a worker ran landed in the study, with its result, and none ran twice.
    assert len(runs) == sum(r["trials_run"] for r in reports) == SPACE_SIZE - 1
    for worker, report in zip(workers, reports):
        assert report["stop_reason"] == f"every candidate of the space was measured ({SPACE_SIZE})"
        _check_winner_kept(worker, report)


@pytest.mark.slow
@pytest.mark.postgres
def test_a_server_that_stays_away_ends_each_worker_in_one_line(tmp_path, postgres_server, postgres_url):  # noqa: F811
    env = {**OUTAGE_ENV, STORAGE_RETRY_ENV: "3"}
    workers = [_start(tmp_path, name, postgres_url, trials=SPACE_SIZE, **env) for name in ("node-a", "node-b")]
    shown = postgres_url  # it holds no password: shown as it is
    try:
        with _reaped(workers):
            _running_trial_of(postgres_url, workers[0], timeout=WORKER_TIMEOUT_S)
            postgres_server.halt()
            finished = [w.finish() for w in workers]
    finally:
        postgres_server.restart()
        _storage.cache_clear()
    for (code, report, stderr), worker in zip(finished, workers):
        assert code == 1, f"{worker.name}: {stderr[-3000:]}"
        assert report == {} and "Traceback" not in stderr, stderr[-3000:]
        errors = [ln for ln in stderr.splitlines() if ln.startswith("error: ")]
        assert len(errors) == 1, stderr[-3000:]
        assert f"Optuna study storage {shown!r}" in errors[0]
        assert not worker.script.with_name("train.mpadvise.toml").exists()
    # The worker that had a trial running when the server went says what became of its result.
    first = next(ln for ln in finished[0][2].splitlines() if ln.startswith("error: "))
    assert first.startswith(f"error: lost the Optuna study storage {shown!r} (retried for 3 s, {STORAGE_RETRY_ENV})")
    assert "not stored in the study" in first and "samples/s" in first
