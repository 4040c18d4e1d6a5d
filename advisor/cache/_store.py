"""The cache database, the one module that imports sqlite-utils: the :class:`Store` and its job
queue. Many processes share one file: WAL, and every read-then-write in ``BEGIN IMMEDIATE``
(writers queue on the busy timeout instead of failing to upgrade a stale snapshot). A damaged,
foreign or newer file is moved aside and replaced. 0700/0600: the daemon runs the job queue."""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import random
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import sqlite_utils

from advisor._paths import database_path
from advisor._secure import ensure_private_dir, ensure_private_file, open_private_new
from advisor.cache._base import BUSY_TIMEOUT_S, StoreBase, error_kind, guarded, store_error
from advisor.cache._migrations import UnknownSchemaError, ensure_schema
from advisor.cache._recommendations import Recommendations
from advisor.cache._records import FINISHED_JOB_STATES, Record, json_text, utc_now
from probes import MpadviseError

logger = logging.getLogger("mpadvise")
_WAL_PATIENCE_S = 2.0
_warned_no_cache: set[str] = set()  # paths warned about, once per process

EVENT_FIELDS = ("signal", "step", "tripped_at", "policy", "fallback", "action", "detail")
"""The fields of one guard event, as the runtime's ``GuardEvent.to_dict()`` gives them."""

_JOB_JSON = ("args", "options", "progress", "result")


class JobQueue(StoreBase):
    """The daemon's tune jobs, oldest first, kept in the database so that they survive a restart;
    a job is a dict of the ``jobs`` table's columns, its JSON fields decoded."""

    @guarded
    def enqueue_job(self, *, script: str, args: Sequence[str] = (), options: dict[str, Any] | None = None,
                    gpu: str | None = None) -> str:
        """Queue a tune job; returns its id. ``gpu`` pins it to a slot (kept as
        ``requested_gpu``; the ``gpu`` field names the slot that runs or ran it)."""
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
        params = [] if states is None else list(states)
        where = "1" if states is None else f"state IN ({', '.join('?' * len(params))})"
        rows = self.db.query(f"SELECT * FROM jobs WHERE {where} ORDER BY created_at, rowid", params)
        return [_decode_job(row) for row in rows]

    @guarded
    def count_queued_jobs(self) -> int:
        return int(self.db.execute("SELECT count(*) FROM jobs WHERE state = 'queued'").fetchone()[0])

    @guarded
    def cancel_job(self, job_id: str) -> Record | None:
        """Cancel a job: a queued one at once, a running one by asking its runner; the job after."""
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
        """At daemon start, queue again a ``running`` job while retried fewer than ``max_retries``
        times, else ``interrupted`` (a job that kills the daemon cannot do it forever); a
        ``cancelling`` one is ``cancelled``. Returns the jobs changed."""
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
        """Delete the jobs that finished before ``finished_before`` (:func:`utc_now`); their ids."""
        where = f"state IN ({', '.join('?' * len(FINISHED_JOB_STATES))}) AND finished_at < ?"
        params = [*FINISHED_JOB_STATES, finished_before]
        with self._write() as db:
            ids = [row["id"] for row in db.query(f"SELECT id FROM jobs WHERE {where}", params)]
            db.execute(f"DELETE FROM jobs WHERE {where}", params)
            return ids


def _get_job(db: sqlite_utils.Database, job_id: str) -> Record | None:
    rows = list(db.query("SELECT * FROM jobs WHERE id = ?", [job_id]))
    return _decode_job(rows[0]) if rows else None


def _decode_job(row: dict[str, Any]) -> Record:
    """A ``jobs`` row as a job; one with a damaged JSON column is shown failed, never raising."""
    job = dict(row)
    for column in _JOB_JSON:
        try:
            job[column] = None if row[column] is None else json.loads(row[column])
        except (TypeError, ValueError) as exc:
            error = f"the stored job cannot be read: its {column} column is not JSON ({exc})"
            return {**row, **dict.fromkeys(_JOB_JSON), "state": "failed", "result": {"exit_code": None, "error": error}}
    return job


def open_store(path: Path | str | None = None) -> Store | None:
    """The cache, or ``None`` when it cannot be used, warning once per path and process (a daemon
    or a notebook that asks repeatedly should not fill the log with the same line)."""
    try:
        return Store(path)
    except MpadviseError as exc:
        key = str(path if path is not None else database_path())
        if key not in _warned_no_cache:
            _warned_no_cache.add(key)
            logger.warning("%s; continuing without the cache", exc)
        return None


class _Unusable(Exception):
    """The file cannot serve as the cache; ``args``: the reason, its identity, and the connection
    that found it, still open (closing it before the move would let SQLite delete or checkpoint
    the -wal file, destroying part of what is being kept aside)."""


def _file_identity(path: Path) -> tuple[int, int] | None:
    with contextlib.suppress(OSError):
        status = os.stat(path)
        return (status.st_dev, status.st_ino)
    return None


class Store(Recommendations, JobQueue, contextlib.AbstractContextManager):
    """The mpadvise cache database: one SQLite connection, shared safely by threads. MpadviseError
    when it cannot be used or stays locked past the busy timeout (damage is replaced instead)."""

    def __init__(self, path: Path | str | None = None) -> None:
        self.path = Path(path) if path is not None else database_path()
        self._lock = threading.RLock()
        self._db: sqlite_utils.Database | None = None
        self._identity: tuple[int, int] | None = None
        # The database holds the daemon's job queue: whoever can write it runs code as us.
        ensure_private_dir(self.path.parent)
        self._open()

    def close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @guarded
    def put_guard_event(self, event: Mapping[str, Any], *, hardware_fp: str, workload_fp: str | None,
                        script: str | None) -> int:
        """Store one event of the runtime guard (fields: ``EVENT_FIELDS``); returns its id."""
        if set(event) != set(EVENT_FIELDS):
            raise MpadviseError(f"guard event: expected the fields {', '.join(EVENT_FIELDS)}, "
                                f"got {', '.join(sorted(event))}")
        row = {**event, "hardware_fp": hardware_fp, "workload_fp": workload_fp, "script": script,
               "created_at": utc_now()}
        with self._write() as db:
            return int(db.table("guard_events").insert(row).last_pk)

    @guarded
    def list_guard_events(self, *, hardware_fp: str | None = None, script: str | None = None) -> list[dict[str, Any]]:
        """The guard's events, newest first; only this hardware's and script's where given."""
        return list(self.db.query("SELECT * FROM guard_events WHERE (:hw IS NULL OR hardware_fp = :hw) AND "
                                  "(:script IS NULL OR script = :script) ORDER BY created_at DESC, id DESC",
                                  {"hw": hardware_fp, "script": script}))

    def _open(self) -> None:
        try:
            self._db, self._identity = _connect_checked(self.path)
        except _Unusable as problem:
            self._move_aside(*problem.args)
            try:
                self._db, self._identity = _connect_checked(self.path)
            except _Unusable as again:
                reason, _, conn = again.args
                if conn is not None:
                    conn.close()
                raise MpadviseError(f"cache database {self.path} is unusable even after starting a fresh one "
                                    f"({reason}); set MPADVISE_HOME to another directory") from None

    def _move_aside(self, reason: str, identity: tuple[int, int] | None, conn: sqlite3.Connection | None = None) -> None:
        """Rename a damaged or foreign database (and its -wal, -shm) to ``<name>.corrupt-<time>``
        while the connection that found the problem is open, and only then close it: on close
        SQLite checkpoints and deletes the -wal by its old name, gone by then: the copy keeps it."""
        path = self.path
        try:
            current = _file_identity(path)
            if identity is not None and current != identity:
                return  # another process found the same damage and has already replaced the file
            stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S.%fZ")
            target = path.with_name(f"{path.name}.corrupt-{stamp}")
            try:
                if current is not None:
                    os.replace(path, target)
                # Keep the set together under names SQLite pairs up, so the copy can be opened.
                for suffix in ("-wal", "-shm"):
                    side = path.with_name(path.name + suffix)
                    if side.exists():
                        os.replace(side, target.with_name(target.name + suffix))
            except OSError as exc:
                raise MpadviseError(f"cache database {path} is unusable ({reason}) and cannot be moved "
                                    f"aside ({exc.strerror or exc}); delete it or set MPADVISE_HOME") from exc
            logger.warning("cache database %s is unusable: %s; moved it aside to %s and started a fresh one",
                           path, reason, target)
        finally:
            if conn is not None:
                conn.close()
            self.close()

    def _recover(self, reason: str) -> None:
        self._move_aside(f"it is damaged ({reason})", self._identity)
        self._open()


def _connect_checked(path: Path) -> tuple[sqlite_utils.Database, tuple[int, int] | None]:
    """Connect to ``path``, configure and verify, retrying while other processes hold locks; the
    database and the (device, inode) of its file. ``_Unusable`` for a damaged or foreign file."""
    started = time.monotonic()
    deadline = started + BUSY_TIMEOUT_S
    while True:
        _check_files(path)
        identity = _file_identity(path)
        conn: sqlite3.Connection | None = None
        try:
            # isolation_level=None: transactions are explicit, never opened by the sqlite3 module.
            conn = sqlite3.connect(str(path), timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False)
            db = sqlite_utils.Database(conn, execute_plugins=False)
            db.enable_wal()
            if db.journal_mode != "wal" and time.monotonic() < started + _WAL_PATIENCE_S:
                # SQLite answers a journal-mode switch it cannot lock for with the old mode
                # instead of an error. Retry for a moment; a file system without shared memory
                # never allows WAL, and the rollback journal is correct there, only less concurrent.
                conn.close()
                time.sleep(random.uniform(0.01, 0.05))
                continue
            conn.execute("PRAGMA synchronous = NORMAL")
            conn.execute("PRAGMA foreign_keys = ON")
            problems = [row[0] for row in conn.execute("PRAGMA quick_check")]
            if problems != ["ok"]:
                raise _Unusable(f"it is damaged ({problems[0]})", identity, conn)
            try:
                ensure_schema(db)
            except UnknownSchemaError as exc:
                raise _Unusable(str(exc), identity, conn) from None
            return db, identity or _file_identity(path)
        except sqlite3.Error as exc:
            kind = error_kind(exc)
            if kind == "corrupt":
                raise _Unusable(f"it is not a valid database ({exc})", identity, conn) from None
            if conn is not None:
                conn.close()
            if kind == "busy" and time.monotonic() < deadline:
                # Not every lock wait goes through the busy handler (a journal-mode switch on a
                # fresh file, WAL recovery after a crash): back off, start over, same deadline.
                time.sleep(random.uniform(0.01, 0.05))
                continue
            raise store_error(path, exc) from exc


def _check_files(path: Path) -> None:
    """Refuse a database (or -wal/-shm) that others own or may write; create it 0600 (SQLite
    gives the -wal and -shm files the database file's mode)."""
    for suffix in ("", "-wal", "-shm"):
        ensure_private_file(path.with_name(path.name + suffix))
    try:
        with contextlib.suppress(FileExistsError):
            os.close(open_private_new(path, os.O_RDWR))
    except OSError as exc:
        raise MpadviseError(f"cache database {path} cannot be created ({exc.strerror or exc}); "
                            "set MPADVISE_HOME to a writable directory of your own") from exc
