"""The persistent store: hardware profiles, recommendations, trials and daemon jobs in SQLite.

This is the one module that talks to sqlite-utils. Everything above it sees plain dicts.

How it stays correct when many processes share one file:

* WAL journal mode, so readers never block the writer and the writer never blocks readers;
  ``synchronous=NORMAL``, which in WAL mode loses nothing when a process dies (only a power
  cut can roll back the last commits, never corrupt the file).
* Every read-then-write runs in ``BEGIN IMMEDIATE``: the write lock is taken before the read,
  so two writers queue on the busy timeout (30 s) instead of one failing with "database is
  locked" when it tries to upgrade a read snapshot that has gone stale.
* A recommendation and its trials are replaced in one transaction, and multi-statement reads
  run in one read transaction, so nobody sees a recommendation without its trials.
* On open the file is checked (``PRAGMA quick_check`` and the recorded schema). A file that is
  not a database, is damaged, or was written by a newer schema is moved aside to
  ``<name>.corrupt-<timestamp>`` (with its ``-wal``/``-shm``) with a warning naming both
  paths, and a fresh database takes its place. Damage found later, mid-command, is handled
  the same way and the operation is retried once on the fresh file.
* A cache directory that cannot be created or written is not an error for callers that can
  run without a cache: :func:`open_store` then returns ``None`` after one warning.

Schema changes are plain functions registered with :func:`migration` and applied in order
by :func:`migrate`, each recorded in the ``_migrations`` table; ``PRAGMA user_version`` holds
the schema version (the number of migrations applied).
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import json
import logging
import math
import os
import random
import re
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import sqlite_utils

from advisor._paths import database_path
from probes._errors import MpadviseError

logger = logging.getLogger("mpadvise")

BUSY_TIMEOUT_S = 30.0
_WAL_PATIENCE_S = 2.0

EXPORT_FORMAT = "mpadvise-recommendations"
EXPORT_FORMAT_VERSION = 1

JOB_STATES = (
    "queued",
    "running",
    "cancelling",
    "succeeded",
    "failed",
    "cancelled",
    "interrupted",
)
FINISHED_JOB_STATES = ("succeeded", "failed", "cancelled", "interrupted")

TRIAL_FIELDS = (
    "number",
    "mode",
    "params",
    "outcome",
    "verdict",
    "reason",
    "goodput",
    "metrics",
)

# Shapes, not registries: the mode list grows as policies are added, and hardware
# fingerprints are computed elsewhere, so the store checks only that a value cannot be
# something else (a path, a sentence, an empty string).
_MODE_PATTERN = re.compile(r"[a-z0-9][a-z0-9._-]{0,31}")
_WORKLOAD_FP_PATTERN = re.compile(r"[0-9a-f]{16,64}")
_HARDWARE_FP_PATTERN = re.compile(r"[A-Za-z0-9][\x21-\x7e]{0,255}")

# Primary SQLite result codes, to tell damage from contention from a missing directory.
_SQLITE_BUSY = 5
_SQLITE_LOCKED = 6
_SQLITE_CORRUPT = 11
_SQLITE_NOTADB = 26

Record = dict[str, Any]
MigrationFunction = Callable[[sqlite_utils.Database], None]
_F = TypeVar("_F", bound=Callable[..., Any])


# --------------------------------------------------------------------------------------
# Schema migrations


_MIGRATIONS: list[tuple[str, MigrationFunction]] = []


def migration(function: MigrationFunction) -> MigrationFunction:
    """Register ``function`` as the next schema migration (its name is its record).

    Args:
        function: takes the ``sqlite_utils.Database`` and changes the schema; it runs inside
            the migrating transaction, so it must not commit.

    Returns:
        ``function`` unchanged.
    """
    if any(name == function.__name__ for name, _ in _MIGRATIONS):
        raise ValueError(f"migration {function.__name__!r} is registered twice")
    _MIGRATIONS.append((function.__name__, function))
    return function


@migration
def m001_initial_schema(db: sqlite_utils.Database) -> None:
    """Hardware profiles, recommendations with their trials, and the daemon's job queue."""
    db.table("hardware").create(
        {"fingerprint": str, "profile": str, "first_seen": str, "last_seen": str},
        pk="fingerprint",
        not_null=["profile", "first_seen", "last_seen"],
    )
    db.table("recommendations").create(
        {
            "id": int,
            "hardware_fp": str,
            "workload_fp": str,
            "script": str,
            "mode": str,
            "policy": str,
            "speedup_vs_fp32": float,
            "goodput": float,
            "created_at": str,
            "versions": str,
            "summary": str,
        },
        pk="id",
        not_null=["hardware_fp", "workload_fp", "mode", "policy", "created_at"],
    )
    # The lookup key, and the rule that one key holds one answer.
    db.table("recommendations").create_index(["hardware_fp", "workload_fp"], unique=True)
    db.table("recommendations").create_index(["created_at"])
    db.table("trials").create(
        {
            "id": int,
            "recommendation_id": int,
            "number": int,
            "mode": str,
            "params": str,
            "outcome": str,
            "verdict": str,
            "reason": str,
            "goodput": float,
            "metrics": str,
        },
        pk="id",
        not_null=["recommendation_id", "number"],
        foreign_keys=[("recommendation_id", "recommendations", "id")],
    )
    db.table("trials").create_index(["recommendation_id", "number"])
    db.table("jobs").create(
        {
            "id": str,
            "state": str,
            "script": str,
            "args": str,
            "options": str,
            "created_at": str,
            "started_at": str,
            "finished_at": str,
            "attempts": int,
            "progress": str,
            "result": str,
            "log_tail": str,
            "gpu": str,
            "requested_gpu": str,
        },
        pk="id",
        not_null=["state", "script", "created_at", "attempts"],
        defaults={"attempts": 0},
    )
    db.table("jobs").create_index(["state", "created_at"])


SCHEMA_VERSION = len(_MIGRATIONS)


class UnknownSchemaError(Exception):
    """The database was written by a newer (or a different) program than this one."""


def migrate(db: sqlite_utils.Database) -> list[str]:
    """Apply the registered migrations that ``db`` lacks, in order, in one write transaction.

    Runs inside the caller's transaction when one is open, else in its own
    ``BEGIN IMMEDIATE`` so that concurrent processes opening a fresh file apply each
    migration exactly once.

    Args:
        db: the database to bring up to :data:`SCHEMA_VERSION`.

    Returns:
        The names of the migrations applied now (empty when it was up to date).

    Raises:
        UnknownSchemaError: the database records migrations this code does not know, a
            schema version above :data:`SCHEMA_VERSION`, or holds tables but no migration
            record (some other program's file).
    """
    if db.conn.in_transaction:
        return _apply_migrations(db)
    with _transaction(db.conn, "BEGIN IMMEDIATE"):
        return _apply_migrations(db)


def _apply_migrations(db: sqlite_utils.Database) -> list[str]:
    applied = _applied_migrations(db)
    migrations = db.table("_migrations")
    if not migrations.exists():
        migrations.create({"name": str, "applied_at": str}, pk="name")
    applied_now = []
    for version, (name, function) in enumerate(_MIGRATIONS, start=1):
        if name in applied:
            continue
        function(db)
        migrations.insert({"name": name, "applied_at": _now()})
        db.execute(f"PRAGMA user_version = {version}")
        applied_now.append(name)
    return applied_now


def _applied_migrations(db: sqlite_utils.Database) -> set[str]:
    """The recorded migrations, after checking that this code understands them all."""
    tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    version = db.execute("PRAGMA user_version").fetchone()[0]
    if "_migrations" not in tables:
        if tables or version:
            raise UnknownSchemaError(
                f"it holds tables ({', '.join(sorted(tables))}) but no mpadvise schema record"
            )
        return set()
    applied = {row[0] for row in db.execute("SELECT name FROM _migrations")}
    known = {name for name, _ in _MIGRATIONS}
    unknown = sorted(applied - known)
    if unknown or version > len(_MIGRATIONS):
        detail = f"migrations {', '.join(unknown)}" if unknown else f"user_version {version}"
        raise UnknownSchemaError(
            f"its schema is newer than this mpadvise understands ({detail}; this version "
            f"knows schema {len(_MIGRATIONS)})"
        )
    return applied


@contextlib.contextmanager
def _transaction(conn: sqlite3.Connection, begin: str) -> Iterator[None]:
    conn.execute(begin)
    try:
        yield
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise
    try:
        conn.execute("COMMIT")
    except BaseException:
        # A failed COMMIT (disk full, I/O error) leaves the transaction open; close it so
        # the connection stays usable.
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise


# --------------------------------------------------------------------------------------
# Opening, damage and degradation


class _Unusable(Exception):
    """The file at the path cannot serve as the cache and should be moved aside."""

    def __init__(
        self,
        reason: str,
        identity: tuple[int, int] | None,
        conn: sqlite3.Connection | None = None,
    ) -> None:
        super().__init__(reason)
        self.reason = reason
        self.identity = identity
        # Still open: closing it before the move would let SQLite delete or checkpoint the
        # -wal file, destroying part of what is being kept aside.
        self.conn = conn


def _error_kind(exc: BaseException) -> str:
    """``"corrupt"``, ``"busy"`` or ``"other"`` for an exception raised by sqlite3."""
    code = getattr(exc, "sqlite_errorcode", None)
    if code is not None:
        primary = code & 0xFF
        if primary in (_SQLITE_CORRUPT, _SQLITE_NOTADB):
            return "corrupt"
        if primary in (_SQLITE_BUSY, _SQLITE_LOCKED):
            return "busy"
        return "other"
    # Python < 3.11 has no error codes on the exception: fall back to SQLite's messages.
    message = str(exc).lower()
    if "malformed" in message or "not a database" in message:
        return "corrupt"
    if "locked" in message or "busy" in message:
        return "busy"
    return "other"


def _file_identity(path: Path) -> tuple[int, int] | None:
    try:
        status = os.stat(path)
    except OSError:
        return None
    return (status.st_dev, status.st_ino)


def _now() -> str:
    # One fixed ISO 8601 form (UTC, microseconds), so that timestamps compare as text.
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="microseconds")


_warned_no_cache: set[str] = set()


def open_store(path: Path | str | None = None) -> Store | None:
    """Open the cache, or return ``None`` (after one warning) when it cannot be used.

    Callers that work without a cache (``load_policy``, ``tune``) treat ``None`` as "no
    cache": a read-only or uncreatable cache directory, or a file locked for longer than the
    busy timeout, costs a warning rather than the command.

    Args:
        path: database file; defaults to :func:`advisor._paths.database_path`.

    Returns:
        An open :class:`Store`, or ``None``.
    """
    try:
        return Store(path)
    except MpadviseError as exc:
        key = str(path if path is not None else database_path())
        # One warning per path and process: a daemon or a notebook that asks repeatedly
        # should not fill the log with the same line.
        if key not in _warned_no_cache:
            _warned_no_cache.add(key)
            logger.warning("%s; continuing without the cache", exc)
        return None


def _guarded(method: _F) -> _F:
    """Serialise a public Store method and turn SQLite errors into one-line MpadviseErrors.

    Damage discovered mid-command moves the file aside and retries the method once on a
    fresh database, so a corrupt cache never costs more than its contents.
    """

    @functools.wraps(method)
    def wrapper(self: Store, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            try:
                return method(self, *args, **kwargs)
            except sqlite3.Error as exc:
                kind = _error_kind(exc)
                if kind != "corrupt":
                    raise self._as_error(exc, kind) from exc
                self._recover(str(exc))
            try:
                return method(self, *args, **kwargs)
            except sqlite3.Error as exc:
                raise self._as_error(exc, _error_kind(exc)) from exc

    return wrapper  # type: ignore[return-value]


class Store:
    """The mpadvise cache database: one SQLite connection, shared safely by threads.

    Args:
        path: database file; defaults to :func:`advisor._paths.database_path`. Its directory
            is created when missing.

    Raises:
        MpadviseError: the directory cannot be created, the file cannot be opened or written,
            or it stays locked for longer than the busy timeout. (Damaged or foreign files are
            not errors: they are moved aside and replaced.)
    """

    def __init__(self, path: Path | str | None = None) -> None:
        self.path = Path(path) if path is not None else database_path()
        self._lock = threading.RLock()
        self._db: sqlite_utils.Database | None = None
        self._identity: tuple[int, int] | None = None
        directory = self.path.parent
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise MpadviseError(
                f"cache directory {directory} cannot be created ({exc.strerror or exc}); "
                "set MPADVISE_HOME to a writable directory"
            ) from exc
        self._open()

    @classmethod
    def open(cls, path: Path | str | None = None) -> Store | None:
        """Same as :func:`open_store`: a Store, or ``None`` after one warning."""
        return open_store(path)

    # -- lifecycle ---------------------------------------------------------------------

    def close(self) -> None:
        """Close the connection; the Store cannot be used afterwards."""
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Store({str(self.path)!r})"

    @property
    def db(self) -> sqlite_utils.Database:
        """The open ``sqlite_utils.Database`` (for migrations and tests; use the methods)."""
        if self._db is None:
            raise MpadviseError(f"the cache database {self.path} is closed")
        return self._db

    def _open(self) -> None:
        try:
            self._db = self._connect_checked()
        except _Unusable as problem:
            self._move_aside(problem.reason, problem.identity, problem.conn)
            try:
                self._db = self._connect_checked()
            except _Unusable as again:
                if again.conn is not None:
                    again.conn.close()
                raise MpadviseError(
                    f"cache database {self.path} is unusable even after starting a fresh one "
                    f"({again.reason}); set MPADVISE_HOME to another directory"
                ) from None

    def _connect_checked(self) -> sqlite_utils.Database:
        """Connect, configure and verify, retrying while other processes hold locks."""
        started = time.monotonic()
        deadline = started + BUSY_TIMEOUT_S
        while True:
            identity = _file_identity(self.path)
            conn: sqlite3.Connection | None = None
            try:
                # isolation_level=None: transactions are explicit (BEGIN IMMEDIATE for
                # writes), never opened behind our back by the sqlite3 module.
                conn = sqlite3.connect(
                    str(self.path),
                    timeout=BUSY_TIMEOUT_S,
                    isolation_level=None,
                    check_same_thread=False,
                )
                db = sqlite_utils.Database(conn, execute_plugins=False)
                conn.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
                db.enable_wal()
                if db.journal_mode != "wal" and time.monotonic() < started + _WAL_PATIENCE_S:
                    # SQLite answers a journal-mode switch it cannot lock for with the old
                    # mode instead of an error. Retry for a moment; a file system without
                    # shared memory never allows WAL, and the rollback journal is still
                    # correct there, only less concurrent.
                    conn.close()
                    time.sleep(random.uniform(0.01, 0.05))
                    continue
                conn.execute("PRAGMA synchronous = NORMAL")
                conn.execute("PRAGMA foreign_keys = ON")
                problems = [row[0] for row in conn.execute("PRAGMA quick_check")]
                if problems != ["ok"]:
                    raise _Unusable(f"it is damaged ({problems[0]})", identity, conn)
                try:
                    applied = _applied_migrations(db)
                    if len(applied) < len(_MIGRATIONS):
                        migrate(db)
                except UnknownSchemaError as exc:
                    raise _Unusable(str(exc), identity, conn) from None
                self._identity = identity or _file_identity(self.path)
                return db
            except _Unusable:
                raise
            except sqlite3.Error as exc:
                kind = _error_kind(exc)
                if kind == "corrupt":
                    raise _Unusable(f"it is not a valid database ({exc})", identity, conn) from None
                if conn is not None:
                    conn.close()
                if kind == "busy" and time.monotonic() < deadline:
                    # Not every lock wait goes through the busy handler (a journal-mode
                    # switch on a fresh file, WAL recovery after a crash): back off briefly
                    # and start over, within the same overall timeout.
                    time.sleep(random.uniform(0.01, 0.05))
                    continue
                raise self._as_error(exc, kind) from exc

    def _move_aside(
        self,
        reason: str,
        identity: tuple[int, int] | None,
        conn: sqlite3.Connection | None = None,
    ) -> None:
        """Rename a damaged or foreign database (and its WAL files) out of the way.

        The files are renamed while the connection that found the problem is still open, and
        only then closed: on close SQLite checkpoints and deletes the -wal by its old name,
        which by then no longer exists, so the moved copy keeps its WAL.
        """
        try:
            self._rename_aside(reason, identity)
        finally:
            if conn is not None:
                conn.close()
            if self._db is not None:
                self._db.close()
                self._db = None

    def _rename_aside(self, reason: str, identity: tuple[int, int] | None) -> None:
        current = _file_identity(self.path)
        if identity is not None and current != identity:
            # Another process found the same damage and has already replaced the file.
            return
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S.%fZ")
        target = self.path.with_name(f"{self.path.name}.corrupt-{stamp}")
        try:
            if current is not None:
                os.replace(self.path, target)
            # Keep the set together under names SQLite pairs up, so the copy can be opened.
            for suffix in ("-wal", "-shm"):
                side = self.path.with_name(self.path.name + suffix)
                if side.exists():
                    os.replace(side, target.with_name(target.name + suffix))
        except OSError as exc:
            raise MpadviseError(
                f"cache database {self.path} is unusable ({reason}) and cannot be moved "
                f"aside ({exc.strerror or exc}); delete it or set MPADVISE_HOME"
            ) from exc
        logger.warning(
            "cache database %s is unusable: %s; moved it aside to %s and started a fresh one",
            self.path,
            reason,
            target,
        )

    def _recover(self, reason: str) -> None:
        identity = self._identity
        self._move_aside(f"it is damaged ({reason})", identity)
        self._open()

    def _as_error(self, exc: BaseException, kind: str) -> MpadviseError:
        if kind == "busy":
            return MpadviseError(
                f"cache database {self.path} stayed locked by another process for more than "
                f"{BUSY_TIMEOUT_S:.0f} s; try again when the other mpadvise command finishes"
            )
        if kind == "corrupt":
            return MpadviseError(
                f"cache database {self.path} is damaged ({exc}); move it aside or delete it"
            )
        return MpadviseError(
            f"cache database {self.path} cannot be used ({exc}); check that its directory is "
            "writable, or set MPADVISE_HOME to another directory"
        )

    @contextlib.contextmanager
    def _write(self) -> Iterator[sqlite_utils.Database]:
        db = self.db
        with _transaction(db.conn, "BEGIN IMMEDIATE"):
            yield db

    @contextlib.contextmanager
    def _read(self) -> Iterator[sqlite_utils.Database]:
        # One snapshot for several SELECTs: a recommendation and its trials always match.
        db = self.db
        with _transaction(db.conn, "BEGIN"):
            yield db

    # -- hardware ----------------------------------------------------------------------

    @_guarded
    def put_hardware(self, fingerprint: str, profile: dict[str, Any]) -> None:
        """Record (or refresh) the profile of one hardware fingerprint.

        Args:
            fingerprint: the hardware fingerprint.
            profile: the hardware profile as a JSON-ready dict.
        """
        _check_hardware_fp("fingerprint", fingerprint)
        text = _json_text("profile", profile, require_dict=True)
        with self._write() as db:
            _upsert_hardware(db, fingerprint, text, _now())

    @_guarded
    def get_hardware(self, fingerprint: str) -> dict[str, Any] | None:
        """The stored row of one hardware fingerprint, with its profile decoded.

        Args:
            fingerprint: the hardware fingerprint.

        Returns:
            ``{"fingerprint", "profile", "first_seen", "last_seen"}``, or ``None``.
        """
        rows = list(self.db.query("SELECT * FROM hardware WHERE fingerprint = ?", [fingerprint]))
        return _decode(rows[0], ("profile",)) if rows else None

    @_guarded
    def list_hardware(self) -> list[dict[str, Any]]:
        """Every stored hardware profile, most recently seen first."""
        rows = self.db.query("SELECT * FROM hardware ORDER BY last_seen DESC")
        return [_decode(row, ("profile",)) for row in rows]

    # -- recommendations ---------------------------------------------------------------

    @_guarded
    def put_recommendation(
        self,
        *,
        hardware_fp: str,
        workload_fp: str,
        script: str | None,
        policy: dict[str, Any],
        speedup_vs_fp32: float | None,
        goodput: float,
        versions: dict[str, Any],
        summary: dict[str, Any],
        trials: Sequence[dict[str, Any]],
    ) -> int:
        """Store the answer for one (hardware, workload) key, replacing any earlier one.

        The old row, its trials, the new row and its trials change in one transaction, so a
        concurrent reader sees either the old recommendation or the new one, complete.

        Args:
            hardware_fp: hardware fingerprint.
            workload_fp: workload fingerprint (hex).
            script: the training script's path as the user gave it, or ``None``.
            policy: the policy as a JSON-ready dict with a ``"mode"`` key.
            speedup_vs_fp32: goodput relative to the fp32 reference, or ``None`` if unknown.
            goodput: samples per second of the recommended policy.
            versions: library versions the answer was measured with.
            summary: free-form summary of the tune (JSON-ready).
            trials: one dict per trial; keys among :data:`TRIAL_FIELDS`.

        Returns:
            The new recommendation's id.

        Raises:
            MpadviseError: a field has the wrong type or shape (the message names it).
        """
        record = _validated_record(
            {
                "hardware_fp": hardware_fp,
                "workload_fp": workload_fp,
                "script": script,
                "policy": policy,
                "speedup_vs_fp32": speedup_vs_fp32,
                "goodput": goodput,
                "created_at": _now(),
                "versions": versions,
                "summary": summary,
                "trials": list(trials),
            }
        )
        with self._write() as db:
            return _replace_recommendation(db, record)

    @_guarded
    def get_recommendation(self, hardware_fp: str, workload_fp: str) -> Record | None:
        """The recommendation for one key, with its trials and hardware profile.

        Args:
            hardware_fp: hardware fingerprint.
            workload_fp: workload fingerprint.

        Returns:
            The record (see :meth:`get`), or ``None`` when the key is not cached.
        """
        with self._read() as db:
            rows = _select_recommendations(
                db, "r.hardware_fp = ? AND r.workload_fp = ?", [hardware_fp, workload_fp]
            )
            return _with_trials(db, rows[0]) if rows else None

    @_guarded
    def get(self, recommendation_id: int) -> Record | None:
        """One recommendation by id, with its trials.

        Args:
            recommendation_id: the id returned by :meth:`put_recommendation`.

        Returns:
            ``{"id", "hardware_fp", "workload_fp", "script", "mode", "policy",
            "speedup_vs_fp32", "goodput", "created_at", "versions", "summary", "hardware",
            "trials"}`` (``hardware`` is the stored profile or ``None``), or ``None``.
        """
        with self._read() as db:
            rows = _select_recommendations(db, "r.id = ?", [recommendation_id])
            return _with_trials(db, rows[0]) if rows else None

    @_guarded
    def find_recommendations(
        self,
        *,
        hardware_fp: str | None = None,
        script: str | None = None,
        workload_fp: str | None = None,
        with_trials: bool = False,
    ) -> list[Record]:
        """Recommendations matching every given filter, newest first.

        Args:
            hardware_fp: only this hardware.
            script: only this script: matches the stored path, or its base name.
            workload_fp: only this workload.
            with_trials: include each record's trials (otherwise ``trials`` is absent).

        Returns:
            The matching records.
        """
        clauses, params = [], []
        if hardware_fp is not None:
            clauses.append("r.hardware_fp = ?")
            params.append(hardware_fp)
        if workload_fp is not None:
            clauses.append("r.workload_fp = ?")
            params.append(workload_fp)
        if script is not None:
            # Filtered in SQL so a lookup does not decode every row of this hardware: the
            # stored path equals ``script``, or (for a bare name) ends in "/<script>".
            escaped = script.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
            clauses.append("(r.script = ? OR r.script LIKE ? ESCAPE '\\')")
            params += [script, f"%/{escaped}"]
        with self._read() as db:
            rows = _select_recommendations(db, " AND ".join(clauses) or "1", params)
            if script is not None:
                rows = [
                    row
                    for row in rows
                    if row["script"] is not None
                    and script in (row["script"], os.path.basename(row["script"]))
                ]
            if with_trials:
                rows = [_with_trials(db, row) for row in rows]
            return rows

    def list_recommendations(self, *, with_trials: bool = False) -> list[Record]:
        """Every recommendation, newest first (see :meth:`find_recommendations`)."""
        return self.find_recommendations(with_trials=with_trials)

    @_guarded
    def delete(self, recommendation_id: int) -> bool:
        """Delete one recommendation and its trials.

        Args:
            recommendation_id: the recommendation's id.

        Returns:
            Whether it existed.
        """
        with self._write() as db:
            return _delete_recommendations(db, "id = ?", [recommendation_id]) > 0

    @_guarded
    def clear(self, older_than: datetime.timedelta | None = None) -> int:
        """Delete recommendations (and their trials); hardware profiles and jobs are kept.

        Args:
            older_than: only those created longer ago than this; ``None`` deletes all.

        Returns:
            How many recommendations were deleted.
        """
        with self._write() as db:
            if older_than is None:
                return _delete_recommendations(db, "1", [])
            cutoff = datetime.datetime.now(datetime.timezone.utc) - older_than
            return _delete_recommendations(
                db, "created_at < ?", [cutoff.isoformat(timespec="microseconds")]
            )

    # -- export and import -------------------------------------------------------------

    @_guarded
    def export_records(self, path: Path | str, *, ids: Iterable[int] | None = None) -> int:
        """Write recommendations, with their hardware profiles and trials, to a JSON file.

        Args:
            path: the file to write (replaced atomically).
            ids: only these recommendation ids; ``None`` exports all.

        Returns:
            How many records were written.

        Raises:
            MpadviseError: an id does not exist, or the file cannot be written.
        """
        with self._read() as db:
            if ids is None:
                rows = _select_recommendations(db, "1", [])
            else:
                rows = []
                for recommendation_id in ids:
                    found = _select_recommendations(db, "r.id = ?", [recommendation_id])
                    if not found:
                        raise MpadviseError(
                            f"recommendation {recommendation_id!r} is not in the cache "
                            f"{self.path}; `mpadvise show` lists the ids"
                        )
                    rows.extend(found)
            rows = [_with_trials(db, row) for row in rows]
        records = [_export_form(row) for row in rows]
        document = {
            "format": EXPORT_FORMAT,
            "format_version": EXPORT_FORMAT_VERSION,
            "exported_at": _now(),
            "records": records,
        }
        target = Path(path)
        temporary = target.with_name(f".{target.name}.{uuid.uuid4().hex}.tmp")
        try:
            temporary.write_text(json.dumps(document, indent=2, sort_keys=True) + "\n")
            os.replace(temporary, target)
        except OSError as exc:
            with contextlib.suppress(OSError):
                temporary.unlink()
            raise MpadviseError(f"cannot write {target}: {exc.strerror or exc}") from exc
        return len(records)

    @_guarded
    def import_records(
        self,
        path: Path | str,
        *,
        validate_hardware: Callable[[str, dict[str, Any] | None], object] | None = None,
    ) -> int:
        """Read a file written by :meth:`export_records` into the cache, all or nothing.

        Every record is validated before anything is written; then all of them are written in
        one transaction. A record replaces the cached one for its key unless the cached one
        is newer (so re-importing an old file never undoes a fresh local tune).

        Args:
            path: the export file.
            validate_hardware: called as ``validate_hardware(hardware_fp, profile)`` for each
                record; raising ``MpadviseError`` or ``ValueError`` rejects the file (for
                example, a fingerprint that does not match its profile).

        Returns:
            How many records were written.

        Raises:
            MpadviseError: the file is unreadable, not an mpadvise export, from a newer
                format, or a record is invalid; the message names the file, the record and
                the field, and nothing is written.
        """
        source = Path(path)
        records = _read_export(source)
        validated = []
        for index, raw in enumerate(records):
            where = f"{source}: record {index}"
            try:
                record = _validated_record(raw, imported=True)
                if validate_hardware is not None:
                    validate_hardware(record["hardware_fp"], record["hardware"])
            except (MpadviseError, ValueError) as exc:
                raise MpadviseError(f"{where}: {exc}; nothing was imported") from None
            validated.append(record)
        written = 0
        with self._write() as db:
            for record in validated:
                if record["hardware"] is not None:
                    _upsert_hardware(
                        db,
                        record["hardware_fp"],
                        _json_text("hardware", record["hardware"]),
                        record["created_at"],
                    )
                existing = list(
                    db.query(
                        "SELECT created_at FROM recommendations "
                        "WHERE hardware_fp = ? AND workload_fp = ?",
                        [record["hardware_fp"], record["workload_fp"]],
                    )
                )
                if existing and existing[0]["created_at"] > record["created_at"]:
                    continue
                _replace_recommendation(db, record)
                written += 1
        return written

    # -- jobs (the daemon's queue) -----------------------------------------------------

    @_guarded
    def enqueue_job(
        self,
        *,
        script: str,
        args: Sequence[str] = (),
        options: dict[str, Any] | None = None,
        gpu: str | None = None,
    ) -> str:
        """Queue a tune job.

        Args:
            script: the training script.
            args: the script's own arguments.
            options: tune options (JSON-ready).
            gpu: the slot the job must run on (kept as ``requested_gpu``); ``None`` lets any
                slot take it. The ``gpu`` field names the slot that runs or ran it.

        Returns:
            The job id.
        """
        if not isinstance(script, str) or not script:
            raise MpadviseError(f"job script must be a non-empty string, got {script!r}")
        if isinstance(args, str) or not all(isinstance(arg, str) for arg in args):
            raise MpadviseError(f"job args must be a list of strings, got {args!r}")
        job_id = uuid.uuid4().hex
        row = {
            "id": job_id,
            "state": "queued",
            "script": script,
            "args": _json_text("args", list(args)),
            "options": _json_text("options", options or {}, require_dict=True),
            "created_at": _now(),
            "attempts": 0,
            "gpu": None,
            "requested_gpu": gpu,
        }
        with self._write() as db:
            db.table("jobs").insert(row)
        return job_id

    @_guarded
    def claim_next_job(self, slot: str) -> Record | None:
        """Atomically take the oldest queued job this slot may run, and mark it running.

        Args:
            slot: the GPU slot (``"cuda:0"``, ``"cpu"``...) asking for work; a job pinned to
                another slot is left for that one.

        Returns:
            The job, now ``running`` on ``slot``, or ``None`` when nothing is queued.
        """
        with self._write() as db:
            rows = list(
                db.query(
                    "SELECT id FROM jobs WHERE state = 'queued' "
                    "AND (requested_gpu IS NULL OR requested_gpu = ?) "
                    "ORDER BY created_at, rowid LIMIT 1",
                    [slot],
                )
            )
            if not rows:
                return None
            db.execute(
                "UPDATE jobs SET state = 'running', started_at = ?, gpu = ? WHERE id = ?",
                [_now(), slot, rows[0]["id"]],
            )
            return _get_job(db, rows[0]["id"])

    @_guarded
    def update_job(
        self,
        job_id: str,
        *,
        progress: dict[str, Any] | None = None,
        log_tail: str | None = None,
    ) -> Record | None:
        """Record a running job's progress.

        Args:
            job_id: the job.
            progress: replaces the stored progress (JSON-ready) when given.
            log_tail: replaces the stored log tail when given.

        Returns:
            The job after the update (its ``state`` tells the runner whether it was asked to
            cancel), or ``None`` if there is no such job.
        """
        sets, params = [], []
        if progress is not None:
            sets.append("progress = ?")
            params.append(_json_text("progress", progress, require_dict=True))
        if log_tail is not None:
            sets.append("log_tail = ?")
            params.append(log_tail)
        with self._write() as db:
            if sets:
                db.execute(f"UPDATE jobs SET {', '.join(sets)} WHERE id = ?", [*params, job_id])
            return _get_job(db, job_id)

    @_guarded
    def finish_job(
        self,
        job_id: str,
        *,
        state: str,
        result: dict[str, Any] | None = None,
        log_tail: str | None = None,
    ) -> Record | None:
        """Mark a job finished.

        Args:
            job_id: the job.
            state: one of :data:`FINISHED_JOB_STATES`.
            result: the outcome (JSON-ready).
            log_tail: the last lines of its log.

        Returns:
            The job, or ``None`` if there is no such job.
        """
        if state not in FINISHED_JOB_STATES:
            raise MpadviseError(
                f"finished job state must be one of {', '.join(FINISHED_JOB_STATES)}, got {state!r}"
            )
        result_text = _json_text("result", result) if result is not None else None
        with self._write() as db:
            db.execute(
                "UPDATE jobs SET state = ?, finished_at = ?, result = COALESCE(?, result), "
                "log_tail = COALESCE(?, log_tail) WHERE id = ?",
                [state, _now(), result_text, log_tail, job_id],
            )
            return _get_job(db, job_id)

    @_guarded
    def get_job(self, job_id: str) -> Record | None:
        """One job, with its JSON fields decoded, or ``None``."""
        return _get_job(self.db, job_id)

    @_guarded
    def list_jobs(self, *, states: Iterable[str] | None = None) -> list[Record]:
        """Jobs in queue order (oldest first), optionally only those in ``states``."""
        if states is None:
            rows = self.db.query("SELECT * FROM jobs ORDER BY created_at, rowid")
        else:
            wanted = list(states)
            marks = ", ".join("?" for _ in wanted)
            rows = self.db.query(
                f"SELECT * FROM jobs WHERE state IN ({marks}) ORDER BY created_at, rowid", wanted
            )
        return [_decode_job(row) for row in rows]

    @_guarded
    def cancel_job(self, job_id: str) -> Record | None:
        """Cancel a job: a queued one at once, a running one by asking its runner.

        Args:
            job_id: the job.

        Returns:
            The job afterwards: ``cancelled`` if it was queued, ``cancelling`` if it was
            running (the runner stops it and calls :meth:`finish_job`), unchanged if it had
            already finished; ``None`` if there is no such job.
        """
        with self._write() as db:
            db.execute(
                "UPDATE jobs SET state = 'cancelled', finished_at = ? "
                "WHERE id = ? AND state = 'queued'",
                [_now(), job_id],
            )
            db.execute(
                "UPDATE jobs SET state = 'cancelling' WHERE id = ? AND state = 'running'",
                [job_id],
            )
            return _get_job(db, job_id)

    @_guarded
    def requeue_interrupted(self, *, max_retries: int = 1) -> list[Record]:
        """At daemon start: put back jobs that were running when the last daemon stopped.

        A ``running`` job goes back to ``queued`` with ``attempts + 1`` while it has been
        retried fewer than ``max_retries`` times, and becomes ``interrupted`` otherwise, so a
        job that kills the daemon cannot do it forever. A ``cancelling`` job is
        ``cancelled``.

        Args:
            max_retries: how many restarts a job survives.

        Returns:
            The jobs changed, after the change.
        """
        with self._write() as db:
            ids = [
                row["id"]
                for row in db.query("SELECT id FROM jobs WHERE state IN ('running', 'cancelling')")
            ]
            now = _now()
            db.execute(
                "UPDATE jobs SET state = 'cancelled', finished_at = ? WHERE state = 'cancelling'",
                [now],
            )
            db.execute(
                "UPDATE jobs SET state = 'queued', attempts = attempts + 1, started_at = NULL, "
                "gpu = NULL WHERE state = 'running' AND attempts < ?",
                [max_retries],
            )
            db.execute(
                "UPDATE jobs SET state = 'interrupted', finished_at = ? WHERE state = 'running'",
                [now],
            )
            return [job for job in (_get_job(db, job_id) for job_id in ids) if job is not None]


# --------------------------------------------------------------------------------------
# Rows in and out


_RECOMMENDATION_JSON = ("policy", "versions", "summary", "hardware")
_TRIAL_JSON = ("params", "metrics")
_JOB_JSON = ("args", "options", "progress", "result")


def _decode(row: dict[str, Any], json_columns: Iterable[str]) -> dict[str, Any]:
    for column in json_columns:
        if row.get(column) is not None:
            row[column] = json.loads(row[column])
    return row


def _decode_job(row: dict[str, Any]) -> Record:
    return _decode(row, _JOB_JSON)


def _get_job(db: sqlite_utils.Database, job_id: str) -> Record | None:
    rows = list(db.query("SELECT * FROM jobs WHERE id = ?", [job_id]))
    return _decode_job(rows[0]) if rows else None


def _select_recommendations(
    db: sqlite_utils.Database, where: str, params: Sequence[Any]
) -> list[Record]:
    rows = db.query(
        "SELECT r.*, h.profile AS hardware FROM recommendations r "
        "LEFT JOIN hardware h ON h.fingerprint = r.hardware_fp "
        f"WHERE {where} ORDER BY r.created_at DESC, r.id DESC",
        params,
    )
    return [_decode(row, _RECOMMENDATION_JSON) for row in rows]


def _with_trials(db: sqlite_utils.Database, row: Record) -> Record:
    trials = db.query(
        "SELECT number, mode, params, outcome, verdict, reason, goodput, metrics FROM trials "
        "WHERE recommendation_id = ? ORDER BY number, id",
        [row["id"]],
    )
    row["trials"] = [_decode(trial, _TRIAL_JSON) for trial in trials]
    return row


def _upsert_hardware(db: sqlite_utils.Database, fingerprint: str, profile: str, seen: str) -> None:
    db.execute(
        "INSERT INTO hardware (fingerprint, profile, first_seen, last_seen) VALUES (?, ?, ?, ?) "
        "ON CONFLICT(fingerprint) DO UPDATE SET profile = excluded.profile, "
        "last_seen = MAX(last_seen, excluded.last_seen), "
        "first_seen = MIN(first_seen, excluded.first_seen)",
        [fingerprint, profile, seen, seen],
    )


def _delete_recommendations(db: sqlite_utils.Database, where: str, params: Sequence[Any]) -> int:
    ids = [row["id"] for row in db.query(f"SELECT id FROM recommendations WHERE {where}", params)]
    for recommendation_id in ids:
        # Trials first: the foreign key forbids orphaning them.
        db.execute("DELETE FROM trials WHERE recommendation_id = ?", [recommendation_id])
        db.execute("DELETE FROM recommendations WHERE id = ?", [recommendation_id])
    return len(ids)


def _replace_recommendation(db: sqlite_utils.Database, record: Record) -> int:
    """Delete the key's old row and trials and insert the new ones (caller holds the lock)."""
    _delete_recommendations(
        db, "hardware_fp = ? AND workload_fp = ?", [record["hardware_fp"], record["workload_fp"]]
    )
    table = db.table("recommendations")
    table.insert(
        {
            "hardware_fp": record["hardware_fp"],
            "workload_fp": record["workload_fp"],
            "script": record["script"],
            "mode": record["policy"]["mode"],
            "policy": _json_text("policy", record["policy"]),
            "speedup_vs_fp32": record["speedup_vs_fp32"],
            "goodput": record["goodput"],
            "created_at": record["created_at"],
            "versions": _json_text("versions", record["versions"]),
            "summary": _json_text("summary", record["summary"]),
        }
    )
    recommendation_id = int(table.last_rowid)  # type: ignore[arg-type]
    rows = []
    for index, trial in enumerate(record["trials"]):
        rows.append(
            {
                "recommendation_id": recommendation_id,
                "number": trial.get("number", index),
                "mode": trial.get("mode"),
                "params": _optional_json("params", trial.get("params")),
                "outcome": trial.get("outcome"),
                "verdict": trial.get("verdict"),
                "reason": trial.get("reason"),
                "goodput": trial.get("goodput"),
                "metrics": _optional_json("metrics", trial.get("metrics")),
            }
        )
    if rows:
        db.table("trials").insert_all(rows)
    return recommendation_id


def _export_form(row: Record) -> Record:
    return {
        "hardware_fp": row["hardware_fp"],
        "workload_fp": row["workload_fp"],
        "script": row["script"],
        "policy": row["policy"],
        "speedup_vs_fp32": row["speedup_vs_fp32"],
        "goodput": row["goodput"],
        "created_at": row["created_at"],
        "versions": row["versions"] or {},
        "summary": row["summary"] or {},
        "hardware": row["hardware"],
        "trials": row["trials"],
    }


def _read_export(source: Path) -> list[Any]:
    try:
        text = source.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise MpadviseError(f"cannot read {source}: {reason}") from None
    try:
        document = json.loads(text)
    except json.JSONDecodeError as exc:
        raise MpadviseError(
            f"{source} is not an mpadvise export: invalid JSON at line {exc.lineno} column "
            f"{exc.colno} ({exc.msg}); nothing was imported"
        ) from None
    if not isinstance(document, dict) or document.get("format") != EXPORT_FORMAT:
        found = document.get("format") if isinstance(document, dict) else type(document).__name__
        raise MpadviseError(
            f"{source} is not an mpadvise export: expected format {EXPORT_FORMAT!r}, got "
            f"{found!r}; nothing was imported"
        )
    version = document.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise MpadviseError(
            f"{source}: format_version must be a positive integer, got {version!r}; "
            "nothing was imported"
        )
    if version > EXPORT_FORMAT_VERSION:
        raise MpadviseError(
            f"{source} was written by a newer mpadvise (format_version {version}; this one "
            f"reads up to {EXPORT_FORMAT_VERSION}); upgrade mpadvise to import it"
        )
    records = document.get("records")
    if not isinstance(records, list):
        raise MpadviseError(
            f"{source}: 'records' must be a list, got {type(records).__name__}; "
            "nothing was imported"
        )
    return records


# --------------------------------------------------------------------------------------
# Validation (the same rules for put_recommendation and import)


_REQUIRED_FIELDS = (
    "hardware_fp",
    "workload_fp",
    "policy",
    "goodput",
    "versions",
    "summary",
    "trials",
)


def _validated_record(raw: Any, *, imported: bool = False) -> Record:
    """Check a recommendation's fields; return it normalised, or raise naming the field."""
    if not isinstance(raw, dict):
        raise MpadviseError(f"a record must be a JSON object, got {type(raw).__name__}")
    for name in _REQUIRED_FIELDS:
        if name not in raw:
            raise MpadviseError(f"required field {name!r} is missing")
    _check_hardware_fp("hardware_fp", raw["hardware_fp"])
    workload_fp = raw["workload_fp"]
    if not isinstance(workload_fp, str) or not _WORKLOAD_FP_PATTERN.fullmatch(workload_fp):
        raise MpadviseError(
            f"workload_fp must be 16 to 64 lowercase hex characters, got {workload_fp!r}"
        )
    script = raw.get("script")
    if script is not None and not isinstance(script, str):
        raise MpadviseError(f"script must be a string or null, got {script!r}")
    policy = raw["policy"]
    if not isinstance(policy, dict):
        raise MpadviseError(f"policy must be a JSON object, got {type(policy).__name__}")
    mode = policy.get("mode")
    if not isinstance(mode, str) or not _MODE_PATTERN.fullmatch(mode):
        raise MpadviseError(f"policy.mode must be a mode name such as 'bf16-mixed', got {mode!r}")
    if imported and "mode" in raw and raw["mode"] != mode:
        raise MpadviseError(f"mode {raw['mode']!r} disagrees with policy.mode {mode!r}")
    speedup = _number("speedup_vs_fp32", raw.get("speedup_vs_fp32"), optional=True)
    goodput = _number("goodput", raw["goodput"], optional=False)
    for name in ("versions", "summary"):
        if not isinstance(raw[name], dict):
            raise MpadviseError(f"{name} must be a JSON object, got {type(raw[name]).__name__}")
    for name in ("policy", "versions", "summary"):
        _json_text(name, raw[name])
    trials = raw["trials"]
    if not isinstance(trials, list):
        raise MpadviseError(f"trials must be a list, got {type(trials).__name__}")
    for index, trial in enumerate(trials):
        _check_trial(index, trial)
    hardware = raw.get("hardware")
    if hardware is not None:
        if not isinstance(hardware, dict):
            raise MpadviseError(
                f"hardware must be a JSON object or null, got {type(hardware).__name__}"
            )
        _json_text("hardware", hardware)
    created_at = _timestamp(raw.get("created_at")) if imported else raw["created_at"]
    return {
        "hardware_fp": raw["hardware_fp"],
        "workload_fp": workload_fp,
        "script": script,
        "policy": policy,
        "speedup_vs_fp32": speedup,
        "goodput": goodput,
        "created_at": created_at,
        "versions": raw["versions"],
        "summary": raw["summary"],
        "trials": trials,
        "hardware": hardware,
    }


def _check_hardware_fp(name: str, value: Any) -> None:
    if not isinstance(value, str) or not _HARDWARE_FP_PATTERN.fullmatch(value):
        raise MpadviseError(
            f"{name} must be 1 to 256 printable characters without spaces, starting with a "
            f"letter or digit, got {value!r}"
        )


def _check_trial(index: int, trial: Any) -> None:
    where = f"trials[{index}]"
    if not isinstance(trial, dict):
        raise MpadviseError(f"{where} must be a JSON object, got {type(trial).__name__}")
    unknown = sorted(set(trial) - set(TRIAL_FIELDS))
    if unknown:
        raise MpadviseError(
            f"{where} has unknown field {unknown[0]!r}; trial fields are "
            f"{', '.join(TRIAL_FIELDS)} (put anything else in 'metrics')"
        )
    number = trial.get("number", index)
    if not isinstance(number, int) or isinstance(number, bool):
        raise MpadviseError(f"{where}.number must be an integer, got {number!r}")
    for name in ("mode", "outcome", "verdict", "reason"):
        value = trial.get(name)
        if value is not None and not isinstance(value, str):
            raise MpadviseError(f"{where}.{name} must be a string or null, got {value!r}")
    _number(f"{where}.goodput", trial.get("goodput"), optional=True)
    for name in ("params", "metrics"):
        value = trial.get(name)
        if value is not None:
            if not isinstance(value, dict):
                raise MpadviseError(
                    f"{where}.{name} must be a JSON object or null, got {type(value).__name__}"
                )
            _json_text(f"{where}.{name}", value)


def _number(name: str, value: Any, *, optional: bool) -> float | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        expected = "a finite number or null" if optional else "a finite number"
        raise MpadviseError(f"{name} must be {expected}, got {value!r}")
    return float(value)


def _timestamp(value: Any) -> str:
    """An imported created_at in the store's one text form (UTC, microseconds)."""
    if not isinstance(value, str):
        raise MpadviseError(f"created_at must be an ISO 8601 timestamp, got {value!r}")
    try:
        # Python 3.10's fromisoformat does not accept the "Z" suffix.
        parsed = datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise MpadviseError(f"created_at must be an ISO 8601 timestamp, got {value!r}") from None
    if parsed.tzinfo is None:
        raise MpadviseError(f"created_at must include a time zone, got {value!r}")
    return parsed.astimezone(datetime.timezone.utc).isoformat(timespec="microseconds")


def _json_text(name: str, value: Any, *, require_dict: bool = False) -> str:
    if require_dict and not isinstance(value, dict):
        raise MpadviseError(f"{name} must be a dict, got {type(value).__name__}")
    try:
        return json.dumps(value, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise MpadviseError(f"{name} is not JSON-serialisable ({exc})") from None


def _optional_json(name: str, value: Any) -> str | None:
    return None if value is None else _json_text(name, value)
