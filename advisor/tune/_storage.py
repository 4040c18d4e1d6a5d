"""The Optuna study storage: its URL (never shown with its password: ``shown_url``), opening
it, and riding out its outages. Optuna and SQLAlchemy are imported only here, in ``_study`` and
in ``_study_status``."""

from __future__ import annotations

import contextlib
import logging
import os
import random
import re
import socket
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from advisor._log import get_logger
from probes import MpadviseError, UsageError

if TYPE_CHECKING:
    from advisor.tune._space import Measured

HEARTBEAT_ENV = "MPADVISE_HEARTBEAT_S"
GRACE_ENV = "MPADVISE_GRACE_S"
MAX_RETRY_ENV = "MPADVISE_MAX_RETRY"
# Where the storage URL may come from besides --storage, so that its password stays out of ps.
STORAGE_ENV = "MPADVISE_STORAGE"
STORAGE_FILE_ENV = "MPADVISE_STORAGE_FILE"
# A server that drops packets would otherwise keep the first connection waiting for minutes.
CONNECT_TIMEOUT_S = 10
# Tries at opening a storage that other processes are making at the same moment.
OPEN_ATTEMPTS = 5
# How long a running search keeps retrying a study storage that went away (a server restarted,
# a network cut), before it ends in one line; its finished measurements are kept meanwhile.
STORAGE_RETRY_ENV = "MPADVISE_STORAGE_RETRY_S"
STORAGE_RETRY_S = 120


@dataclass(frozen=True)
class Heartbeat:
    """Heartbeats every ``interval_s``; after ``grace_s`` without one any worker fails the trial as
    stale, and a copy is queued up to ``max_retry`` times before its candidate counts as a crash."""

    interval_s: int = 30
    grace_s: int = 120
    max_retry: int = 2

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> Heartbeat:
        interval = whole_env(environ, HEARTBEAT_ENV, cls.interval_s, minimum=1, unit="seconds")
        grace = whole_env(environ, GRACE_ENV, 4 * interval, minimum=1, unit="seconds")
        if grace <= interval:
            raise MpadviseError(f"{GRACE_ENV}={grace} is not allowed with {HEARTBEAT_ENV}={interval}; expected more "
                                "seconds than one heartbeat interval, so that a live trial is never taken for a dead "
                                f"one (e.g. {4 * interval})")
        return cls(interval, grace, whole_env(environ, MAX_RETRY_ENV, cls.max_retry, minimum=0, unit="retries"))


def whole_env(environ: Mapping[str, str], name: str, default: int, *, minimum: int, unit: str) -> int:
    text = environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise MpadviseError(f"{name}={text!r} is not allowed; expected whole {unit} >= {minimum}, or unset for {default}")
    return value


def storage_url(url: str) -> str:
    """The URL Optuna opens for ``url``: a PostgreSQL URL that names no driver gets psycopg, the
    driver of the ``postgres`` extra (SQLAlchemy's own default is psycopg2)."""
    scheme, sep, rest = url.partition("://")
    return f"postgresql+psycopg://{rest}" if sep and scheme in ("postgresql", "postgres") else url


def shared_storage(url: str | None) -> bool:
    """Whether studies in this storage are shared by many workers: any URL but an SQLite file."""
    return url is not None and not url.startswith("sqlite")


def shown_url(url: str | None) -> str | None:
    """``url`` with its password masked and any ``password`` query parameter dropped (a password
    may hold ``/`` or an unescaped ``@``: it runs from the user's ``:`` to the last ``@``)."""
    if url is None:
        return None
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.startswith("sqlite"):
        return url
    authority, at, after = rest.partition("?")[0].rpartition("@")
    if at:
        user, colon, _ = authority.partition(":")
        rest = f"{user}{':***' if colon else ''}@{after}{rest[len(authority) + 1 + len(after):]}"
    masked = f"{scheme}://{rest}"
    import sqlalchemy.engine
    import sqlalchemy.exc

    try:
        parsed = sqlalchemy.engine.make_url(masked)
    except (sqlalchemy.exc.ArgumentError, ValueError):  # not a URL SQLAlchemy reads: mask by hand
        return re.sub(r"([?&])[^&=]*password[^&=]*=[^&]*&?", r"\1", masked, flags=re.IGNORECASE).rstrip("?&")
    query = {k: v for k, v in parsed.query.items() if "password" not in k.lower()}
    return parsed.set(query=query).render_as_string(hide_password=True)


def resolve_storage(given: str | None, environ: Mapping[str, str]) -> str | None:
    """The storage URL a tune uses: ``--storage``; else ``MPADVISE_STORAGE``; else the first line
    of the file ``MPADVISE_STORAGE_FILE`` names (this user's and private, as an SSH key must be);
    else ``None`` (the default storage)."""
    if given is not None:
        return given
    url = environ.get(STORAGE_ENV, "").strip()
    path = environ.get(STORAGE_FILE_ENV, "").strip()
    if url and path:
        raise UsageError(f"both {STORAGE_ENV} and {STORAGE_FILE_ENV} are set; expected one: unset the other, or "
                            "give --storage")
    if url or not path:
        return url or None
    import stat

    where = f"{STORAGE_FILE_ENV}={path}"
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as exc:
        raise UsageError(f"cannot read {where}: {exc.strerror or exc}; expected a file of yours (mode 600) holding "
                            "the storage URL on its first line") from None
    with os.fdopen(fd, encoding="utf-8", errors="replace") as handle:
        st = os.fstat(handle.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise UsageError(f"cannot read {where}: not a regular file; expected a file holding the storage URL")
        if st.st_uid != os.getuid():
            raise UsageError(f"refusing {where}: it is owned by uid {st.st_uid}, not you; it holds a password, so "
                                "it must be yours")
        if stat.S_IMODE(st.st_mode) & 0o077:
            raise UsageError(f"refusing {where}: others may read it (mode {stat.S_IMODE(st.st_mode):o}); it holds a "
                                f"password: chmod 600 {path}")
        lines = [ln.strip() for ln in handle.read(65536).splitlines() if ln.strip()]
    if not lines:
        raise UsageError(f"{where} is empty; expected the storage URL on its first line")
    return lines[0]


def storage_error(url: str, exc: BaseException) -> str:
    """The one line that says why the study storage ``url`` cannot be opened, and what to do."""
    shown = shown_url(url)
    missing = _missing_module(exc)
    if missing is not None:
        fix = ('pip install "mpadvise[postgres]" (postgresql:// URLs use its psycopg)' if is_postgres(url)
               else "install the driver its URL names")
        return f"cannot open the Optuna study storage {shown!r}: its database driver {missing} is not installed; {fix}"
    return (f"cannot open the Optuna study storage {shown!r}: {first_line(exc)}; expected a database this machine "
            "can reach, such as postgresql://user@host:5432/studies or sqlite:///path/studies.db")


def storage_failure(url: str, exc: BaseException) -> MpadviseError:
    """A usage error (exit 2) where SQLAlchemy cannot read the URL itself; else an error of this
    run (exit 1): an unreachable server, a refused login, a missing driver."""
    import sqlalchemy.engine

    error = MpadviseError
    if _missing_module(exc) is None:
        try:  # a driver the URL names but that is not installed counts as known
            sqlalchemy.engine.make_url(storage_url(url)).get_dialect()
        except ImportError:
            pass
        except Exception:  # not a URL, a port that is not a number, an unknown database or driver
            error = UsageError
    return error(storage_error(url, exc))


def is_postgres(url: str) -> bool:
    return url.partition("://")[0].split("+")[0] in ("postgresql", "postgres")


def timeout_kwargs(url: str) -> dict[str, Any]:
    """SQLAlchemy engine arguments that bound a PostgreSQL server's first connection."""
    return {"connect_args": {"connect_timeout": CONNECT_TIMEOUT_S}} if is_postgres(url) and "connect_timeout" not in url else {}


def error_chain(exc: BaseException | None) -> Iterator[BaseException]:
    """``exc``, then each error it was raised from or while handling, each once."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def _missing_module(exc: BaseException | None) -> str | None:
    missing = [inner.name or first_line(inner) for inner in error_chain(exc) if isinstance(inner, ImportError)]
    return missing[-1] if missing else None


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def root_line(exc: BaseException) -> str:
    """The first line of the innermost error in ``exc``'s chain: the server's own words."""
    *_, innermost = error_chain(exc)
    return first_line(innermost)


def unreachable(exc: BaseException) -> bool:
    """Whether ``exc`` says the storage cannot be reached now, not a refusal of the request."""
    import optuna
    import sqlalchemy.exc

    gone = (sqlalchemy.exc.OperationalError, sqlalchemy.exc.InterfaceError, sqlalchemy.exc.DisconnectionError,
            sqlalchemy.exc.TimeoutError)
    if any(isinstance(inner, gone) or (isinstance(inner, sqlalchemy.exc.DBAPIError) and inner.connection_invalidated)
           for inner in error_chain(exc)):
        return True
    # An Optuna storage error whose cause is lost with its message: the server's words say.
    said = str(exc).lower()
    words = ("connection", "server closed", "terminating", "could not connect")
    return isinstance(exc, optuna.exceptions.StorageInternalError) and any(w in said for w in words)


_OPENED: dict[str, tuple[Any, Heartbeat]] = {}
_OPENED_LOCK = threading.Lock()


def open_storage(url: str) -> tuple[Any, Heartbeat]:
    """The Optuna RDB storage for ``url`` and its heartbeat settings, opened once per process."""
    import optuna
    import sqlalchemy.exc

    with _OPENED_LOCK:
        if url in _OPENED:
            return _OPENED[url]
        heartbeat = Heartbeat.from_environ(os.environ)
        # Optuna's RDB storage logs through a logger of its module's name.
        logging.getLogger(optuna.storages.RDBStorage.__module__).addFilter(_outage_noise)
        # SQLAlchemy logs, with a traceback, what fails while it cleans up after an error the search
        # is handed anyway; with no handler of its own, Python would print it on the terminal.
        if not any(isinstance(h, logging.NullHandler) for h in logging.getLogger("sqlalchemy").handlers):
            logging.getLogger("sqlalchemy").addHandler(logging.NullHandler())
        engine_kwargs = timeout_kwargs(url)
        if not url.startswith("sqlite"):
            engine_kwargs["pool_pre_ping"] = True  # a server restarted since the last trial drops old connections
        for attempt in range(1, OPEN_ATTEMPTS + 1):
            try:
                with quiet():
                    backend = optuna.storages.RDBStorage(
                        storage_url(url), engine_kwargs=engine_kwargs, heartbeat_interval=heartbeat.interval_s,
                        grace_period=heartbeat.grace_s,
                        heartbeat_stale_trial_callback=optuna.storages.RetryHeartbeatStaleTrialCallback(
                            max_retry=heartbeat.max_retry),
                    )
                break
            except Exception as exc:
                # Workers opening a fresh database at once race to create its tables and stamp its
                # schema version (or meet SQLite's lock); the loser finds them made when it retries.
                raced = any(isinstance(inner, (sqlalchemy.exc.IntegrityError, sqlalchemy.exc.ProgrammingError))
                            or (isinstance(inner, sqlalchemy.exc.OperationalError)
                                and any(words in str(inner) for words in ("already exists", "database is locked")))
                            for inner in error_chain(exc))
                if attempt == OPEN_ATTEMPTS or not raced:
                    raise storage_failure(url, exc) from None
                time.sleep((0.2 + random.random() / 2) * attempt)
        _OPENED[url] = (backend, heartbeat)
        return _OPENED[url]


def _outage_noise(record: logging.LogRecord) -> bool:
    """Drops Optuna's multi-line log of a lost connection: the search says it in one line."""
    return not str(record.msg).startswith("Caught an error from sqlalchemy")


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Silence Optuna's info logs and its warnings that heartbeats and retries are experimental."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        # Optuna expects heartbeats with Study.optimize; this search beats for its own trials.
        warnings.filterwarnings("ignore", message="Heartbeat of storage")
        yield


def storage_exists(storage: str) -> bool:
    """Whether the storage may hold studies already (reading an SQLite file must not make it)."""
    path = sqlite_path(storage)
    return not storage.startswith("sqlite") or (path != ":memory:" and os.path.isfile(path))


def sqlite_path(storage: str) -> str:
    return storage.partition(":///")[2].partition("?")[0]


def storage_retry_s(environ: Mapping[str, str]) -> int:
    return whole_env(environ, STORAGE_RETRY_ENV, STORAGE_RETRY_S, minimum=0, unit="seconds")


@dataclass
class Worker:
    """This process as one worker of the study (``host:pid``), retrying its calls on the storage.
    ``untold``: results measured but not in the study yet (an outage), by trial number."""

    name: str
    backend: Any
    heartbeat: Heartbeat | None
    sleep: Callable[[float], None]
    storage: str | None = None
    retry_s: int = STORAGE_RETRY_S
    untold: dict[int, Measured] = field(default_factory=dict)

    @classmethod
    def of(cls, storage: str | None, sleep: Callable[[float], None] = time.sleep, *, opened: bool = True) -> Worker:
        """This process's worker; ``opened``: with the storage opened, for its heartbeats."""
        backend, heartbeat = open_storage(storage) if storage is not None and opened else (None, None)
        return cls(f"{socket.gethostname()}:{os.getpid()}", backend, heartbeat, sleep, storage,
                   storage_retry_s(os.environ))

    def call(self, what: str, fn: Callable[[], Any]) -> Any:
        """``fn()``, retried with backoff for up to ``retry_s`` seconds while the storage is
        unreachable (then StorageLost); ``what`` says the call in words."""
        deadline, delay = None, 0.5
        while True:
            try:
                result = fn()
            except Exception as exc:
                if not unreachable(exc):
                    raise
                now = time.monotonic()
                if deadline is None:
                    deadline = now + self.retry_s
                    get_logger().warning(
                        f"the Optuna study storage {shown_url(self.storage)!r} is unreachable ({root_line(exc)}); "
                        f"{what}: retrying for up to {self.retry_s} s ({STORAGE_RETRY_ENV})")
                if now >= deadline:
                    raise StorageLost(what, exc) from None
                self.sleep(max(0.05, min(delay, deadline - now)))
                delay = min(2 * delay, 10.0)
            else:
                if deadline is not None:
                    get_logger().info(f"the Optuna study storage is back: {what} went through")
                return result


class StorageLost(Exception):
    """The study storage stayed unreachable through the retries of one call."""

    def __init__(self, what: str, cause: BaseException) -> None:
        super().__init__(f"{what}: {root_line(cause)}")


def lost_message(storage: str | None, why: str, worker: Worker, runs: int | None, *, retried: int | None) -> str:
    """The line a tune ends with when its storage is lost, saying what was kept (``runs``: ``None``
    before the search began)."""
    after = f" (retried for {retried} s, {STORAGE_RETRY_ENV})" if retried is not None else ""
    if runs is None:
        kept = "nothing of this tune is in the study yet"
    elif worker.untold:
        told = "; ".join(f"trial {n} {m.candidate.label}: {_result_words(m)}" for n, m in sorted(worker.untold.items()))
        kept = (f"this worker's results not stored in the study, kept in this tune's ranking and listed here: {told}; "
                f"the {runs - len(worker.untold)} stored before stay in the study")
    else:
        kept = f"every result this worker measured ({runs}) is stored in the study"
    return (f"lost the Optuna study storage {shown_url(storage)!r}{after}: {why}; {kept}; run the same command again "
            "once the server is back to continue")


def _result_words(m: Measured) -> str:
    return f"{m.goodput:,.1f} samples/s, stable" if m.feasible and m.stable else m.outcome or "not stable"


@contextlib.contextmanager
def riding_out(storage: str) -> Iterator[Worker]:
    """A worker for a tune's study reads outside its search (MpadviseError once its retries end)."""
    worker = Worker.of(storage, opened=False)
    try:
        yield worker
    except StorageLost as exc:
        raise MpadviseError(lost_message(storage, str(exc), worker, None, retried=worker.retry_s)) from None
