"""The Optuna search over precision mode, loss scaling and micro-batch size.

The only module that imports optuna. The trial runner is passed in (``evaluate``), so the
search logic runs in milliseconds against a fake in the unit tests. Unstable and out-of-memory
candidates are reported as constraint violations (``Trial.set_constraint``), which TPE learns
from, not as failures, which it ignores.

One study may be shared by many workers (``--storage postgresql://...`` on several machines of
the same hardware). Each worker claims a trial's candidate in the study before running it,
reads the others' results and claims before every proposal, and runs nothing that another has
run or is running. A worker's trial sends heartbeats; a trial whose worker goes silent is
failed after a grace period, and Optuna's retry callback queues it again for a live worker.
A storage that goes away mid-search (a server restarted) is waited for: each call is retried
with backoff for ``MPADVISE_STORAGE_RETRY_S`` seconds, a finished result kept meanwhile; a
storage that stays away ends the search in one line that names it and what was not stored.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import random
import re
import socket
import threading
import time
import warnings
import zlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from advisor._log import get_logger
from advisor.tune._options import TuneOptions
from advisor.tune._space import (
    FP16_GROWTH_INTERVALS,
    FP16_INIT_SCALES,
    SPLIT_KEEPS,
    Candidate,
    Measured,
    SearchSpace,
    preference_key,
    scales_loss,
    upper_bound,
)
from probes import MpadviseError, UsageError

STUDY_ATTR_SPACE = "mpadvise:space"
STUDY_ATTR_REPLICATE = "mpadvise:replicate"  # fp32 under another seed: the verdicts' spread
STUDY_ATTR_HARDWARE = "mpadvise:hardware"  # the hardware fingerprint every trial of the study ran on
# The workload fingerprint and model signature of the fp32 reference its verdicts were judged
# against: a study name covers the script and its arguments, not what the script reads besides
# (an environment variable, a config file), which can change the model under the same name.
STUDY_ATTR_WORKLOAD = "mpadvise:workload"
TRIAL_ATTR_RESULT = "mpadvise:result"
# The candidate a trial runs, the trial's number and the worker running it; written before the
# worker looks for rivals, so that of two workers that propose one candidate at once, at least
# one sees the other. A retried copy inherits it with the old number, which no longer counts.
TRIAL_ATTR_CLAIM = "mpadvise:claim"
TRIAL_ATTR_CLOSED = "mpadvise:closed"  # why a trial ended without a result (FAIL), in words
MAX_DUPLICATE_PROPOSALS = 3

HEARTBEAT_ENV = "MPADVISE_HEARTBEAT_S"
GRACE_ENV = "MPADVISE_GRACE_S"
MAX_RETRY_ENV = "MPADVISE_MAX_RETRY"
# How long a running search keeps retrying a study storage that went away (a server restarted,
# a network cut), before it ends in one line; its finished measurements are kept meanwhile.
STORAGE_RETRY_ENV = "MPADVISE_STORAGE_RETRY_S"
STORAGE_RETRY_S = 120
# Where the storage URL may come from besides --storage, so that its password stays out of ps.
STORAGE_ENV = "MPADVISE_STORAGE"
STORAGE_FILE_ENV = "MPADVISE_STORAGE_FILE"
POSTGRES_INSTALL = 'pip install "mpadvise[postgres]"'
# A server that drops packets would otherwise keep the first connection waiting for minutes.
CONNECT_TIMEOUT_S = 10
# Tries at opening a storage that other processes are making at the same moment.
OPEN_ATTEMPTS = 5
# How often a worker with nothing left but candidates others are running looks again (seconds;
# never longer than the heartbeat interval, so a silent worker's trial is taken up promptly).
WAIT_POLL_S = 5.0


@dataclass
class SearchOutcome:
    """What the search ran and why it stopped."""

    measured: dict[Candidate, Measured] = field(default_factory=dict)
    order: list[Candidate] = field(default_factory=list)  # candidates in the order they ran
    # Proposals the priors ruled out, never run (here or in the resumed study), with the reason.
    pruned: dict[Candidate, str] = field(default_factory=dict)
    runs: int = 0  # trials actually run in this invocation (resumed ones are not counted)
    resumed: int = 0  # results taken from the study: an earlier run's, or another worker's
    stop_reason: str = ""
    wall_s: float = 0.0


def _suggest(trial: Any, space: SearchSpace) -> Candidate:
    mode = trial.suggest_categorical("mode", list(space.modes))
    micro = trial.suggest_categorical("micro_batch", list(space.micro_batches)) if space.micro_batches else None
    # Under FSDP2, a 16-bit mode's gradients may be reduced in fp32 or in its own dtype.
    reduce_options = space.reduce_options(mode)
    reduce = space.reduce_dtype(mode, trial.suggest_categorical("reduce_dtype", reduce_options)) if reduce_options else None
    if not scales_loss(mode):
        return space.normalise(Candidate(mode, micro, reduce_dtype=reduce))
    limits = space.limits
    kind = trial.suggest_categorical("loss_scale", [k for k in ("dynamic", "static") if k in limits.loss_scale_kinds])
    # Where the loss scale's settings cannot be applied (the HF Trainer), GradScaler's defaults
    # are the only choice, so the sampler is not offered settings that would never run.
    init = trial.suggest_categorical("init_scale", list(FP16_INIT_SCALES) if limits.loss_scale_settings else [65536.0])
    growth = None
    if kind == "dynamic":
        growth = trial.suggest_categorical("growth_interval", list(FP16_GROWTH_INTERVALS) if limits.loss_scale_settings else [2000])
    return space.normalise(Candidate(mode, micro, kind, init, growth, reduce))


@dataclass(frozen=True)
class Heartbeat:
    """How a worker shows that its trial is alive, and what becomes of one that goes silent.

    Attributes:
        interval_s: seconds between heartbeats of a running trial.
        grace_s: seconds without a heartbeat after which any worker fails the trial as stale;
            Optuna's retry callback then queues a copy for a live worker.
        max_retry: how many copies of a stale trial are queued; after that its candidate is
            given up as a crash.
    """

    interval_s: int = 30
    grace_s: int = 120
    max_retry: int = 2

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> Heartbeat:
        """The settings from ``MPADVISE_HEARTBEAT_S``, ``MPADVISE_GRACE_S`` (default: four
        intervals) and ``MPADVISE_MAX_RETRY``; the defaults where they are unset or empty.

        Raises:
            MpadviseError: a value that is not a whole number in range, naming the variable.
        """
        interval = _whole_env(environ, HEARTBEAT_ENV, cls.interval_s, minimum=1, unit="seconds")
        grace = _whole_env(environ, GRACE_ENV, 4 * interval, minimum=1, unit="seconds")
        if grace <= interval:
            raise MpadviseError(
                f"{GRACE_ENV}={grace} is not allowed with {HEARTBEAT_ENV}={interval}; expected more seconds than "
                f"one heartbeat interval, so that a live trial is never taken for a dead one (e.g. {4 * interval})"
            )
        return cls(interval, grace, _whole_env(environ, MAX_RETRY_ENV, cls.max_retry, minimum=0, unit="retries"))


def _whole_env(environ: Mapping[str, str], name: str, default: int, *, minimum: int, unit: str) -> int:
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
    if sep and scheme in ("postgresql", "postgres"):
        return f"postgresql+psycopg://{rest}"
    return url


def shared_storage(url: str | None) -> bool:
    """Whether studies in this storage are shared by many workers: a database server (any URL
    but an SQLite file) rather than one machine's file or memory. A shared study is joined as
    it stands, never started afresh, since other workers may be in it."""
    return url is not None and not url.startswith("sqlite")


def shown_url(url: str | None) -> str | None:
    """``url`` with its password masked and any ``password`` query parameter dropped, fit for
    messages, reports, JSON and cache records.

    A password may hold ``/`` (generated secrets often do) or even an unescaped ``@``: for a
    database server, everything between the user's ``:`` and the last ``@`` before the host is
    the password. An SQLite file's URL carries none, and is shown as given.
    """
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
    """The storage URL a tune uses: ``--storage`` when given; else ``MPADVISE_STORAGE``; else the
    first line of the file ``MPADVISE_STORAGE_FILE`` names; else ``None`` (the default storage).

    The variables keep a password out of ``ps`` and shell history. The file must be this
    user's and private (no access for group or others), as an SSH key must.

    Raises:
        UsageError: both variables set, or a file that cannot be read, is not private or is
            empty; one line naming the variable.
    """
    if given is not None:
        return given
    url = environ.get(STORAGE_ENV, "").strip()
    path = environ.get(STORAGE_FILE_ENV, "").strip()
    if url and path:
        raise UsageError(f"both {STORAGE_ENV} and {STORAGE_FILE_ENV} are set; expected one: unset the other, or "
                            "give --storage")
    if url:
        return url
    if not path:
        return None
    return _storage_from_file(path)


def _storage_from_file(path: str) -> str:
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
        fix = (f"{POSTGRES_INSTALL} (postgresql:// URLs use its psycopg)" if _is_postgres(url)
               else "install the driver its URL names")
        return f"cannot open the Optuna study storage {shown!r}: its database driver {missing} is not installed; {fix}"
    return (f"cannot open the Optuna study storage {shown!r}: {_first_line(exc)}; expected a database this machine "
            "can reach, such as postgresql://user@host:5432/studies or sqlite:///path/studies.db")


def storage_failure(url: str, exc: BaseException) -> MpadviseError:
    """The error for a study storage that cannot be opened: a usage error (exit 2) where the URL
    itself is one SQLAlchemy cannot read (an unknown scheme or driver name, not a URL at all),
    since the value given is wrong; otherwise (an unreachable server, a refused login, a driver
    not installed) an error of this run (exit 1). Its message is :func:`storage_error`'s."""
    if _missing_module(exc) is None and not _readable_url(url):
        return UsageError(storage_error(url, exc))
    return MpadviseError(storage_error(url, exc))


def _readable_url(url: str) -> bool:
    """Whether SQLAlchemy reads ``url`` as a URL of a database it knows (a driver it names but
    that is not installed counts as known: the URL is right, this machine lacks the driver)."""
    import sqlalchemy.engine

    try:
        sqlalchemy.engine.make_url(storage_url(url)).get_dialect()
    except ImportError:
        return True
    except Exception:  # not a URL, a port that is not a number, an unknown database or driver
        return False
    return True


def _is_postgres(url: str) -> bool:
    return url.partition("://")[0].split("+")[0] in ("postgresql", "postgres")


def _chain(exc: BaseException | None) -> Iterator[BaseException]:
    """``exc``, then each error it was raised from or while handling, outermost first, each once
    (a chain can loop back on itself)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def _missing_module(exc: BaseException | None) -> str | None:
    """The module whose import failed somewhere in ``exc``'s chain (the innermost), or ``None``."""
    missing = None
    for inner in _chain(exc):
        if isinstance(inner, ImportError):
            missing = inner.name or _first_line(inner)
    return missing


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


_OPENED: dict[str, tuple[Any, Heartbeat]] = {}
_OPENED_LOCK = threading.Lock()


def _open(url: str) -> tuple[Any, Heartbeat]:
    """The Optuna RDB storage for ``url`` (with heartbeats and retries of stale trials) and its
    heartbeat settings; opened once per process and URL.

    Raises:
        UsageError: (exit 2) a URL that is not one, or names an unknown database or driver.
        MpadviseError: a missing driver, an unreachable or refusing server, a bad heartbeat
            setting; one line.
    """
    with _OPENED_LOCK:
        if url not in _OPENED:
            heartbeat = Heartbeat.from_environ(os.environ)
            _OPENED[url] = (_open_rdb(url, heartbeat), heartbeat)
        return _OPENED[url]


def _open_rdb(url: str, heartbeat: Heartbeat) -> Any:
    import optuna

    # Optuna's RDB storage logs through a logger of its module's name.
    logging.getLogger(optuna.storages.RDBStorage.__module__).addFilter(_OUTAGE_NOISE)
    # SQLAlchemy logs what fails while it cleans up after an error the search is handed anyway
    # ("Error closing cursor" once a Ctrl-C stopped a write), with a traceback: with no handler
    # of the program's own, Python would print it on the terminal. Handlers the program set on
    # the root logger still receive it.
    if not any(isinstance(h, logging.NullHandler) for h in logging.getLogger("sqlalchemy").handlers):
        logging.getLogger("sqlalchemy").addHandler(logging.NullHandler())
    engine_kwargs: dict[str, Any] = {}
    if not url.startswith("sqlite"):
        engine_kwargs["pool_pre_ping"] = True  # a server restarted since the last trial drops old connections
    if _is_postgres(url) and "connect_timeout" not in url:
        engine_kwargs["connect_args"] = {"connect_timeout": CONNECT_TIMEOUT_S}
    for attempt in range(OPEN_ATTEMPTS):
        try:
            with _quiet():
                return optuna.storages.RDBStorage(
                    storage_url(url), engine_kwargs=engine_kwargs, heartbeat_interval=heartbeat.interval_s,
                    grace_period=heartbeat.grace_s,
                    heartbeat_stale_trial_callback=optuna.storages.RetryHeartbeatStaleTrialCallback(
                        max_retry=heartbeat.max_retry),
                )
        except Exception as exc:
            # Workers that open a fresh database at the same moment race to create its tables and
            # to stamp its schema version; the loser finds them made when it looks again.
            if attempt < OPEN_ATTEMPTS - 1 and _creation_race(exc):
                time.sleep((0.2 + random.random() / 2) * (attempt + 1))
                continue
            raise storage_failure(url, exc) from None
    raise AssertionError("unreachable")  # the loop returns or raises


def _creation_race(exc: BaseException) -> bool:
    """Whether ``exc`` is what another process making the same storage at the same moment
    causes: a table or a version row it made between this one's look and its own write
    (PostgreSQL's CREATE TABLE IF NOT EXISTS is not safe against that, nor is SQLite's check
    before CREATE TABLE: "table studies already exists"), or SQLite's lock held while it does."""
    import sqlalchemy.exc

    return any(isinstance(inner, (sqlalchemy.exc.IntegrityError, sqlalchemy.exc.ProgrammingError))
               or (isinstance(inner, sqlalchemy.exc.OperationalError)
                   and any(words in str(inner) for words in ("already exists", "database is locked")))
               for inner in _chain(exc))


class _OutageNoise(logging.Filter):
    """Drops Optuna's multi-line log of a lost connection (the SQL and its parameters): the
    search says in one line that the storage is unreachable, and retries."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Caught an error from sqlalchemy")


_OUTAGE_NOISE = _OutageNoise()


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Silence Optuna's warnings that heartbeats and their retries are experimental."""
    import optuna

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        # Optuna expects heartbeats with Study.optimize; this search beats for its own trials.
        warnings.filterwarnings("ignore", message="Heartbeat of storage")
        yield


def check_storage(storage: str | None) -> None:
    """Open the Optuna storage once, so a bad URL fails before any trial runs.

    Raises:
        UsageError: (exit 2) a URL that is not one, or names an unknown database or driver.
        MpadviseError: naming the URL (its password masked) and the reason, in one line.
    """
    if storage is not None:
        _open(storage)


def check_study(storage: str | None, study_name: str, *, hardware: str, resume: bool, fresh: bool = False,
                spelling: tuple[str, str] = ("--resume", "--fresh")) -> None:
    """Refuse, before any trial runs, to continue a stored study measured on other hardware, or
    to delete one that holds finished trials unless ``fresh`` says so.

    Only a study this tune would continue is read for its hardware: a shared one, or any with
    ``resume``. A study of this machine that a tune without ``resume`` would start afresh is
    read for its finished trials: they are never deleted unasked.

    ``spelling`` names the two options as the caller takes them (the CLI's flags by default).

    Raises:
        UsageError: the study holds finished trials, and neither ``resume`` nor ``fresh`` was
            given; the line names both.
        MpadviseError: the study holds another hardware fingerprint, or the storage fails.
    """
    if storage is None:
        return
    if not (resume or shared_storage(storage)):
        held = None if fresh else kept_study(storage, study_name)
        if held is not None and held.finished:
            keep, drop = spelling
            raise UsageError(f"{held.describe()}; it is kept: pass {keep} to continue it, or {drop} to delete it "
                             "and start afresh")
        return
    import optuna

    backend, _ = _open(storage)
    try:
        with _quiet():
            study = optuna.load_study(study_name=study_name, storage=backend)
    except KeyError:  # no such study yet: this tune makes it
        return
    except Exception as exc:
        raise MpadviseError(storage_error(storage, exc)) from None
    _check_hardware(study, study_name, hardware, record=False)


@dataclass(frozen=True)
class KeptStudy:
    """What a stored study holds that a fresh start would delete.

    Attributes:
        name: the study's name.
        storage: its storage URL, password masked (:func:`shown_url`).
        finished: its finished trials that measured a candidate (the copy of an fp32 reference,
            measured outside the study, and proposals the priors ruled out not counted).
        last: when the latest of them finished (ISO date and time, to the minute), if known.
    """

    name: str
    storage: str
    finished: int
    last: str | None

    def describe(self) -> str:
        """``study 'x' in 'sqlite:///...' holds 4 finished trials from 2026-12-02 05:31``."""
        when = f" from {self.last}" if self.last else ""
        plural = "" if self.finished == 1 else "s"
        return f"study {self.name!r} in {self.storage!r} holds {self.finished} finished trial{plural}{when}"


def kept_study(storage: str | None, study_name: str) -> KeptStudy | None:
    """The stored study of that name and its finished trials, read without writing anything;
    ``None`` in memory, or where there is no such study (an SQLite file not made yet included).

    Raises:
        MpadviseError: the storage cannot be read, naming the URL (its password masked).
    """
    if storage is None or not _storage_exists(storage):
        return None
    studies = study_status(storage, study_name, missing_ok=True)
    if not studies:
        return None
    return KeptStudy(study_name, shown_url(storage) or storage, studies[0]["measured"], studies[0]["last_finished"])


def finished_trials(storage: str | None, study_name: str) -> int:
    """How many finished trials the stored study holds (0 in memory, or without the study); a
    storage that cannot be read counts none."""
    try:
        held = kept_study(storage, study_name)
    except MpadviseError:
        return 0
    return 0 if held is None else held.finished


def _storage_exists(storage: str) -> bool:
    """Whether the storage may hold studies already: any database server, or an SQLite file
    that exists (reading it must not make it)."""
    return not storage.startswith("sqlite") or _sqlite_file(storage) is not None


def _sqlite_file(storage: str) -> str | None:
    """The file an ``sqlite:///`` URL names, where it exists; ``None`` for no file, an
    in-memory database or a file that is not there."""
    path = storage.partition(":///")[2].partition("?")[0]
    return path if path and path != ":memory:" and os.path.isfile(path) else None


def _check_hardware(study: Any, study_name: str, hardware: str | None, *, record: bool) -> None:
    """Refuse a study whose trials ran on other hardware; with ``record``, name this hardware
    in a study that names none."""
    if hardware is None:
        return
    stored = study.user_attrs.get(STUDY_ATTR_HARDWARE)
    if stored is None:
        if record:
            study.set_user_attr(STUDY_ATTR_HARDWARE, hardware)
        return
    if stored != hardware:
        raise MpadviseError(
            f"study {study_name!r} holds trials measured on hardware {stored}, and this machine is {hardware}: "
            "measurements from different hardware never mix; give this machine its own study (the study name "
            "mpadvise tune chooses names the hardware)"
        )


def check_study_workload(storage: str | None, study_name: str, workload: Mapping[str, Any], *, resume: bool) -> bool:
    """Whether a stored study may be continued for this workload; read before anything is reused.

    A study keeps the workload fingerprint and model signature of the fp32 reference its
    verdicts were judged against. When this tune's fresh reference has others (the script read
    another environment variable, config file or data), those verdicts and the replicate belong
    to another workload. A study of this machine (``--resume``) is then not continued: where it
    holds finished trials, the tune refuses in one line that says what changed and names
    ``--fresh`` (they are never deleted unasked); where it holds none, one warning line says
    what changed, and a fresh study starts. A shared study, which other workers may be in, is
    refused either way. A resumed study that keeps no workload (stored by an earlier
    mpadvise) cannot be checked, and is treated as changed.

    Args:
        storage: the Optuna storage URL; ``None`` (in memory) keeps nothing.
        study_name: the study's name in it.
        workload: ``{"workload_fingerprint": ..., "model_signature": ...}`` of this tune's reference.
        resume: whether the tune was asked to continue a stored study.

    Returns:
        ``resume``, or ``False`` when the stored study must not be continued.

    Raises:
        UsageError: a study of this machine of another workload that holds finished trials.
        MpadviseError: a shared study of another workload, or a storage that refuses or stays
            unreachable through the retries (an outage is ridden out, as in the search).
    """
    shared = shared_storage(storage)
    if storage is None or not (resume or shared):
        return resume
    with _riding_out(storage) as worker:
        study = _stored_study(storage, study_name, worker)
        if study is None:  # no such study yet: nothing to continue
            return resume
        stored = worker.call("reading the study's workload", lambda: study.user_attrs.get(STUDY_ATTR_WORKLOAD))
        # A study without a workload fingerprint and without trials has no verdicts to doubt.
        empty = stored is None and not worker.call("reading the study", lambda: study.get_trials(deepcopy=False))
    changed = _workload_change(stored, workload)
    if shared:
        if changed:
            raise MpadviseError(_shared_workload_error(study_name, changed))
        return resume
    if changed is None and stored is None:
        if empty:
            return resume
        changed = "it keeps no workload fingerprint (stored by an earlier mpadvise), so its verdicts cannot be checked"
    if changed is None:
        return resume
    held = kept_study(storage, study_name)
    if held is not None and held.finished:
        raise UsageError(f"--resume: {held.describe()} measured on another workload ({changed}); it is kept: pass "
                         "--fresh to delete it and start afresh, or run the workload it was measured on")
    get_logger().warning(f"--resume: study {study_name!r} was measured on another workload ({changed}): its trials "
                         "and replicate are not reused; a fresh study starts")
    return False


def _workload_change(stored: Any, workload: Mapping[str, Any]) -> str | None:
    """What differs between a study's stored workload and this one, in words; ``None`` when
    nothing does, or when the study keeps none."""
    if not isinstance(stored, dict):
        return None
    before, now = stored.get("model_signature"), workload.get("model_signature")
    if before != now:
        return f"the model changed: signature {_short(before)} then, {_short(now)} now"
    before, now = stored.get("workload_fingerprint"), workload.get("workload_fingerprint")
    if before != now:
        return (f"the optimizer, global batch or script changed: workload fingerprint {_short(before)} then, "
                f"{_short(now)} now")
    return None


def _short(fingerprint: Any) -> str:
    return str(fingerprint)[:12] if fingerprint else "none"


def _shared_workload_error(study_name: str, changed: str) -> str:
    return (f"study {study_name!r} holds trials of another workload ({changed}); every worker of a shared study must "
            "run the same workload (the same environment, config files and data): fix this worker, or delete the study "
            f"(optuna delete-study --study-name {study_name} --storage URL)")


def _claim_workload(study: Any, study_name: str, workload: Mapping[str, Any] | None, *, shared: bool) -> None:
    """Record the workload in the study, refusing a stored study of another one."""
    if workload is None:
        return
    changed = _workload_change(study.user_attrs.get(STUDY_ATTR_WORKLOAD), workload)
    if changed:
        raise MpadviseError(_shared_workload_error(study_name, changed) if shared else
                            f"study {study_name!r} holds trials of another workload ({changed}); run without --resume "
                            "to start a fresh study")
    study.set_user_attr(STUDY_ATTR_WORKLOAD, dict(workload))


def stored_replicate(storage: str | None, study_name: str) -> dict[str, Any] | None:
    """The fp32 replicate kept with a stored study, for ``--resume`` to reuse; ``None`` when
    the study is in memory, does not exist yet, or keeps none.

    Raises:
        MpadviseError: the storage refuses or stays unreachable through the retries, naming the
            URL and the reason.
    """
    if storage is None:
        return None
    with _riding_out(storage) as worker:
        study = _stored_study(storage, study_name, worker)
        stored = None if study is None else worker.call(
            "reading fp32's replicate", lambda: study.user_attrs.get(STUDY_ATTR_REPLICATE))
    return stored if isinstance(stored, dict) else None


def _stored_study(storage: str, study_name: str, worker: _Worker) -> Any:
    """The stored ``optuna.Study`` of that name, or ``None`` when there is none yet; ``worker``
    rides out an outage.

    Raises:
        MpadviseError: the storage refuses, naming the URL and the reason.
        StorageLost: it stayed unreachable through ``worker``'s retries.
    """
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    backend, _ = _open(storage)

    def load() -> Any:
        with _quiet():
            return optuna.load_study(study_name=study_name, storage=backend)

    try:
        return worker.call("opening the study", load)
    except KeyError:  # no such study yet
        return None
    except StorageLost:
        raise
    except Exception as exc:  # a locked file, a refusal
        raise MpadviseError(storage_error(storage, exc)) from None


@contextlib.contextmanager
def _riding_out(storage: str) -> Iterator[_Worker]:
    """A worker for the study reads a tune makes between its reference and its search: they ride
    out an outage as the search's calls do, since the tune reached the storage before its
    reference ran. One that stays away ends the tune in one line.

    Raises:
        MpadviseError: the storage stayed unreachable through the retries.
    """
    worker = _Worker(worker_name(), None, None, {}, time.sleep, storage, storage_retry_s(os.environ))
    try:
        yield worker
    except StorageLost as exc:
        raise MpadviseError(_lost_message(storage, str(exc), worker, None, retried=worker.retry_s)) from None


def worker_name() -> str:
    """This process as a worker of a study: ``host:pid``."""
    return f"{socket.gethostname()}:{os.getpid()}"


def _open_study(storage: str | None, study_name: str, *, resume: bool, seed: int, worker: str) -> tuple[Any, bool]:
    """The study, and whether this call made it.

    A shared study is joined as it stands (other workers may be in it); elsewhere a tune without
    ``resume`` starts afresh. The storage's own errors pass through: the caller retries one that
    says the storage is unreachable for now (an outage since the tune opened it).
    """
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    shared = shared_storage(storage)
    # The workers of one study draw different proposals: with one seed, they would all propose
    # the same candidates in the same order and spend their asks skipping each other's.
    sampler_seed = zlib.crc32(f"{seed}:{worker}".encode()) if shared else seed
    sampler = optuna.samplers.TPESampler(seed=sampler_seed, n_startup_trials=4)
    backend = None if storage is None else _open(storage)[0]
    with _quiet():
        if not resume and not shared:
            if backend is not None:
                with contextlib.suppress(KeyError):  # no such study yet
                    optuna.delete_study(study_name=study_name, storage=backend)
            return optuna.create_study(study_name=study_name, storage=backend, direction="maximize",
                                       sampler=sampler), True
        try:  # the study name is unique in the storage: one worker makes it, the others join it
            return optuna.create_study(study_name=study_name, storage=backend, direction="maximize",
                                       sampler=sampler), True
        except optuna.exceptions.DuplicatedStudyError:
            return optuna.load_study(study_name=study_name, storage=backend, sampler=sampler), False


@dataclass
class _Worker:
    """This process as one worker of the study.

    Attributes:
        name: ``host:pid``, recorded in each trial it claims.
        backend: the RDB storage, whose heartbeats show its trials alive; ``None`` in memory.
        heartbeat: the heartbeat settings; ``None`` in memory.
        reference: candidates it measured outside the study (its fp32 reference), until told.
        sleep: waits that many seconds (tests pass a fake).
    """

    name: str
    backend: Any
    heartbeat: Heartbeat | None
    reference: dict[Candidate, Measured]
    sleep: Callable[[float], None]
    storage: str | None = None
    retry_s: int = STORAGE_RETRY_S
    # Results this worker measured that are not in the study yet (an outage), by trial number.
    untold: dict[int, Measured] = field(default_factory=dict)

    @property
    def poll_s(self) -> float:
        return WAIT_POLL_S if self.heartbeat is None else min(WAIT_POLL_S, float(self.heartbeat.interval_s))

    def call(self, what: str, fn: Callable[[], Any]) -> Any:
        """``fn()``, retried with backoff while the study storage is unreachable, for up to
        ``retry_s`` seconds (wall-clock time, whatever clock the search runs on).

        Args:
            what: the call in words, for the lines that say it waits (``"storing trial 4's
                result"``).

        Raises:
            StorageLost: the storage stayed unreachable for ``retry_s`` seconds.
        """
        deadline = None
        delay = 0.5
        while True:
            try:
                result = fn()
            except Exception as exc:
                if not _unreachable(exc):
                    raise
                now = time.monotonic()
                if deadline is None:
                    deadline = now + self.retry_s
                    get_logger().warning(
                        f"the Optuna study storage {shown_url(self.storage)!r} is unreachable ({_root_line(exc)}); "
                        f"{what}: retrying for up to {self.retry_s} s ({STORAGE_RETRY_ENV})")
                if now >= deadline:
                    raise StorageLost(what, exc) from None
                self.sleep(max(0.05, min(delay, deadline - now)))
                delay = min(2 * delay, 10.0)
                continue
            if deadline is not None:
                get_logger().info(f"the Optuna study storage is back: {what} went through")
            return result


class StorageLost(Exception):
    """The study storage stayed unreachable through the retries of one call."""

    def __init__(self, what: str, cause: BaseException) -> None:
        super().__init__(f"{what}: {_root_line(cause)}")
        self.what = what
        self.cause = cause


def _root_line(exc: BaseException) -> str:
    """The first line of the innermost error in ``exc``'s chain: the server's or the driver's
    own words, not Optuna's wrapper ("An exception is raised during the commit")."""
    *_, innermost = _chain(exc)
    return _first_line(innermost)


def _unreachable(exc: BaseException) -> bool:
    """Whether ``exc`` says the storage cannot be reached now (a server down or restarting, a
    dropped connection), which a later try may get through; not a refusal of the request."""
    import optuna
    import sqlalchemy.exc

    gone = (sqlalchemy.exc.OperationalError, sqlalchemy.exc.InterfaceError, sqlalchemy.exc.DisconnectionError,
            sqlalchemy.exc.TimeoutError)
    if any(isinstance(inner, gone) or (isinstance(inner, sqlalchemy.exc.DBAPIError) and inner.connection_invalidated)
           for inner in _chain(exc)):
        return True
    return False if not isinstance(exc, optuna.exceptions.StorageInternalError) else _unreachable_cause(exc)


def _unreachable_cause(exc: BaseException) -> bool:
    """An Optuna storage error whose cause is lost with its message: the server's words say."""
    text = str(exc).lower()
    return any(word in text for word in ("connection", "server closed", "terminating", "could not connect"))


def storage_retry_s(environ: Mapping[str, str]) -> int:
    """Seconds a running search retries an unreachable storage: ``MPADVISE_STORAGE_RETRY_S``
    (whole seconds, 0 for none), else 120.

    Raises:
        MpadviseError: a value that is not a whole number >= 0, naming the variable.
    """
    return _whole_env(environ, STORAGE_RETRY_ENV, STORAGE_RETRY_S, minimum=0, unit="seconds")


def run_search(
    space: SearchSpace,
    evaluate: Callable[[Candidate], Measured],
    options: TuneOptions,
    *,
    first: list[Candidate],
    reference_goodput: float,
    dtype_ratio: dict[str, float],
    study_name: str = "mpadvise",
    known: dict[Candidate, Measured] | None = None,
    on_trial: Callable[[Candidate, Measured], None] | None = None,
    clock: Callable[[], float] = time.monotonic,
    replicate: dict[str, Any] | None = None,
    hardware: str | None = None,
    sleep: Callable[[float], None] = time.sleep,
    workload: Mapping[str, Any] | None = None,
) -> SearchOutcome:
    """Search ``space`` for the fastest stable candidate.

    Args:
        space: the candidates allowed on this hardware.
        evaluate: runs one candidate (a subprocess trial, or a fake in tests).
        options: the tune's options; the search reads ``trials`` (trials run here),
            ``time_budget`` (no trial starts after it), ``storage`` (Optuna storage URL,
            ``None`` for in memory; a database server's study is shared with other workers),
            ``resume`` (continue a stored study without running its trials again), ``seed``
            (of the sampler) and ``no_priors`` (measure candidates even when no untried one can
            beat the best).
        first: candidates enqueued before the sampler takes over (fp32, the safe default);
            in a shared study, only by the worker that made it.
        reference_goodput: fp32's goodput, for the priors.
        dtype_ratio: matmul TFLOP/s ratio to fp32 per dtype on this device (the priors).
        study_name: the study's name in that storage.
        known: candidates already measured (the reference), reused without running.
        on_trial: called after each candidate is evaluated.
        clock: monotonic seconds (tests pass a fake).
        replicate: the fp32 replicate (``Replicate.to_dict``), kept with the study so that a
            resumed tune judges against the same spread without running it again.
        hardware: the fingerprint of the hardware the trials run on, recorded in the study;
            a study that holds another is refused. ``None`` records and checks nothing.
        sleep: waits while the only candidates left are those other workers are running.
        workload: the workload fingerprint and model signature of this tune's reference,
            recorded in the study; a stored study of another workload is refused (see
            :func:`check_study_workload`, which the tuner asks first). ``None`` records nothing.

    Returns:
        Every measured candidate (this worker's and, from the study, the others'), and why the
        search stopped.

    Raises:
        MpadviseError: the storage cannot be opened or is lost, or the study was made for other
            hardware, another workload or another space.
    """
    import optuna
    import sqlalchemy.exc

    start = clock()
    outcome = SearchOutcome()
    outcome.measured.update(known or {})
    name = worker_name()
    backend, heartbeat = _open(options.storage) if options.storage is not None else (None, None)
    worker = _Worker(name, backend, heartbeat, dict(known or {}), sleep, options.storage, storage_retry_s(os.environ))
    try:  # the tune opened this storage before its reference ran: unreachable now is an outage
        study, made = worker.call("opening the study", lambda: _open_study(
            options.storage, study_name, resume=options.resume, seed=options.seed, worker=name))
    except StorageLost as exc:
        raise MpadviseError(_lost_message(options.storage, str(exc), worker, outcome, retried=worker.retry_s)) from None
    except MpadviseError:
        raise
    except Exception as exc:  # a locked file, a refusal
        raise MpadviseError(storage_error(options.storage or ":memory:", exc)) from None
    shared = shared_storage(options.storage)
    try:
        # Every call on the study goes through worker.call, so that an outage at any of them is
        # ridden out; each is safe to repeat (a write that landed before its answer was lost).
        if made:  # at once, so that workers joining in a moment find the first candidates queued
            worker.call("queueing the first candidates", lambda: _enqueue_first(study, space, first))
        worker.call("checking the study's hardware", lambda: _check_hardware(study, study_name, hardware, record=True))
        worker.call("checking the study's search space", lambda: _claim_space(study, space, study_name, shared=shared))
        worker.call("checking the study's workload",
                    lambda: _claim_workload(study, study_name, workload, shared=shared))
        if replicate is not None:
            worker.call("storing fp32's replicate", lambda: study.set_user_attr(STUDY_ATTR_REPLICATE, replicate))
        if not made and not shared:  # a resumed study of this machine
            worker.call("queueing the first candidates", lambda: _enqueue_first(study, space, first))
        priors = _Priors(space, reference_goodput, dtype_ratio, enabled=not options.no_priors)
        _search_loop(study, space, evaluate, options, priors, outcome, lambda: clock() - start, on_trial, worker)
    except StorageLost as exc:  # the server stayed away through the retries
        raise MpadviseError(_lost_message(options.storage, str(exc), worker, outcome, retried=worker.retry_s)) from None
    except (sqlalchemy.exc.SQLAlchemyError, optuna.exceptions.StorageInternalError) as exc:  # refused, not unreachable
        raise MpadviseError(_lost_message(options.storage, _root_line(exc), worker, outcome, retried=None)) from None
    outcome.pruned = {c: why for c, why in outcome.pruned.items() if c not in outcome.measured}
    outcome.wall_s = clock() - start
    return outcome


def _lost_message(storage: str | None, why: str, worker: _Worker, outcome: SearchOutcome | None, *,
                  retried: int | None) -> str:
    """The one line a tune ends with when its storage is lost: the server, why, and what was
    kept (``outcome``: the search's; ``None`` before the search began)."""
    after = f" (retried for {retried} s, {STORAGE_RETRY_ENV})" if retried is not None else ""
    if outcome is None:
        kept = "nothing of this tune is in the study yet"
    elif worker.untold:
        told = "; ".join(f"trial {n} {m.candidate.label}: {_result_words(m)}" for n, m in sorted(worker.untold.items()))
        kept = (f"this worker's results not stored in the study, kept in this tune's ranking and listed here: {told}; "
                f"the {outcome.runs - len(worker.untold)} stored before stay in the study")
    else:
        kept = f"every result this worker measured ({outcome.runs}) is stored in the study"
    return (f"lost the Optuna study storage {shown_url(storage)!r}{after}: {why}; {kept}; run the same command again "
            "once the server is back to continue")


def _result_words(m: Measured) -> str:
    if m.feasible and m.stable:
        return f"{m.goodput:,.1f} samples/s, stable"
    return m.outcome or "not stable"


def _search_loop(study: Any, space: SearchSpace, evaluate: Callable[[Candidate], Measured], options: TuneOptions,
                 priors: _Priors, outcome: SearchOutcome, elapsed: Callable[[], float],
                 on_trial: Callable[[Candidate, Measured], None] | None, worker: _Worker) -> None:
    """Ask the sampler, run what is promising, new and claimed by no other worker, tell it the
    rest, until a budget is spent or nothing is left to run."""
    grid = space.grid()
    duplicates = 0
    announced: set[int] = set()
    while True:
        worker.call("failing the trials of silent workers", lambda: _fail_stale(study))
        claimed = worker.call("reading the study", lambda: _take_in(study, outcome, worker))
        untried = [c for c in grid if c not in outcome.measured]
        outcome.stop_reason = _budget_spent(outcome, options, elapsed, untried, len(grid))
        if outcome.stop_reason:
            break
        promising = priors.promising(untried, outcome.measured)
        if not promising:
            outcome.stop_reason = (
                f"no untried candidate can beat the best ({len(untried)} left; bounded by the measured "
                "matmul ratios, memory fit and measured variants)"
            )
            break
        if all(c in claimed for c in promising):
            # What is left runs on other workers: wait for their results, or for a silent
            # worker's trial to come back to the queue.
            announced = _wait(claimed, promising, announced, worker)
            continue
        trial = worker.call("asking the study for a trial", lambda: _ask(study))
        with _beating(worker, trial):
            done, candidate = _propose(study, trial, space, grid, evaluate, priors, outcome, worker)
        if done == "ran":
            duplicates = 0
            if on_trial:
                on_trial(candidate, outcome.measured[candidate])
            continue
        duplicates += 1
        # The sampler keeps proposing what is known, or proposed what another worker runs (its
        # first proposals are random draws): queue the most promising free candidate instead.
        if duplicates >= MAX_DUPLICATE_PROPOSALS or done == "taken":
            claimed = worker.call("reading the study", lambda: _take_in(study, outcome, worker))
            free = [c for c in priors.promising([c for c in grid if c not in outcome.measured], outcome.measured)
                    if c not in claimed]
            if free:
                params = _params(space, priors.most_promising(free, outcome.measured))
                worker.call("queueing a trial", lambda params=params: study.enqueue_trial(params))
            duplicates = 0


def _propose(study: Any, trial: Any, space: SearchSpace, grid: list[Candidate],
             evaluate: Callable[[Candidate], Measured], priors: _Priors, outcome: SearchOutcome,
             worker: _Worker) -> tuple[str, Candidate]:
    """Claim the trial's candidate, then run it, or tell or close the trial without running it
    when it is measured, pruned, or another worker runs it.

    Returns:
        ``"ran"``, ``"told"`` (measured or pruned already) or ``"taken"`` (another worker
        runs it), and the candidate.
    """
    # Optuna writes each suggested parameter to the study; a retry keeps the ones that landed.
    candidate = worker.call(f"reading trial {trial.number}'s candidate", lambda: _suggest(trial, space))
    # The claim is written before the look at the others: of two workers that propose one
    # candidate at once, the later look sees the earlier claim, so both never run it.
    claim = {**_candidate_to(candidate), "trial": trial.number, "worker": worker.name}
    worker.call(f"claiming trial {trial.number}", lambda: trial.set_user_attr(TRIAL_ATTR_CLAIM, claim))
    claimed = worker.call("reading the study", lambda: _take_in(study, outcome, worker, exclude=trial.number))
    promising = priors.promising([c for c in grid if c not in outcome.measured], outcome.measured)
    if candidate in outcome.measured or candidate not in promising:
        worker.call(f"telling trial {trial.number}",
                    lambda: _tell_without_running(study, trial, candidate, outcome, priors, worker))
        return "told", candidate
    if candidate in claimed:
        why = f"not run: trial {claimed[candidate]} of another worker runs {candidate.label}"
        worker.call(f"closing trial {trial.number}", lambda: _close(study, trial, why))
        return "taken", candidate
    _run_trial(study, trial, candidate, evaluate, outcome, worker)
    return "ran", candidate


def _ask(study: Any) -> Any:
    with _quiet():
        return study.ask()


@contextlib.contextmanager
def _beating(worker: _Worker, trial: Any) -> Iterator[None]:
    """Send the trial's heartbeats while the block runs; nothing for a storage without them.

    Optuna beats for the trials that ``Study.optimize`` runs; a search by ask and tell beats for
    its own, from a thread, so that a trial's subprocess may take as long as it needs.
    """
    backend = worker.backend
    interval = None if backend is None else backend.get_heartbeat_interval()
    if interval is None:
        yield
        return
    trial_id = trial._trial_id  # Optuna keys heartbeats by the storage's trial id, not the number
    worker.call(f"recording trial {trial.number}'s heartbeat", lambda: backend.record_heartbeat(trial_id))
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(interval):
            try:
                backend.record_heartbeat(trial_id)
            except Exception as exc:  # a hiccup of the server: the next beat may get through
                get_logger().debug(f"heartbeat of trial {trial.number} not recorded: {_first_line(exc)}")

    thread = threading.Thread(target=beat, name=f"mpadvise-heartbeat-{trial.number}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def _fail_stale(study: Any) -> None:
    """Fail the trials whose workers stopped sending heartbeats; Optuna's retry callback queues
    a copy of each (up to the retry limit), which the next ``ask`` of a live worker takes."""
    import optuna

    with _quiet():
        optuna.storages.fail_stale_trials(study)


def _wait(claimed: dict[Candidate, int], promising: list[Candidate], announced: set[int], worker: _Worker) -> set[int]:
    """Wait a while for the trials other workers run; say so once for each new set of them."""
    waiting = {c: claimed[c] for c in promising if c in claimed}
    numbers = set(waiting.values())
    if not numbers <= announced:
        listed = ", ".join(f"{n} ({c.label})" for c, n in sorted(waiting.items(), key=lambda item: item[1]))
        after = f"; a trial whose worker goes silent runs again after {worker.heartbeat.grace_s} s" if worker.heartbeat else ""
        get_logger().info(f"waiting for the trials other workers are running: {listed}{after}")
    worker.sleep(worker.poll_s)
    return announced | numbers


@dataclass(frozen=True)
class _Priors:
    """Upper bounds on what untried candidates could reach (matmul ratios, memory fit, measured
    variants); with ``enabled`` off, every untried candidate stays promising."""

    space: SearchSpace
    reference_goodput: float
    dtype_ratio: dict[str, float]
    enabled: bool

    def bound(self, candidate: Candidate, measured: dict[Candidate, Measured]) -> float:
        return upper_bound(candidate, measured, user_batch=self.space.user_batch,
                           reference_goodput=self.reference_goodput, dtype_ratio=self.dtype_ratio)

    def promising(self, untried: list[Candidate], measured: dict[Candidate, Measured]) -> list[Candidate]:
        """The untried candidates that could still beat the best stable one."""
        if not self.enabled:
            return untried
        best = best_goodput(measured)
        return [c for c in untried if self.bound(c, measured) > best]

    def why_pruned(self, candidate: Candidate, measured: dict[Candidate, Measured]) -> str:
        """Why the priors rule out ``candidate``, in words, with its bound and the best."""
        bound, best = self.bound(candidate, measured), best_goodput(measured)
        if bound <= 0:
            return ("not run: it cannot fit or stay stable (out of memory at a micro-batch no larger, or a "
                    f"micro-batch split of settings that failed as {' or '.join(sorted(SPLIT_KEEPS))}, which a "
                    "split cannot cure); --no-priors runs it")
        return (f"not run: the priors bound it at {bound:,.0f} samples/s (matmul ratio, measured variants), no "
                f"more than the best measured {best:,.0f}/s; --no-priors runs it")

    def most_promising(self, promising: list[Candidate], measured: dict[Candidate, Measured]) -> Candidate:
        """The highest bound (when enabled), the safest first among equals."""
        return max(promising, key=lambda c: (self.bound(c, measured) if self.enabled else 0.0,
                                             [-x for x in preference_key(c, self.space.user_batch)]))


def _claim_space(study: Any, space: SearchSpace, study_name: str, *, shared: bool) -> None:
    """Record the space in the study, refusing a stored study made for another one."""
    # Everything that decides which candidates exist: a framework's limits and FSDP2's reduction
    # dimension too, so a script that changed framework or started sharding gets no stale space.
    limits = space.limits
    space_json = json.dumps({"modes": space.modes, "micro_batches": space.micro_batches, "user_batch": space.user_batch,
                             "fsdp": space.fsdp, "loss_scale_kinds": limits.loss_scale_kinds,
                             "loss_scale_settings": limits.loss_scale_settings})
    stored_space = study.user_attrs.get(STUDY_ATTR_SPACE)
    if stored_space is not None and stored_space != space_json:
        fix = ("tune on every worker with the same --mode, --scale-batch and --include-emulated, or delete the study "
               f"(optuna delete-study --study-name {study_name} --storage URL)" if shared
               else "run without --resume to start a fresh study")
        raise MpadviseError(f"study {study_name!r} was made for another search space ({stored_space}); {fix}")
    study.set_user_attr(STUDY_ATTR_SPACE, space_json)


def _take_in(study: Any, outcome: SearchOutcome, worker: _Worker, *, exclude: int | None = None) -> dict[Candidate, int]:
    """Take in what the study's finished trials measured (an earlier run's, another worker's),
    and return the candidates other trials are running now, with those trials' numbers.

    The first result of a candidate counts (this worker's own reference before any other). A
    proposal the priors pruned stays pruned, so that another run (``--no-priors``) may still
    measure it. A candidate whose trials lost their workers more often than they are retried
    is given up as a crash.

    Args:
        exclude: the number of this worker's own trial, which is no rival to itself.
    """
    import optuna

    state = optuna.trial.TrialState
    claimed: dict[Candidate, int] = {}
    silent: dict[Candidate, list[int]] = {}
    for frozen in study.get_trials(deepcopy=False):
        if frozen.state == state.COMPLETE:
            _take_result(frozen.user_attrs.get(TRIAL_ATTR_RESULT), outcome)
            continue
        claim = _claim_of(frozen)
        if claim is None or frozen.number == exclude:
            continue
        if frozen.state == state.RUNNING:
            claimed.setdefault(claim, frozen.number)
        elif frozen.state == state.FAIL and TRIAL_ATTR_CLOSED not in frozen.user_attrs:
            silent.setdefault(claim, []).append(frozen.number)  # failed as stale: its worker went silent
    if worker.heartbeat is not None:
        for cand, numbers in silent.items():
            if len(numbers) > worker.heartbeat.max_retry and cand not in outcome.measured and cand not in claimed:
                outcome.measured[cand] = Measured(
                    cand, 0.0, feasible=False, stable=False, outcome="crash",
                    reason=(f"not run again: its trials {', '.join(map(str, numbers))} lost their workers (no heartbeat "
                            f"for {worker.heartbeat.grace_s} s), more often than the {worker.heartbeat.max_retry} "
                            f"retries ({MAX_RETRY_ENV})"))
                outcome.order.append(cand)
    return claimed


def _take_result(data: Any, outcome: SearchOutcome) -> None:
    """Take in one finished trial's stored result, unless the candidate is measured already."""
    if not isinstance(data, dict):
        return
    m = _measured_from(data)
    # A measured result always has an outcome; an empty one is a pruned proposal stored
    # before pruned proposals were marked as such.
    if data.get("pruned") or not m.outcome:
        outcome.pruned.setdefault(m.candidate, m.reason or "not run: the priors ruled it out")
        return
    if m.candidate in outcome.measured:
        return
    outcome.resumed += 1
    outcome.measured[m.candidate] = m
    outcome.order.append(m.candidate)


def _claim_of(frozen: Any) -> Candidate | None:
    """The candidate a trial claimed; ``None`` for none, or for a retried copy's inherited
    claim, which names the number of the trial it copies."""
    claim = frozen.user_attrs.get(TRIAL_ATTR_CLAIM)
    if not isinstance(claim, dict) or claim.get("trial") != frozen.number:
        return None
    return _candidate_from(claim)


def _enqueue_first(study: Any, space: SearchSpace, first: list[Candidate]) -> None:
    """Queue the candidates that run before the sampler takes over, unless the study has them."""
    done_params = [t.params for t in study.get_trials(deepcopy=False)]
    for cand in first:
        params = _params(space, space.normalise(cand))
        if params not in done_params:
            study.enqueue_trial(params, skip_if_exists=True)


def _params(space: SearchSpace, candidate: Candidate) -> dict[str, object]:
    """The Optuna parameters that select ``candidate``, the micro-batch always named: an
    enqueued trial that leaves a parameter out has the sampler draw it."""
    params = candidate.params()
    if space.micro_batches and "micro_batch" not in params:
        params["micro_batch"] = space.user_batch
    return params


def _budget_spent(
    outcome: SearchOutcome, options: TuneOptions, elapsed: Callable[[], float], untried: list[Candidate], grid_size: int
) -> str:
    """Why the search stops before another trial (the trial or time budget, an exhausted
    space); empty while it goes on."""
    if outcome.runs >= options.trials:
        return f"trial budget reached ({options.trials} trials)"
    if options.time_budget is not None and elapsed() >= options.time_budget:
        return f"time budget reached ({options.time_budget:g} s)"
    if not untried:
        return f"every candidate of the space was measured ({grid_size})"
    return ""


def _tell_without_running(study: Any, trial: Any, candidate: Candidate, outcome: SearchOutcome,
                          priors: _Priors, worker: _Worker) -> None:
    """Tell the sampler what is known (or bounded) of a proposal, without running it.

    A pruned proposal is told as infeasible, which steers the sampler away from it, and is
    stored marked as pruned: it was never measured. The first telling of this worker's own
    reference is stored as such; every other known result as a copy.
    """
    known = outcome.measured.get(candidate)
    if known is not None:
        source = "reference" if candidate in worker.reference else "known"
        _tell(study, trial, known, known.goodput, source=source, worker=worker.name)
        worker.reference.pop(candidate, None)
        return
    reason = outcome.pruned[candidate] = priors.why_pruned(candidate, outcome.measured)
    _tell(study, trial, Measured(candidate, 0.0, feasible=False, stable=False, outcome="pruned", reason=reason),
          0.0, source="pruned", worker=worker.name)


def _run_trial(study: Any, trial: Any, candidate: Candidate, evaluate: Callable[[Candidate], Measured],
               outcome: SearchOutcome, worker: _Worker) -> None:
    import optuna

    try:
        measured = evaluate(candidate)
    except BaseException:
        # Interrupted (Ctrl-C), or the runner failed: close the trial so that no worker waits
        # for it; the candidate stays untried, for --resume or another worker.
        with contextlib.suppress(Exception):
            _close(study, trial, f"not finished: {worker.name} stopped while running it")
        raise
    outcome.runs += 1
    outcome.measured[candidate] = measured
    outcome.order.append(candidate)
    # Kept here until the study has it: a storage that is away now may be back before it is needed.
    worker.untold[trial.number] = measured
    try:
        worker.call(f"storing trial {trial.number}'s result ({candidate.label})",
                    lambda: _tell(study, trial, measured, measured.goodput, source="run", worker=worker.name))
    except optuna.exceptions.UpdateFinishedTrialError:
        # Failed as stale by another worker while this one ran it (or while the storage was away):
        # the result lands as a trial of its own, so that the queued copy is told, not run again.
        grace = worker.heartbeat.grace_s if worker.heartbeat else 0
        worker.call(f"storing trial {trial.number}'s result ({candidate.label})",
                    lambda: _add_result(study, trial, measured, worker.name))
        get_logger().warning(
            f"trial {trial.number} ({candidate.label}) was failed by another worker while it ran here (no heartbeat "
            f"reached the study for {grace} s): its result is stored as a new trial")
    worker.untold.pop(trial.number, None)


def _add_result(study: Any, trial: Any, measured: Measured, worker: str) -> None:
    """Store a result as a new finished trial, for a trial the study failed meanwhile."""
    import optuna

    frozen = optuna.trial.create_trial(
        state=optuna.trial.TrialState.COMPLETE, value=measured.goodput, params=trial.params,
        distributions=trial.distributions,
        user_attrs={TRIAL_ATTR_RESULT: {**_measured_to(measured), "pruned": False, "source": "run", "worker": worker}})
    frozen.set_constraint("unstable", 0.0 if measured.stable else 1.0)
    frozen.set_constraint("infeasible", 0.0 if measured.feasible else 1.0)
    study.add_trial(frozen)


def _close(study: Any, trial: Any, why: str) -> None:
    """End a trial without a result (FAIL, which the sampler ignores), saying why."""
    import optuna

    with _finished_already(study, trial, optuna.trial.TrialState.FAIL):
        trial.set_user_attr(TRIAL_ATTR_CLOSED, why)
        study.tell(trial, state=optuna.trial.TrialState.FAIL)


def _tell(study: Any, trial: Any, measured: Measured, value: float, *, source: str, worker: str) -> None:
    """Store a result with the trial and finish it.

    Args:
        source: ``run`` (measured by this trial), ``reference`` (this worker's fp32 reference,
            measured outside the study), ``known`` (a copy of a result already measured) or
            ``pruned`` (ruled out by the priors, never measured).
        worker: the worker that tells it.
    """
    import optuna

    with _finished_already(study, trial, optuna.trial.TrialState.COMPLETE), warnings.catch_warnings():
        # A retried tell finds the constraints it set before the storage went away: the same values.
        warnings.filterwarnings("ignore", message="The constraint value is ignored because")
        # Constraints (> 0 violates): instability and not fitting are what TPE must learn to avoid.
        trial.set_constraint("unstable", 0.0 if measured.stable else 1.0)
        trial.set_constraint("infeasible", 0.0 if measured.feasible else 1.0)
        trial.set_user_attr(TRIAL_ATTR_RESULT, {**_measured_to(measured), "pruned": source == "pruned",
                                                "source": source, "worker": worker})
        study.tell(trial, value)


@contextlib.contextmanager
def _finished_already(study: Any, trial: Any, state: Any) -> Iterator[None]:
    """Let the finishing of a trial pass when the study holds it in ``state`` already: the retry
    of a tell that landed before its answer was lost. Only this worker completes or closes its
    own trials, so a trial in ``state`` is its own doing; one that another worker failed as
    stale while it ran here still raises ``UpdateFinishedTrialError`` when it was to complete."""
    import optuna

    try:
        yield
    except optuna.exceptions.UpdateFinishedTrialError:
        if study._storage.get_trial(trial._trial_id).state != state:  # Optuna keys trials by id
            raise


def best_goodput(measured: dict[Candidate, Measured]) -> float:
    stable = [m.goodput for m in measured.values() if m.feasible and m.stable]
    return max(stable, default=0.0)


def _candidate_to(c: Candidate) -> dict[str, Any]:
    return dataclasses.asdict(c)


def _candidate_from(data: Mapping[str, Any]) -> Candidate:
    """A candidate from its stored fields; a field a study stored before it existed keeps its default."""
    return Candidate(**{f.name: data.get(f.name, f.default) for f in dataclasses.fields(Candidate)})


def _measured_to(m: Measured) -> dict[str, Any]:
    return {
        **_candidate_to(m.candidate), "goodput": m.goodput, "feasible": m.feasible, "stable": m.stable,
        "oom": m.oom, "outcome": m.outcome, "reason": m.reason[:2000], "verdict_kind": m.verdict_kind,
    }


def _measured_from(data: Mapping[str, Any]) -> Measured:
    return Measured(
        _candidate_from(data), float(data["goodput"]), bool(data["feasible"]), bool(data["stable"]),
        bool(data.get("oom", False)), str(data.get("outcome", "")), str(data.get("reason", "")),
        str(data.get("verdict_kind", "")),
    )


def study_status(storage: str, study_name: str | None = None, *, missing_ok: bool = False) -> list[dict[str, Any]]:
    """What a study storage holds, read without writing anything (no tables made, no trial
    failed as stale): per study, its hardware, its trials by state, the workers seen in it and
    the best stable candidate so far.

    Args:
        storage: the Optuna storage URL (a database server, or an SQLite file that must exist).
        study_name: only this study; ``None`` for every study in the storage.
        missing_ok: an empty list, rather than an error, where ``study_name`` is not there.

    Returns:
        One dict per study, by name: ``study``, ``hardware``, ``trials`` (``complete``,
        ``running``, ``waiting``, ``failed``, ``pruned``: counts), ``workers`` (``host:pid``,
        sorted), ``best`` (``label``, ``goodput``, ``worker``, ``trial``; ``None`` before any
        stable result).

    Raises:
        UsageError: (exit 2) an SQLite file that is not there, or a URL that is not one.
        MpadviseError: the storage cannot be read, or holds no study of that name; one line
            naming the URL (its password hidden).
    """
    import optuna
    import sqlalchemy

    shown = shown_url(storage)
    if storage.startswith("sqlite") and _sqlite_file(storage) is None:
        path = storage.partition(":///")[2].partition("?")[0]
        raise UsageError(f"no study storage at {shown!r}: the file {path or '(none)'} does not exist; expected "
                         "the SQLite file a tune wrote (by default studies.db in the cache directory)")
    engine_kwargs: dict[str, Any] = {}
    if _is_postgres(storage) and "connect_timeout" not in storage:
        engine_kwargs["connect_args"] = {"connect_timeout": CONNECT_TIMEOUT_S}
    try:
        engine = sqlalchemy.create_engine(storage_url(storage), **engine_kwargs)
        try:
            tables = set(sqlalchemy.inspect(engine).get_table_names())
            made = _storage_made(engine, tables)
        finally:
            engine.dispose()
        if not made:
            studies = []  # none yet: a tune is making the storage now, or none ever did
            backend = None
        else:
            with _quiet():
                backend = optuna.storages.RDBStorage(storage_url(storage), engine_kwargs=engine_kwargs,
                                                     skip_compatibility_check=True, skip_table_creation=True)
            studies = backend.get_all_studies()
        if study_name is not None:
            studies = [s for s in studies if s.study_name == study_name]
            if not studies and not missing_ok:
                raise MpadviseError(f"no study {study_name!r} in {shown!r}; mpadvise study status --storage URL lists "
                                    "the studies it holds")
        out = [_study_summary(s, backend.get_all_trials(s._study_id, deepcopy=False)) for s in studies]
    except MpadviseError:
        raise
    except Exception as exc:  # an unreachable server, a refused login, a driver missing, a bad URL
        raise storage_failure(storage, exc) from None
    return sorted(out, key=lambda summary: summary["study"])


def _storage_made(engine: Any, tables: set[str]) -> bool:
    """Whether an Optuna storage is fully made: its tables, and its schema version stamped.
    Optuna's storage, opened before that, writes the stamp itself, racing the tune that is
    making it ("UNIQUE constraint failed: alembic_version.version_num" for one of the two)."""
    import sqlalchemy

    if not {"studies", "version_info", "alembic_version"} <= tables:
        return False
    with engine.connect() as connection:
        return all(connection.execute(sqlalchemy.text(f"SELECT COUNT(*) FROM {table}")).scalar()
                   for table in ("version_info", "alembic_version"))


def _study_summary(study: Any, trials: list[Any]) -> dict[str, Any]:
    """One study's status from its frozen trials (see :func:`study_status`)."""
    import optuna

    state = optuna.trial.TrialState
    counts = {"complete": 0, "running": 0, "waiting": 0, "failed": 0, "pruned": 0}
    names = {state.COMPLETE: "complete", state.RUNNING: "running", state.WAITING: "waiting", state.FAIL: "failed",
             state.PRUNED: "pruned"}
    workers: set[str] = set()
    best: dict[str, Any] | None = None
    for frozen in trials:
        counts[names[frozen.state]] += 1
        claim = frozen.user_attrs.get(TRIAL_ATTR_CLAIM)
        if isinstance(claim, dict) and claim.get("worker"):
            workers.add(str(claim["worker"]))
        data = frozen.user_attrs.get(TRIAL_ATTR_RESULT)
        if frozen.state != state.COMPLETE or not isinstance(data, dict) or data.get("pruned"):
            continue
        if data.get("worker"):
            workers.add(str(data["worker"]))
        try:
            m = _measured_from(data)
        except (KeyError, TypeError, ValueError):  # a result stored by another version: not ranked
            continue
        if m.stable and m.feasible and m.goodput > 0 and (best is None or m.goodput > best["goodput"]):
            best = {"label": m.candidate.label, "goodput": round(m.goodput, 3), "worker": data.get("worker"),
                    "trial": frozen.number}
    # The trials a fresh start would lose: results measured by a trial (not a copy of a worker's
    # fp32 reference, measured outside the study, nor a proposal the priors ruled out).
    measured = [frozen for frozen in trials if frozen.state == state.COMPLETE
                and isinstance(frozen.user_attrs.get(TRIAL_ATTR_RESULT), dict)
                and not frozen.user_attrs[TRIAL_ATTR_RESULT].get("pruned")
                and frozen.user_attrs[TRIAL_ATTR_RESULT].get("source", "run") == "run"]
    ends = [frozen.datetime_complete for frozen in measured if frozen.datetime_complete is not None]
    return {"study": study.study_name, "hardware": study.user_attrs.get(STUDY_ATTR_HARDWARE), "trials": counts,
            "workers": sorted(workers), "best": best, "measured": len(measured),
            "last_finished": max(ends).strftime("%Y-%m-%d %H:%M") if ends else None}
