"""Serving: the daemon's private files (token, lock, pid and address), binding the address, and
running uvicorn, with the connection limits its httptools parser lacks, until a signal."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
import resource
import secrets
import signal
import socket
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from advisor._hardware import probe_report
from advisor._secure import ensure_private_dir, ensure_private_file, open_private_new
from advisor._version import __version__
from advisor.cache import Store
from advisor.daemon._app import AnswerCache, DaemonState, create_app
from advisor.daemon._client import DaemonPaths, read_token
from advisor.daemon._config import DaemonConfig, check_bind, logger, utc_now_seconds
from advisor.daemon._jobs import JobRunner, recover_jobs, slots_for
from probes import HardwareProfile, MpadviseError, write_file_atomic


def ensure_token(path: Path) -> str:
    """Read the daemon's token, creating it (mode 0600) on first start."""
    with contextlib.suppress(FileExistsError), os.fdopen(open_private_new(path), "w") as handle:
        handle.write(secrets.token_urlsafe(32) + "\n")
    return read_token(path)


def acquire_lock(path: Path) -> int:
    """Hold the lock (0600, ours, never through a symlink): one daemon per cache directory."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    st = os.fstat(fd)
    if st.st_uid != os.geteuid():
        os.close(fd)
        raise MpadviseError(f"daemon lock {path} belongs to uid {st.st_uid}, not to us; remove it, or set "
                            "MPADVISE_HOME to a directory of your own")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise MpadviseError(f"a daemon is already running for {path.parent} (see {path.parent / 'daemon.json'}); "
                            "stop it with `mpadvise daemon stop` or use another MPADVISE_HOME") from None
    return fd


def write_private(path: Path, text: str) -> None:
    """Replace ``path`` whole with ``text``, mode 0600, never through a planted name."""
    write_file_atomic(path, text, mode=0o600)


def _remove_if_ours(path: Path, pid: int) -> None:
    """Remove a pid or address file that names ``pid``; leave one another daemon wrote."""
    with contextlib.suppress(OSError, ValueError):
        text = path.read_text()
        owner = json.loads(text).get("pid") if text.lstrip().startswith("{") else int(text.strip())
        if owner == pid:
            path.unlink()


def _bind(config: DaemonConfig) -> tuple[socket.socket, dict[str, Any]]:
    """Create the listening socket (so port 0 and the socket's mode are ours to control)."""
    if config.uds is not None:
        path = Path(config.uds).absolute()
        if path.exists() or path.is_symlink():
            if not path.is_socket():
                raise MpadviseError(f"--uds {path} exists and is not a socket; choose another path")
            try:
                path.unlink()  # a stale socket from a daemon that died (the lock says none runs)
            except OSError as exc:
                raise MpadviseError(f"--uds {path} is a stale socket this user cannot remove "
                                    f"({exc.strerror or exc}); remove it as its owner, or choose another path",
                                    exit_code=2) from None
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)  # created 0600 from the start: no window where others may connect
        try:
            sock.bind(str(path))
        except OSError as exc:
            sock.close()
            raise MpadviseError(f"cannot listen on {path} ({exc.strerror or exc})") from None
        finally:
            os.umask(old)
        os.chmod(path, 0o600)
        sock.listen(128)
        return sock, {"uds": str(path), "url": f"http+unix://{path}"}
    # getaddrinfo takes an IPv6 literal without the brackets a URL puts around it.
    bare = config.host.strip().removeprefix("[").removesuffix("]")
    try:
        infos = socket.getaddrinfo(bare, config.port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        raise MpadviseError(f"--host {config.host} cannot be resolved ({getattr(exc, 'strerror', None) or exc}); "
                            "give an address such as 127.0.0.1 or ::1", exit_code=2) from None
    family, kind, proto, _, address = infos[0]
    # proto must say TCP: asyncio turns Nagle off only on sockets that do, and with Nagle on,
    # a keep-alive client waits out a 40 ms delayed ACK between a response's two writes.
    sock = socket.socket(family, kind, proto or socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        hint = "; another program uses it: pick another --port (0 picks a free one)" if exc.errno == 98 else ""
        raise MpadviseError(f"cannot listen on {config.host}:{config.port} ({exc.strerror or exc}){hint}") from None
    sock.listen(128)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    return sock, {"host": host, "port": port, "url": f"http://{shown}:{port}"}


def serve(config: DaemonConfig) -> None:
    """Run the daemon in this process until SIGTERM or Ctrl-C."""
    remote_warning = None if config.uds is not None else check_bind(config.host, allow_remote=config.allow_remote)
    for root in config.roots():
        if not root.is_dir():
            raise MpadviseError(f"--allowed-root {root} is not a directory; give an existing directory", exit_code=2)
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s mpadvise daemon: %(message)s", "%Y-%m-%d %H:%M:%S"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    paths = DaemonPaths.here()
    # Whoever can write the cache directory or the daemon's files in it can run code as this
    # user (the store checks the database files). This also tightens a daemon.log that `daemon
    # start` opened under the umask; the token is not tightened but refused by read_token.
    ensure_private_dir(paths.directory)
    for path in (paths.log, paths.pid, paths.address, paths.lock):
        ensure_private_file(path)
    ensure_private_dir(paths.jobs)
    lock = acquire_lock(paths.lock)
    try:
        token = ensure_token(paths.token)
        with Store() as store, Store() as read_store:
            for job in recover_jobs(store):
                logger.info("job %s was running when the last daemon stopped: now %s (attempt %s)",
                            job["id"], job["state"], job["attempts"])
            report = {**probe_report(), "detected_at": utc_now_seconds()}
            slots = slots_for([HardwareProfile.from_dict(d["profile"]) for d in report["devices"]])
            modes = frozenset(name for device in report["devices"] for name in device["modes"])
            runner = JobRunner(store=store, slots=slots, jobs_dir=paths.jobs, roots=config.roots(),
                               retention_s=config.job_retention_days * 86400)
            sock, address = _bind(config)
            address.update(pid=os.getpid(), started_at=utc_now_seconds(), version=__version__,
                           log=str(paths.log), token_file=str(paths.token), slots=[s.name for s in slots],
                           roots=[str(r) for r in config.roots()])
            state = DaemonState(config=config, token=token, store=store, read_store=read_store, report=report,
                                runner=runner, mode_names=modes, answers=AnswerCache(read_store),
                                local_only=config.uds is None and remote_warning is None)
            protocol = limited_protocol()
            server = _Server(uvicorn.Config(
                create_app(state), http=protocol, log_config=None, log_level="warning",
                access_log=False, lifespan="on", server_header=False, timeout_keep_alive=5,
                proxy_headers=False,  # request.client must be the real peer: the Host check depends on it
            ))
            write_private(paths.pid, f"{os.getpid()}\n")
            write_private(paths.address, json.dumps(address, indent=2) + "\n")
            if remote_warning:
                logger.warning(remote_warning)
            logger.info("listening on %s; jobs run on %s; token in %s; at most %d connections", address["url"],
                        ", ".join(s.name for s in slots), paths.token, protocol.max_connections)
            try:
                server.run(sockets=[sock])
            finally:
                sock.close()
                if config.uds is not None:
                    with contextlib.suppress(OSError):
                        Path(address["uds"]).unlink()
                for path in (paths.address, paths.pid):
                    _remove_if_ours(path, os.getpid())
            logger.info("stopped")
    finally:
        os.close(lock)


class _Server(uvicorn.Server):
    """uvicorn's Server without its habit of re-raising SIGTERM after a graceful stop (which
    would kill the process before it removes its pid and address files)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


# A request's line and headers together: a client cannot make the daemon buffer more (431).
MAX_HEADER_BYTES = 64 * 1024
# A connection must deliver a whole request (line, headers, body) this many seconds after it
# opens or after the previous answer, else it is closed: an idle or dribbling client cannot
# hold a connection, and the descriptor behind it, for longer.
REQUEST_TIMEOUT_S = 10.0
# Connections open at once, at most; and descriptors kept out of their reach for the database,
# the job logs and the jobs' pipes (see connection_limit).
MAX_CONNECTIONS = 256
RESERVED_DESCRIPTORS = 256
# How long a refused connection drains the client's bytes before it closes.
_LINGER_S = 2.0
_REASONS = {408: b"Request Timeout", 431: b"Request Header Fields Too Large", 503: b"Service Unavailable"}


def connection_limit(soft_descriptors: int) -> int:
    """Connections open at once for ``RLIMIT_NOFILE``'s soft limit: at most MAX_CONNECTIONS, and
    half of what remains once RESERVED_DESCRIPTORS are set aside."""
    if soft_descriptors < 0:  # RLIM_INFINITY
        return MAX_CONNECTIONS
    return max(1, min(MAX_CONNECTIONS, (soft_descriptors - RESERVED_DESCRIPTORS) // 2, soft_descriptors // 4))


def limited_protocol() -> type[_LimitedProtocol]:
    """uvicorn's httptools protocol (for ``http=``) with the limits, for this RLIMIT_NOFILE."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return type("LimitedHttpProtocol", (_LimitedProtocol,), {"max_connections": connection_limit(soft)})


class _LimitedProtocol(HttpToolsProtocol):
    """The HTTP connection with the daemon's limits; without them any local user could use up its
    descriptors with idle connections, or its memory with one endless header. Past
    ``max_connections`` a new connection closes the longest-idle one, or is refused (503) when all
    are busy; a head over ``MAX_HEADER_BYTES`` gets 431; a connection has ``REQUEST_TIMEOUT_S`` to
    deliver a whole request (an idle one is closed, a dribbled header gets 408). A refusal is
    followed by a lingering close, so that the client reads the answer instead of a reset."""

    max_connections: int

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._waiting_since = 0.0  # when it began waiting for its current request
        self._in_head = True  # reading a request's line and headers
        self._head_bytes = 0
        self._deadline: asyncio.TimerHandle | None = None
        self._refused = False  # answered with a refusal: input is dropped until it closes

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()
        if len(self.connections) <= self.max_connections:
            return
        idle = [c for c in self.connections
                if c is not self and isinstance(c, _LimitedProtocol) and c._idle()]
        if idle:
            min(idle, key=lambda c: c._waiting_since)._close()
        else:
            self._refuse(503, f"the daemon has {self.max_connections} connections open, each busy with a "
                              "request; try again shortly")

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _idle(self) -> bool:
        """Open, and neither handling a request nor receiving one's body."""
        busy = self.cycle is not None and not self.cycle.response_complete
        return self._in_head and not busy and not self.transport.is_closing()

    def _close(self) -> None:
        self._disarm()
        if not self.transport.is_closing():
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # draining before the close
        counted = self._in_head
        if counted:
            self._head_bytes += len(data)
        super().data_received(data)
        # Checked after the parser has had the data, so that a head and a body arriving
        # together count only as far as the head: the parser has said where it ended.
        if self._in_head and counted and self._head_bytes > MAX_HEADER_BYTES:
            self._refuse(431, f"the request's line and headers are over {MAX_HEADER_BYTES} bytes")

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._head_bytes = 0
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._disarm()  # the whole request is in: the application's time is not the client's
        self._in_head = True

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and not self._refused:
            self._arm()

    def _arm(self) -> None:
        self._disarm()
        self._waiting_since = self.loop.time()
        self._deadline = self.loop.call_later(REQUEST_TIMEOUT_S, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self) -> None:
        self._deadline = None
        if self.transport.is_closing() or self._refused:
            return
        if self._head_bytes:
            self._refuse(408, f"the request did not arrive within {REQUEST_TIMEOUT_S:g} s")
        else:
            self._close()  # nothing sent (or a body left unfinished): nothing to answer

    def _refuse(self, status: int, detail: str) -> None:
        """Answer ``status`` and close (lingering); a connection mid-answer is just closed."""
        self._disarm()
        if self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            self.transport.close()
            return
        self._refused = True
        body = json.dumps({"detail": detail}).encode()
        head = (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                b"connection: close\r\n\r\n" % (status, _REASONS[status], len(body)))
        self.transport.write(head + body)
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(_LINGER_S, self._close)
