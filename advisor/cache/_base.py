"""What the Store's parts share: explicit transactions, SQLite's error kinds, the method guard.

:class:`StoreBase` is the connection as the Store's query mixins see it (``Recommendations``
in :mod:`advisor.cache._recommendations`, ``JobQueue`` in :mod:`advisor.cache._jobs`); the
Store itself (:mod:`advisor.cache._store`) opens the file and handles damage. Every public
query method is wrapped in :func:`guarded`.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sqlite3
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from probes import MpadviseError

if TYPE_CHECKING:
    import sqlite_utils

BUSY_TIMEOUT_S = 30.0

# Primary SQLite result codes, to tell damage from contention from a missing directory.
_SQLITE_BUSY = 5
_SQLITE_LOCKED = 6
_SQLITE_CORRUPT = 11
_SQLITE_NOTADB = 26

_F = TypeVar("_F", bound=Callable[..., Any])


@contextlib.contextmanager
def transaction(conn: sqlite3.Connection, begin: str) -> Iterator[None]:
    """Run the block in one transaction: ``begin`` (``"BEGIN"`` or ``"BEGIN IMMEDIATE"``),
    then COMMIT, or ROLLBACK when the block or the commit fails.

    Args:
        conn: a connection in autocommit mode (``isolation_level=None``).
        begin: the statement that opens the transaction.
    """
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


def error_kind(exc: BaseException) -> str:
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


def store_error(path: Path, exc: BaseException, kind: str) -> MpadviseError:
    """The one line a user reads for an SQLite error of ``kind`` (see :func:`error_kind`) on
    the cache database at ``path``."""
    if kind == "busy":
        return MpadviseError(
            f"cache database {path} stayed locked by another process for more than "
            f"{BUSY_TIMEOUT_S:.0f} s; try again when the other mpadvise command finishes"
        )
    if kind == "corrupt":
        return MpadviseError(f"cache database {path} is damaged ({exc}); move it aside or delete it")
    return MpadviseError(
        f"cache database {path} cannot be used ({exc}); check that its directory is "
        "writable, or set MPADVISE_HOME to another directory"
    )


class StoreBase:
    """One SQLite connection shared by threads: its lock, its transactions, its errors.

    Attributes:
        path: the database file.
    """

    path: Path
    _lock: threading.RLock
    _db: sqlite_utils.Database | None

    @property
    def db(self) -> sqlite_utils.Database:
        """The open ``sqlite_utils.Database`` (for migrations and tests; use the methods)."""
        if self._db is None:
            raise MpadviseError(f"the cache database {self.path} is closed")
        return self._db

    def _recover(self, reason: str) -> None:
        """Replace a database found damaged mid-command with a fresh one (the Store does)."""
        raise NotImplementedError  # abstract: Store implements it

    def _as_error(self, exc: BaseException, kind: str) -> MpadviseError:
        """The one line a user reads for an SQLite error of ``kind`` (see :func:`error_kind`)."""
        return store_error(self.path, exc, kind)

    @contextlib.contextmanager
    def _write(self) -> Iterator[sqlite_utils.Database]:
        # The write lock is taken before the first read, so a read-then-write never has to
        # upgrade a snapshot that another writer has made stale.
        db = self.db
        with transaction(db.conn, "BEGIN IMMEDIATE"):
            yield db

    @contextlib.contextmanager
    def _read(self) -> Iterator[sqlite_utils.Database]:
        # One snapshot for several SELECTs: a recommendation and its trials always match.
        db = self.db
        with transaction(db.conn, "BEGIN"):
            yield db


def guarded(method: _F) -> _F:
    """Serialise a Store method and turn SQLite errors into one-line MpadviseErrors.

    Damage discovered mid-command moves the file aside and retries the method once on a
    fresh database, so a corrupt cache never costs more than its contents.
    """

    @functools.wraps(method)
    def wrapper(self: StoreBase, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            try:
                return method(self, *args, **kwargs)
            except sqlite3.Error as exc:
                kind = error_kind(exc)
                if kind != "corrupt":
                    raise self._as_error(exc, kind) from exc
                self._recover(str(exc))
            try:
                return method(self, *args, **kwargs)
            except sqlite3.Error as exc:
                raise self._as_error(exc, error_kind(exc)) from exc

    return wrapper  # type: ignore[return-value]


def nothing_cached_yet(path: Path) -> bool:
    """Whether the cache file at ``path`` does not exist yet but could be created there.

    Such a cache holds nothing, so readers can skip it without creating it. A location where
    it could not be created (below a regular file, in a read-only directory) is not "nothing
    cached yet": readers open it anyway, so that the store warns about it once.

    Args:
        path: the database file.

    Returns:
        True when ``path`` does not exist and its nearest existing ancestor is a writable
        directory.
    """
    if path.exists():
        return False
    for ancestor in path.parents:
        if ancestor.exists():
            return ancestor.is_dir() and os.access(ancestor, os.W_OK | os.X_OK)
    return False
