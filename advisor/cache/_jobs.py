"""The daemon's job queue, kept in the cache database so that queued jobs survive a restart. A
job is a plain dict of the ``jobs`` table's columns, with its JSON fields decoded."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from advisor.cache._base import StoreBase, guarded
from advisor.cache._records import Record, json_text, utc_now
from probes import MpadviseError

if TYPE_CHECKING:
    import sqlite_utils

JOB_STATES = ("queued", "running", "cancelling", "succeeded", "failed", "cancelled", "interrupted")
FINISHED_JOB_STATES = ("succeeded", "failed", "cancelled", "interrupted")

_JOB_JSON = ("args", "options", "progress", "result")


class JobQueue(StoreBase):
    """Tune jobs: queued, claimed by a slot, running, finished; oldest first."""

    @guarded
    def enqueue_job(self, *, script: str, args: Sequence[str] = (), options: dict[str, Any] | None = None,
                    gpu: str | None = None) -> str:
        """Queue a tune job; returns its id. ``gpu`` pins it to a slot (kept as
        ``requested_gpu``; the ``gpu`` field names the slot that runs or ran it)."""
        if not isinstance(script, str) or not script:
            raise MpadviseError(f"job script must be a non-empty string, got {script!r}")
        if isinstance(args, str) or not all(isinstance(arg, str) for arg in args):
            raise MpadviseError(f"job args must be a list of strings, got {args!r}")
        job_id = uuid.uuid4().hex
        row = {"id": job_id, "state": "queued", "script": script, "args": json_text("args", list(args)),
               "options": json_text("options", options or {}, require_dict=True), "created_at": utc_now(),
               "attempts": 0, "gpu": None, "requested_gpu": gpu}
        with self._write() as db:
            db.table("jobs").insert(row)
        return job_id

    @guarded
    def get_job(self, job_id: str) -> Record | None:
        return _get_job(self.db, job_id)

    @guarded
    def list_jobs(self, *, states: Iterable[str] | None = None) -> list[Record]:
        where, params = "1", []
        if states is not None:
            params = list(states)
            where = f"state IN ({', '.join('?' * len(params))})"
        rows = self.db.query(f"SELECT * FROM jobs WHERE {where} ORDER BY created_at, rowid", params)
        return [_decode_job(row) for row in rows]

    @guarded
    def count_queued_jobs(self) -> int:
        return int(self.db.execute("SELECT count(*) FROM jobs WHERE state = 'queued'").fetchone()[0])

    @guarded
    def cancel_job(self, job_id: str) -> Record | None:
        """Cancel a job: a queued one at once (``cancelled``), a running one by asking its runner
        (``cancelling``); returns the job afterwards, or ``None`` if there is no such job."""
        with self._write() as db:
            db.execute("UPDATE jobs SET state = 'cancelled', finished_at = ? WHERE id = ? AND state = 'queued'",
                       [utc_now(), job_id])
            db.execute("UPDATE jobs SET state = 'cancelling' WHERE id = ? AND state = 'running'", [job_id])
            return _get_job(db, job_id)

    @guarded
    def claim_next_job(self, slot: str) -> Record | None:
        """Atomically take the oldest queued job this slot may run (a job pinned to another slot
        is left for that one) and mark it running; ``None`` when nothing is queued."""
        with self._write() as db:
            while True:
                rows = list(db.query("SELECT * FROM jobs WHERE state = 'queued' AND (requested_gpu IS NULL "
                                     "OR requested_gpu = ?) ORDER BY created_at, rowid LIMIT 1", [slot]))
                if not rows:
                    return None
                if _decode_job(rows[0])["state"] == "queued":
                    break
                # A row that cannot be read cannot run: fail it, and take the next one.
                db.execute("UPDATE jobs SET state = 'failed', finished_at = ?, result = ? WHERE id = ?",
                           [utc_now(), json_text("result", _decode_job(rows[0])["result"]), rows[0]["id"]])
            db.execute("UPDATE jobs SET state = 'running', started_at = ?, gpu = ? WHERE id = ?",
                       [utc_now(), slot, rows[0]["id"]])
            return _get_job(db, rows[0]["id"])

    @guarded
    def update_job(self, job_id: str, *, progress: dict[str, Any] | None = None,
                   log_tail: str | None = None) -> Record | None:
        """Replace a running job's progress and log tail where given; returns the job after the
        update (its ``state`` tells the runner whether it was asked to cancel), or ``None``."""
        progress_text = None if progress is None else json_text("progress", progress, require_dict=True)
        with self._write() as db:
            db.execute("UPDATE jobs SET progress = COALESCE(?, progress), log_tail = COALESCE(?, log_tail) "
                       "WHERE id = ?", [progress_text, log_tail, job_id])
            return _get_job(db, job_id)

    @guarded
    def finish_job(self, job_id: str, *, state: str, result: dict[str, Any] | None = None,
                   log_tail: str | None = None) -> Record | None:
        if state not in FINISHED_JOB_STATES:
            raise MpadviseError(f"finished job state must be one of {', '.join(FINISHED_JOB_STATES)}, got {state!r}")
        result_text = json_text("result", result) if result is not None else None
        with self._write() as db:
            db.execute("UPDATE jobs SET state = ?, finished_at = ?, result = COALESCE(?, result), "
                       "log_tail = COALESCE(?, log_tail) WHERE id = ?", [state, utc_now(), result_text, log_tail, job_id])
            return _get_job(db, job_id)

    @guarded
    def requeue_interrupted(self, *, max_retries: int = 1) -> list[Record]:
        """At daemon start, put back the jobs that were running when the last daemon stopped: a
        ``running`` job is queued again with ``attempts + 1`` while it has been retried fewer
        than ``max_retries`` times, else ``interrupted`` (a job that kills the daemon cannot do
        it forever); a ``cancelling`` one is ``cancelled``. Returns the jobs changed."""
        with self._write() as db:
            ids = [row["id"] for row in db.query("SELECT id FROM jobs WHERE state IN ('running', 'cancelling')")]
            now = utc_now()
            db.execute("UPDATE jobs SET state = 'cancelled', finished_at = ? WHERE state = 'cancelling'", [now])
            db.execute("UPDATE jobs SET state = 'queued', attempts = attempts + 1, started_at = NULL, "
                       "gpu = NULL WHERE state = 'running' AND attempts < ?", [max_retries])
            db.execute("UPDATE jobs SET state = 'interrupted', finished_at = ? WHERE state = 'running'", [now])
            return [job for job in (_get_job(db, job_id) for job_id in ids) if job is not None]

    @guarded
    def prune_finished_jobs(self, *, finished_before: str) -> list[str]:
        """Delete the jobs that finished before ``finished_before`` (a :func:`utc_now` timestamp);
        returns their ids (the daemon removes their files)."""
        marks = ", ".join("?" * len(FINISHED_JOB_STATES))
        where = f"state IN ({marks}) AND finished_at IS NOT NULL AND finished_at < ?"
        params = [*FINISHED_JOB_STATES, finished_before]
        with self._write() as db:
            ids = [row["id"] for row in db.query(f"SELECT id FROM jobs WHERE {where}", params)]
            db.execute(f"DELETE FROM jobs WHERE {where}", params)
            return ids


def _get_job(db: sqlite_utils.Database, job_id: str) -> Record | None:
    rows = list(db.query("SELECT * FROM jobs WHERE id = ?", [job_id]))
    return _decode_job(rows[0]) if rows else None


def _decode_job(row: dict[str, Any]) -> Record:
    """A ``jobs`` row as a job. One with a JSON column that is not JSON is shown failed, with the
    reason (so that listing jobs never fails on one damaged row)."""
    job = dict(row)
    for column in _JOB_JSON:
        try:
            job[column] = None if row[column] is None else json.loads(row[column])
        except (TypeError, ValueError) as exc:
            error = f"the stored job cannot be read: its {column} column is not JSON ({exc})"
            return {**row, **dict.fromkeys(_JOB_JSON), "state": "failed", "result": {"exit_code": None, "error": error}}
    return job
