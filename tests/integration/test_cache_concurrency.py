"""The cache under real processes: sixteen writers at once, and a writer killed mid-commit.

Both tests drive ``_cache_writer.py`` in subprocesses and then inspect the file with the
plain ``sqlite3`` module, so what they check is what is on disk, not what the store says.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

WRITER = Path(__file__).with_name("_cache_writer.py")
WORKERS = 16
SHARED_KEYS = 4
OWN_KEYS = 3
TRIALS = 20


def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.01)


def _recommendation_rows(db: Path) -> list[tuple[str, str, int, int]]:
    """(workload_fp, summary key, trial count recorded in summary, trial rows on disk)."""
    conn = sqlite3.connect(db)
    try:
        rows = conn.execute(
            "SELECT r.workload_fp, r.summary, "
            "(SELECT COUNT(*) FROM trials t WHERE t.recommendation_id = r.id) "
            "FROM recommendations r"
        ).fetchall()
    finally:
        conn.close()
    result = []
    for workload_fp, summary, trial_rows in rows:
        decoded = json.loads(summary)
        result.append((workload_fp, decoded["key"], decoded["trial_count"], trial_rows))
    return result


def _integrity(db: Path) -> str:
    conn = sqlite3.connect(db)
    try:
        return conn.execute("PRAGMA integrity_check").fetchone()[0]
    finally:
        conn.close()


def test_sixteen_simultaneous_writers_lose_nothing_and_never_see_locked(tmp_path: Path) -> None:
    db = tmp_path / "cache" / "mpadvise.db"
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    processes = [
        subprocess.Popen(
            [
                sys.executable,
                str(WRITER),
                "burst",
                str(db),
                str(barrier),
                str(worker),
                str(SHARED_KEYS),
                str(OWN_KEYS),
                str(TRIALS),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for worker in range(WORKERS)
    ]
    try:
        # Release everyone at once only when all are ready, so the database does not exist
        # yet when sixteen processes race to create it, switch it to WAL and migrate it.
        _wait_for(lambda: len(list(barrier.glob("ready-*"))) == WORKERS, 60, "all writers to start")
        (barrier / "go").touch()
        results = [process.communicate(timeout=60) for process in processes]
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    for worker, (process, (_stdout, stderr)) in enumerate(zip(processes, results, strict=True)):
        assert process.returncode == 0, f"writer {worker} exited {process.returncode}: {stderr}"
        assert "locked" not in stderr.lower()
        assert stderr == "", f"writer {worker} wrote to stderr: {stderr}"

    rows = _recommendation_rows(db)
    keys = [key for _, key, _, _ in rows]
    expected = {f"shared-{index}" for index in range(SHARED_KEYS)} | {
        f"worker-{worker}-{index}" for worker in range(WORKERS) for index in range(OWN_KEYS)
    }
    # Exactly one row per key: shared keys were replaced, never duplicated; no key was lost.
    assert sorted(keys) == sorted(expected)
    assert len({workload_fp for workload_fp, _, _, _ in rows}) == len(rows)
    for _, key, recorded, on_disk in rows:
        assert on_disk == recorded == TRIALS, key
    # Replaced rows leave no orphaned trials behind.
    conn = sqlite3.connect(db)
    try:
        total_trials = conn.execute("SELECT COUNT(*) FROM trials").fetchone()[0]
    finally:
        conn.close()
    assert total_trials == len(expected) * TRIALS
    assert _integrity(db) == "ok"


def test_writer_killed_mid_write_leaves_a_sound_database(tmp_path: Path) -> None:
    db = tmp_path / "mpadvise.db"
    rounds = 0
    # Kill at different moments: right after the first commit, and after a while of writing
    # large transactions (hundreds of trial rows each, so a kill lands inside one often).
    for delay in (0.0, 0.15, 0.4):
        ready = tmp_path / f"ready-{rounds}"
        process = subprocess.Popen(
            [sys.executable, str(WRITER), "loop", str(db), str(ready), "300"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        try:
            _wait_for(lambda ready=ready: ready.exists(), 30, "the writer's first commit")
            time.sleep(delay)
        finally:
            os.kill(process.pid, signal.SIGKILL)
            process.communicate(timeout=30)
        assert process.returncode == -signal.SIGKILL
        rounds += 1

        # Read with plain sqlite3, not the store: what is on disk must be sound, and every
        # recommendation must carry exactly the trials its summary counts.
        assert _integrity(db) == "ok"
        rows = _recommendation_rows(db)
        assert rows, "the writer committed at least one recommendation"
        for _, key, recorded, on_disk in rows:
            assert on_disk == recorded, f"{key}: {on_disk} trial rows, summary says {recorded}"

    # The next program opens it as a healthy cache, not as a damaged file to move aside.
    result = subprocess.run(
        [sys.executable, str(WRITER), "check", str(db)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    assert int(result.stdout) == len(_recommendation_rows(db))
    assert not list(tmp_path.glob("*.corrupt-*"))
