"""A real PostgreSQL server for the tests of one study shared by many workers.

``postgres_server`` starts one throwaway server for the session: ``initdb`` in a temporary
directory, trust authentication on 127.0.0.1 only, a free port, its Unix socket in that same
directory, durability switched off (the data dies with the session anyway), and ``pg_ctl stop``
at the end, even when a test fails. PostgreSQL refuses to run as root, so under root the server
runs as the ``postgres`` user (``runuser``); any other user runs it as itself. Where it cannot
start (no binaries, no ``postgres`` user under root, a server that fails to come up), the tests
that need it are skipped with the reason, which ``-ra`` prints.

``MPADVISE_TEST_PG_BIN`` names the directory holding ``initdb`` and ``pg_ctl`` when they are
not in ``/usr/lib/postgresql/<version>/bin`` or on ``PATH``.
"""

from __future__ import annotations

import hashlib
import os
import pwd
import re
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

PG_BIN_ENV = "MPADVISE_TEST_PG_BIN"
PREFERRED_VERSION = 15
SERVER_USER = "postgres"
START_TIMEOUT_S = 60


@dataclass(frozen=True)
class PostgresServer:
    """A running server: where it listens and how to make databases on it."""

    bin_dir: Path
    base: Path
    port: int
    run_as: str | None  # the user the server runs as when it is not the current one

    @property
    def socket_dir(self) -> Path:
        return self.base

    def url(self, database: str) -> str:
        """The URL a tune takes (``--storage``) for ``database`` on this server."""
        return f"postgresql://{SERVER_USER}@127.0.0.1:{self.port}/{database}"

    def create_database(self, name: str) -> str:
        """Create an empty database; returns its URL."""
        _run(self, "createdb", "-h", str(self.socket_dir), "-p", str(self.port), "-U", SERVER_USER, name)
        return self.url(name)

    def halt(self) -> None:
        """Stop the server as an outage would (``fast``: open connections drop at once),
        keeping its data directory, so that :meth:`restart` brings the same databases back.

        Not ``immediate``: this server runs with ``fsync`` and ``synchronous_commit`` off, so a
        crash would lose transactions it had already reported committed (a trial a worker had
        just asked for was gone after the restart), which a real server's durability never
        allows. ``fast`` writes them out before it stops."""
        _run(self, "pg_ctl", "-D", str(self.base / "data"), "-m", "fast", "-w", "stop")

    def restart(self) -> None:
        """Start a halted server again on the same data directory and port."""
        _pg_start(self)


def find_bin_dir() -> Path | None:
    """Where ``initdb`` and ``pg_ctl`` live: the environment's choice, version 15, the newest
    installed version, or ``PATH``."""
    chosen = os.environ.get(PG_BIN_ENV)
    if chosen:
        return Path(chosen) if (Path(chosen) / "pg_ctl").exists() else None
    root = Path("/usr/lib/postgresql")
    versions = sorted((int(p.name) for p in root.glob("*") if p.name.isdigit()), reverse=True) if root.is_dir() else []
    for version in [PREFERRED_VERSION, *versions]:
        candidate = root / str(version) / "bin"
        if (candidate / "pg_ctl").exists() and (candidate / "initdb").exists():
            return candidate
    on_path = shutil.which("pg_ctl")
    return Path(on_path).parent if on_path and shutil.which("initdb") else None


def why_not_here() -> str | None:
    """Why a server cannot start on this machine, or ``None`` when it can be tried."""
    chosen = os.environ.get(PG_BIN_ENV)
    if chosen and find_bin_dir() is None:
        return f"{PG_BIN_ENV}={chosen} holds no pg_ctl"
    if find_bin_dir() is None:
        return (f"PostgreSQL is not installed (no initdb/pg_ctl in /usr/lib/postgresql/*/bin or on PATH; "
                f"set {PG_BIN_ENV})")
    if os.geteuid() == 0:
        try:
            pwd.getpwnam(SERVER_USER)
        except KeyError:
            return f"running as root, and there is no {SERVER_USER!r} user to run PostgreSQL as (it refuses root)"
        if shutil.which("runuser") is None:
            return f"running as root without runuser, so PostgreSQL cannot be started as {SERVER_USER!r}"
    return None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run(server: PostgresServer, tool: str, *args: str, timeout: float = START_TIMEOUT_S) -> None:
    """Run a PostgreSQL tool as the server's user; raises RuntimeError with its output."""
    argv = [str(server.bin_dir / tool), *args]
    if server.run_as is not None:
        argv = ["runuser", "-u", server.run_as, "--", *argv]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=server.base)
    if proc.returncode != 0:
        output = (proc.stderr or proc.stdout).strip()
        raise RuntimeError(f"{tool} failed (exit {proc.returncode}): {output[-600:]}")


def start_server() -> PostgresServer:
    """Initialise and start a server in a fresh temporary directory.

    Raises:
        RuntimeError: it could not be started, with the tool's own words (the directory is
            removed).
    """
    reason = why_not_here()
    if reason is not None:
        raise RuntimeError(reason)
    bin_dir = find_bin_dir()
    assert bin_dir is not None  # why_not_here checked it
    run_as = SERVER_USER if os.geteuid() == 0 else None
    # Short and in /tmp: a Unix socket path may not exceed about 100 bytes.
    base = Path(tempfile.mkdtemp(prefix="mpa-pg-", dir="/tmp"))
    if run_as is not None:
        entry = pwd.getpwnam(run_as)
        os.chown(base, entry.pw_uid, entry.pw_gid)
    server = PostgresServer(bin_dir=bin_dir, base=base, port=_free_port(), run_as=run_as)
    try:
        _run(server, "initdb", "-D", str(base / "data"), "-U", SERVER_USER, "--auth=trust", "--no-sync",
             "--encoding=UTF8", "--locale=C")
        _pg_start(server)
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        log = _log_tail(base)
        shutil.rmtree(base, ignore_errors=True)
        raise RuntimeError(f"{exc}{'; server log: ' + log if log else ''}") from None
    return server


def _pg_start(server: PostgresServer) -> None:
    """``pg_ctl start`` on the server's data directory, waiting until it accepts connections."""
    options = " ".join([
        f"-p {server.port}", f"-k {server.base}", "-c listen_addresses=127.0.0.1",
        # Throwaway data: no fsync, so that the study's many small commits cost nothing.
        "-c fsync=off", "-c synchronous_commit=off", "-c full_page_writes=off",
    ])
    _run(server, "pg_ctl", "-D", str(server.base / "data"), "-l", str(server.base / "server.log"), "-w",
         "-t", str(START_TIMEOUT_S), "-o", options, "start")


def stop_server(server: PostgresServer) -> None:
    """Stop the server at once and remove its directory."""
    try:
        _run(server, "pg_ctl", "-D", str(server.base / "data"), "-m", "immediate", "-w", "stop")
    except (RuntimeError, OSError, subprocess.TimeoutExpired):
        pass  # already gone; the directory still goes
    finally:
        shutil.rmtree(server.base, ignore_errors=True)


def _log_tail(base: Path) -> str:
    try:
        return (base / "server.log").read_text(errors="replace").strip()[-400:]
    except OSError:
        return ""


def database_name(test_name: str) -> str:
    """A database name for a test: lower case letters, digits and underscores, within
    PostgreSQL's 63 bytes (a long name keeps its start and a digest of the whole)."""
    name = re.sub(r"[^a-z0-9_]", "_", test_name.lower())
    if len(name) <= 60:
        return name
    return f"{name[:51]}_{hashlib.sha256(name.encode()).hexdigest()[:8]}"


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    """One PostgreSQL server for the session; the tests that use it skip where it cannot start."""
    try:
        server = start_server()
    except RuntimeError as exc:
        pytest.skip(f"PostgreSQL cannot start here: {exc}")
    try:
        yield server
    finally:
        stop_server(server)


@pytest.fixture
def postgres_url(postgres_server: PostgresServer, request: pytest.FixtureRequest) -> str:
    """A fresh database on the session's server, named after the test; its URL."""
    return postgres_server.create_database(database_name(request.node.name))
