"""The daemon's configuration, its constants, and the pure decisions about addresses and paths."""

from __future__ import annotations

import datetime
import getpass
import ipaddress
import logging
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from probes import MpadviseError

MAX_ARGS = 256
MAX_TEXT = 4096
# Jobs waiting at once: past this, POST /jobs answers 429 (a client cannot grow the queue,
# and the database, without bound).
MAX_QUEUED_JOBS = 1000
# Finished jobs (their rows, logs and files) past their retention are deleted at start and
# then every PRUNE_EVERY_S; queued and running jobs never are.
PRUNE_EVERY_S = 3600.0
# daemon.log is rotated at start past this size, keeping this many old ones (.1 the newest).
MAX_DAEMON_LOG_BYTES = 10 * 1024 * 1024
DAEMON_LOGS_KEPT = 3

logger = logging.getLogger("mpadvise.daemon")


@dataclass(frozen=True)
class DaemonConfig:
    """How the daemon listens and what it may run: ``port`` 0 lets the system pick; ``uds`` serves
    on a 0600 Unix socket instead; a job's paths must lie under ``allowed_roots`` (else home)."""

    host: str = "127.0.0.1"
    port: int = 8757
    uds: Path | None = None
    allow_remote: bool = False
    allowed_roots: tuple[Path, ...] = ()
    # A job request is a path, a few dozen options and an argument list: 64 KiB is generous,
    # and a bound means a client cannot make the daemon buffer (or store) an arbitrary amount.
    max_body_bytes: int = 64 * 1024
    job_retention_days: float = 30.0

    def roots(self) -> tuple[Path, ...]:
        return tuple(Path(os.path.realpath(root)) for root in self.allowed_roots or (Path.home(),))


def utc_now_seconds() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def loopback_address(host: str) -> bool:
    """Whether ``host`` is a literal loopback address: brackets, a zone, and an IPv4 address
    seen through a dual-stack socket (``::ffff:127.0.0.1``) allowed; never a DNS look-up."""
    try:
        address = ipaddress.ip_address(host.strip("[]").split("%")[0])
    except ValueError:
        return False
    return (getattr(address, "ipv4_mapped", None) or address).is_loopback


def is_loopback(host: str) -> bool:
    """Whether ``host`` names only loopback addresses: every address a name resolves to (so a
    doctored ``/etc/hosts`` cannot turn ``localhost`` into a public bind)."""
    bare = host.strip().strip("[]")
    if not bare:
        return False
    if loopback_address(bare):
        return True
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(bare, None)}
    except (OSError, UnicodeError):
        return False
    return bool(addresses) and all(loopback_address(a) for a in addresses)


def check_bind(host: str, *, allow_remote: bool) -> str | None:
    """``None`` when the daemon may bind the loopback ``host``, the warning to print for a
    permitted remote one; MpadviseError (exit code 2) for a remote one without ``allow_remote``."""
    if is_loopback(host):
        return None
    if not allow_remote:
        raise MpadviseError(f"--host {host} is not a loopback address; the daemon runs scripts on request, so it "
                            "serves on 127.0.0.1 (or --uds PATH) only; pass --allow-remote to bind it anyway",
                            exit_code=2)
    try:
        user = getpass.getuser()
    except (OSError, KeyError):
        user = "this user"
    return (f"serving on {host}, reachable from other machines: every request except GET /health "
            "needs the token, and anyone holding it can run scripts under the allowed roots as "
            f"{user}; prefer 127.0.0.1 with an SSH tunnel")


def under_roots(path: Path, roots: Sequence[Path]) -> bool:
    return any(path == root or root in path.parents for root in roots)
