"""What the Store's parts share: explicit transactions, SQLite's error kinds, the method guard."""

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

_F = TypeVar("_F", bound=Callable[..., Any])


@contextlib.contextmanager
def transaction(conn: sqlite3.Connection, begin: str) -> Iterator[None]:
    """Run the block in one transaction opened by ``begin`` on an autocommit connection:
    COMMIT, or ROLLBACK when the block or the commit fails (a failed COMMIT, on a full disk or
    an I/O error, leaves the transaction open: closing it keeps the connection usable)."""
    conn.execute(begin)
    try:
        yield
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise


def error_kind(exc: BaseException) -> str:
    """``"corrupt"``, ``"busy"`` or ``"other"`` for an exception raised by sqlite3."""
    code = getattr(exc, "sqlite_errorcode", None)
    if code is not None:
        primary = code & 0xFF  # SQLite's primary result codes
        if primary in (11, 26):  # SQLITE_CORRUPT, SQLITE_NOTADB
            return "corrupt"
        return "busy" if primary in (5, 6) else "other"  # SQLITE_BUSY, SQLITE_LOCKED
    # Python < 3.11 has no error codes on the exception: fall back to SQLite's messages.
    message = str(exc).lower()
    if "malformed" in message or "not a database" in message:
        return "corrupt"
    return "busy" if "locked" in message or "busy" in message else "other"


def store_error(path: Path, exc: BaseException) -> MpadviseError:
    """The one line a user reads for an SQLite error on the cache at ``path``."""
    kind = error_kind(exc)
    if kind == "busy":
        return MpadviseError(f"cache database {path} stayed locked by another process for more than "
                             f"{BUSY_TIMEOUT_S:.0f} s; try again when the other mpadvise command finishes")
    if kind == "corrupt":
        return MpadviseError(f"cache database {path} is damaged ({exc}); move it aside or delete it")
    return MpadviseError(f"cache database {path} cannot be used ({exc}); check that its directory is "
                         "writable, or set MPADVISE_HOME to another directory")


class StoreBase:
    """What the Store's parts share: the connection and its transactions."""

    path: Path
    _lock: threading.RLock
    _db: sqlite_utils.Database | None
    _recover: Callable[[str], None]  # move a damaged file aside and reopen (the Store's)

    @property
    def db(self) -> sqlite_utils.Database:
        if self._db is None:
            raise MpadviseError(f"the cache database {self.path} is closed")
        return self._db

    @contextlib.contextmanager
    def _write(self) -> Iterator[sqlite_utils.Database]:
        # The write lock is taken before the first read, so a read-then-write never has to
        # upgrade a snapshot that another writer has made stale.
        with transaction(self.db.conn, "BEGIN IMMEDIATE"):
            yield self.db

    @contextlib.contextmanager
    def _read(self) -> Iterator[sqlite_utils.Database]:
        # One snapshot for several SELECTs: a recommendation and its trials always match.
        with transaction(self.db.conn, "BEGIN"):
            yield self.db


def guarded(method: _F) -> _F:
    """Serialise a Store method and turn SQLite errors into one-line MpadviseErrors. Damage found
    mid-command moves the file aside and retries the method once on a fresh database, so a
    corrupt cache never costs more than its contents."""

    @functools.wraps(method)
    def wrapper(self: StoreBase, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            try:
                return method(self, *args, **kwargs)
            except sqlite3.Error as exc:
                if error_kind(exc) != "corrupt":
                    raise store_error(self.path, exc) from exc
                self._recover(str(exc))
            try:
                return method(self, *args, **kwargs)
            except sqlite3.Error as exc:
                raise store_error(self.path, exc) from exc

    return wrapper  # type: ignore[return-value]


def nothing_cached_yet(path: Path) -> bool:
    """Whether the cache file does not exist yet but could be created (readers skip it); one that
    could not be (in a read-only directory...) is opened anyway, so that the store warns once."""
    if path.exists():
        return False
    for ancestor in path.parents:
        if ancestor.exists():
            return ancestor.is_dir() and os.access(ancestor, os.W_OK | os.X_OK)
    return False
