"""Old finished jobs are deleted with their files; queued and running ones never are.

Real SQLite rows, aged by writing their timestamps; real files in a jobs directory.
"""

from __future__ import annotations

import datetime
import os
import time

from advisor.cache._store import Store
from advisor.daemon._jobs import JobRunner, Slot, prune_jobs

DAY = 86400.0


def _aged(store: Store, job_id: str, *, state: str, days: float) -> None:
    """Set a job's state and make it finish ``days`` ago."""
    when = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(days=days)
    stamp = when.isoformat(timespec="microseconds")
    with store.db.conn:
        store.db.execute("UPDATE jobs SET state = ?, created_at = ?, finished_at = ? WHERE id = ?",
                         [state, stamp, stamp if state not in ("queued", "running") else None, job_id])


def _files(jobs, job_id: str) -> list:
    paths = [jobs / f"{job_id}.log", jobs / f"{job_id}.result.json"]
    for path in paths:
        path.write_text("x")
    (jobs / "tmp" / job_id).mkdir(parents=True)
    return [*paths, jobs / "tmp" / job_id]


def test_prune_deletes_old_finished_jobs_and_their_files_only(tmp_path):
    jobs = tmp_path / "jobs"
    jobs.mkdir()
    with Store(tmp_path / "mpadvise.db") as store:
        ids = {name: store.enqueue_job(script=f"/w/{name}.py") for name in
               ("old_done", "old_failed", "old_cancelled", "new_done", "old_queued", "old_running")}
        _aged(store, ids["old_done"], state="succeeded", days=40)
        _aged(store, ids["old_failed"], state="failed", days=31)
        _aged(store, ids["old_cancelled"], state="cancelled", days=90)
        _aged(store, ids["new_done"], state="succeeded", days=2)
        _aged(store, ids["old_queued"], state="queued", days=400)
        _aged(store, ids["old_running"], state="running", days=400)
        files = {name: _files(jobs, job_id) for name, job_id in ids.items()}

        pruned = prune_jobs(store, jobs, retention_s=30 * DAY)

        gone = {"old_done", "old_failed", "old_cancelled"}
        assert set(pruned) == {ids[name] for name in gone}
        left = {job["id"] for job in store.list_jobs()}
        assert left == {ids[name] for name in ids if name not in gone}
        for name, paths in files.items():
            for path in paths:
                assert path.exists() == (name not in gone), (name, path)
        assert prune_jobs(store, jobs, retention_s=30 * DAY) == []


def test_prune_deletes_old_logs_of_jobs_no_longer_in_the_table(tmp_path):
    jobs = tmp_path / "jobs"
    jobs.mkdir()
    stray, fresh = jobs / "0123456789abcdef.log", jobs / "fedcba9876543210.log"
    stray.write_text("old")
    fresh.write_text("new")
    old = time.time() - 40 * DAY
    os.utime(stray, (old, old))
    with Store(tmp_path / "mpadvise.db") as store:
        prune_jobs(store, jobs, retention_s=30 * DAY)
    assert not stray.exists() and fresh.exists()


def test_the_runner_prunes_at_start(tmp_path):
    jobs = tmp_path / "jobs"
    with Store(tmp_path / "mpadvise.db") as store:
        job_id = store.enqueue_job(script="/w/x.py")
        _aged(store, job_id, state="succeeded", days=10)
        runner = JobRunner(store=store, slots=[Slot("cpu")], jobs_dir=jobs, retention_s=7 * DAY, idle_poll_s=0.05)
        runner.start()
        try:
            deadline = time.monotonic() + 60
            while store.get_job(job_id) is not None and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            runner.stop()
        assert store.get_job(job_id) is None
