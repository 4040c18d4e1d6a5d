"""Serving: the daemon's private files (token, lock, pid and address), binding the address, and
running uvicorn until a signal."""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import secrets
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import uvicorn

from advisor._hardware import probe_report
from advisor._secure import ensure_private_dir, ensure_private_file, open_private_new
from advisor._version import __version__
from advisor.cache import Store
from advisor.daemon._app import AnswerCache, DaemonState, create_app
from advisor.daemon._client import DaemonPaths, read_token
from advisor.daemon._config import DaemonConfig, check_bind, logger, utc_now_seconds
from advisor.daemon._jobs import JobRunner, Slot, nvml_busy, recover_jobs, slots_for
from advisor.daemon._protocol import limited_protocol
from probes import HardwareProfile, MpadviseError


def ensure_token(path: Path) -> str:
    """Read the daemon's token, creating it (mode 0600) on first start."""
    with contextlib.suppress(FileExistsError), os.fdopen(open_private_new(path), "w") as handle:
        handle.write(secrets.token_urlsafe(32) + "\n")
    return read_token(path)


def acquire_lock(path: Path) -> int:
    """Hold the daemon's lock file (created 0600, ours, never through a symlink), so that one
    daemon runs per cache directory; the descriptor stays open while the daemon runs."""
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
    """Replace ``path`` atomically with ``text``, mode 0600, through a new temporary file created
    exclusively and never through a symlink, so nothing planted under its name can redirect the
    write; one left by a crashed process of the same pid is removed first (unlink removes a
    link, not its target)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    with os.fdopen(open_private_new(tmp), "w") as handle:
        handle.write(text)
    os.replace(tmp, path)


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


def serve(config: DaemonConfig, *, busy: Callable[[Slot], list[int]] | None = None) -> None:
    """Run the daemon in this process until SIGTERM or Ctrl-C (``busy``: PIDs computing on a
    slot's GPU; default NVML)."""
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
            runner = JobRunner(store=store, slots=slots, jobs_dir=paths.jobs, busy=busy or nvml_busy,
                               roots=config.roots(), retention_s=config.job_retention_days * 86400)
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
