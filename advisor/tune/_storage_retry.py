"""Riding out a study storage that goes away: a worker's calls on it, retried with backoff."""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from advisor._log import get_logger
from advisor.tune._space import Measured
from advisor.tune._storage import (
    Heartbeat,
    open_storage,
    root_line,
    shown_url,
    unreachable,
    whole_env,
)
from probes import MpadviseError

# How long a running search keeps retrying a study storage that went away (a server restarted,
# a network cut), before it ends in one line; its finished measurements are kept meanwhile.
STORAGE_RETRY_ENV = "MPADVISE_STORAGE_RETRY_S"
STORAGE_RETRY_S = 120


def worker_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def storage_retry_s(environ: Mapping[str, str]) -> int:
    """Seconds a running search retries an unreachable storage (0 for none).

    Raises:
        MpadviseError: a value that is not a whole number >= 0, naming the variable.
    """
    return whole_env(environ, STORAGE_RETRY_ENV, STORAGE_RETRY_S, minimum=0, unit="seconds")


@dataclass
class Worker:
    """This process as one worker of the study (``host:pid``), and the retries of its calls on the
    storage. ``untold``: results measured but not in the study yet (an outage), by trial number."""

    name: str
    backend: Any
    heartbeat: Heartbeat | None
    sleep: Callable[[float], None]
    storage: str | None = None
    retry_s: int = STORAGE_RETRY_S
    untold: dict[int, Measured] = field(default_factory=dict)

    @classmethod
    def of(cls, storage: str | None, sleep: Callable[[float], None]) -> Worker:
        """Raises:
            MpadviseError: the storage cannot be opened, or a heartbeat or retry setting is not allowed.
        """
        name = worker_name()
        backend, heartbeat = open_storage(storage) if storage is not None else (None, None)
        return cls(name, backend, heartbeat, sleep, storage, storage_retry_s(os.environ))

    def call(self, what: str, fn: Callable[[], Any]) -> Any:
        """``fn()``, retried with backoff while the study storage is unreachable, for up to ``retry_s``
        seconds; ``what`` says the call in words.

        Raises:
            StorageLost: the storage stayed unreachable for ``retry_s`` seconds.
        """
        deadline = None
        delay = 0.5
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
                continue
            if deadline is not None:
                get_logger().info(f"the Optuna study storage is back: {what} went through")
            return result


class StorageLost(Exception):
    """The study storage stayed unreachable through the retries of one call."""

    def __init__(self, what: str, cause: BaseException) -> None:
        super().__init__(f"{what}: {root_line(cause)}")
        self.what = what
        self.cause = cause


def lost_message(storage: str | None, why: str, worker: Worker, runs: int | None, *, retried: int | None) -> str:
    """The one line a tune ends with when its storage is lost: the server, why, and what was kept
    (``runs``: the trials the search ran; ``None`` before the search began)."""
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
    if m.feasible and m.stable:
        return f"{m.goodput:,.1f} samples/s, stable"
    return m.outcome or "not stable"


@contextlib.contextmanager
def riding_out(storage: str) -> Iterator[Worker]:
    """A worker for the study reads a tune makes between its reference and its search, which ride
    out an outage as the search's calls do.

    Raises:
        MpadviseError: the storage stayed unreachable through the retries.
    """
    worker = Worker(worker_name(), None, None, time.sleep, storage, storage_retry_s(os.environ))
    try:
        yield worker
    except StorageLost as exc:
        raise MpadviseError(lost_message(storage, str(exc), worker, None, retried=worker.retry_s)) from None
