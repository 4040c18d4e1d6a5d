"""A small client for the local ``mpadvise daemon`` (``http.client``): it finds the daemon through
``daemon.json`` in the cache directory and reads the token from ``daemon.token`` beside it."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import http.client
import json
import os
import socket
import stat
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

from advisor._paths import cache_dir
from advisor.cache import FINISHED_JOB_STATES
from advisor.daemon._config import loopback_address, under_roots
from advisor.tune import TuneOptions
from probes import MpadviseError


class DaemonPaths:

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.token = directory / "daemon.token"
        self.pid = directory / "daemon.pid"
        self.log = directory / "daemon.log"
        self.address = directory / "daemon.json"  # where it listens, its pid, slots and roots
        self.lock = directory / "daemon.lock"
        self.jobs = directory / "jobs"

    @classmethod
    def here(cls) -> DaemonPaths:
        return cls(cache_dir())

    def read_address(self) -> dict[str, Any]:
        """What ``daemon.json`` says, or ``{}`` when it is missing or unreadable."""
        with contextlib.suppress(OSError, ValueError):
            data = json.loads(self.address.read_text())
            return data if isinstance(data, dict) else {}
        return {}


def read_token(path: Path) -> str:
    """The token file's text; refused when missing, empty, a symlink, another's, or not 0600."""
    try:
        # O_NOFOLLOW and fstat: the checks below are of the file read, not of a link's target.
        with os.fdopen(os.open(path, os.O_RDONLY | os.O_NOFOLLOW)) as handle:
            status = os.fstat(handle.fileno())
            text = handle.read().strip()
    except FileNotFoundError:
        raise MpadviseError(f"no daemon token at {path}; `mpadvise daemon start` creates it (with the same "
                            "MPADVISE_HOME)") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise MpadviseError(f"daemon token {path} is a symbolic link; remove it (`rm {path}`) and "
                                "restart the daemon to get a new token") from None
        raise MpadviseError(f"cannot read the daemon token {path} ({exc.strerror or exc})") from None
    if status.st_uid != os.geteuid():
        raise MpadviseError(f"daemon token {path} belongs to uid {status.st_uid}, not to uid {os.geteuid()} who runs "
                            f"mpadvise; remove it (`rm {path}`), or set MPADVISE_HOME to a directory of your own")
    if (mode := status.st_mode & 0o777) & 0o077:
        raise MpadviseError(f"daemon token {path} has mode {mode:04o}; expected 0600 (private to its owner); "
                            f"run `chmod 600 {path}`, or delete it to get a new token at the next start")
    if not text:
        raise MpadviseError(f"daemon token {path} is empty; delete it to get a new one at the next start")
    return text


def daemon_running(paths: DaemonPaths) -> bool:
    """Whether a daemon holds this cache directory's lock: it does for as long as it lives (the
    lock goes with its last open file, even under kill -9)."""
    try:
        fd = os.open(paths.lock, os.O_RDWR | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self._path)


class DaemonClient:
    """Talk to one daemon over HTTP: ``url`` (``http://host:port``) or the Unix socket ``uds``."""

    def __init__(self, *, url: str | None = None, uds: str | None = None, token: str | None = None,
                 timeout: float = 10.0) -> None:
        self.url, self.uds, self.token, self.timeout = url, uds, token, timeout
        self.roots: list[Path] = []  # where the daemon lets jobs run (from daemon.json)

    @classmethod
    def local(cls, *, need_token: bool = False) -> DaemonClient:
        """The daemon of this cache directory, as its ``daemon.json`` says; the token if asked."""
        paths = DaemonPaths.here()
        address = paths.read_address()
        if not (address.get("url") or address.get("uds")) or not daemon_running(paths):
            raise MpadviseError(f"no mpadvise daemon is running for {paths.directory}; start one with "
                                "`mpadvise daemon start` (with the same MPADVISE_HOME)")
        if need_token:
            _check_token_destination(address, paths)
        client = cls.for_address(address, token=read_token(paths.token) if need_token else None)
        client.roots = [Path(root) for root in address.get("roots") or []]
        return client

    @classmethod
    def for_address(cls, address: dict[str, Any], *, token: str | None = None) -> DaemonClient:
        """A client, from this machine, of the daemon that wrote ``address`` (``daemon.json``)."""
        if address.get("uds"):
            return cls(uds=address["uds"], token=token)
        return cls(url=local_url(str(address["url"])), token=token)

    @property
    def where(self) -> str:
        return self.url if self.url is not None else f"unix socket {self.uds}"

    def request(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        payload = None if body is None else json.dumps(body).encode()
        headers = {"Accept": "application/json", "Content-Type": "application/json"}
        if self.token:  # every request but GET /health needs it
            headers["Authorization"] = f"Bearer {self.token}"
        if self.uds is not None:
            conn: http.client.HTTPConnection = _UnixConnection(self.uds, self.timeout)
        else:
            parts = urlsplit(self.url or "")
            conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port or 80, timeout=self.timeout)
        try:
            conn.request(method, path, body=payload, headers=headers)
            response = conn.getresponse()
            raw = response.read()
        except (OSError, http.client.HTTPException) as exc:
            raise MpadviseError(f"the mpadvise daemon at {self.where} does not answer ({exc}); is it running? "
                                "`mpadvise daemon status` tells, `mpadvise daemon start` starts it") from None
        finally:
            conn.close()
        try:
            return response.status, json.loads(raw) if raw else None
        except ValueError:
            raise MpadviseError(f"the daemon at {self.where} answered {method} {path} with HTTP {response.status} "
                                "and a body that is not JSON; is something else listening there?") from None

    def call(self, method: str, path: str, body: Any = None) -> Any:
        """Like :meth:`request`, raising MpadviseError (naming the daemon's reason) unless 2xx."""
        status, data = self.request(method, path, body)
        if 200 <= status < 300:
            return data
        detail = data.get("detail") if isinstance(data, dict) else data
        if isinstance(detail, list):  # a validation error list, joined into one line
            detail = "; ".join(f"{'.'.join(map(str, d.get('loc', [])[1:])) or 'body'}: {d.get('msg')}"
                               for d in detail)
        # Refused requests (bad options, a path outside the roots) are usage errors.
        raise MpadviseError(f"the daemon refused {method} {path} (HTTP {status}): {detail}",
                            exit_code=2 if status in (400, 403, 413, 422) else 1)

    def health(self) -> dict[str, Any]:
        return self.call("GET", "/health")

    def jobs(self, *, limit: int = 100) -> list[dict[str, Any]]:
        return self.call("GET", f"/jobs?limit={limit}")["jobs"]

    def job(self, job_id: str) -> dict[str, Any]:
        return self.call("GET", f"/jobs/{quote(job_id, safe='')}")

    def submit(self, body: dict[str, Any]) -> dict[str, Any]:
        return self.call("POST", "/jobs", body)

    def cancel(self, job_id: str) -> dict[str, Any]:
        return self.call("DELETE", f"/jobs/{quote(job_id, safe='')}")

    def allows(self, directory: Path) -> bool:
        return under_roots(directory, self.roots)

    def follow(self, job: dict[str, Any], *, on_line: Callable[[str], None], on_waiting: Callable[[str], None],
               poll_s: float = 1.0) -> dict[str, Any]:
        """Look at a job every ``poll_s`` seconds until it finishes; ``on_line`` gets each new line
        of the tune's stderr once, ``on_waiting`` each new message of a job waiting for its GPU."""
        seen, waiting_shown = 0, None
        while job["state"] not in FINISHED_JOB_STATES:
            time.sleep(poll_s)
            job = self.job(job["id"])
            progress = job.get("progress") or {}
            if progress.get("phase") == "waiting" and progress.get("message") != waiting_shown:
                waiting_shown = progress.get("message")
                on_waiting(str(waiting_shown))
            # progress keeps the count of lines so far and the most recent ones
            count = int(progress.get("lines") or 0)
            recent = progress.get("recent") or []
            for line in recent[-min(count - seen, len(recent)):] if count > seen else []:
                on_line(line)
            seen = max(seen, count)
        return job


def _check_token_destination(address: dict[str, Any], paths: DaemonPaths) -> None:
    """Send the token only where it surely reaches our daemon (``daemon.json`` is only as
    trustworthy as its directory): a loopback address, or a Unix socket this user owns."""
    if address.get("uds"):
        with contextlib.suppress(OSError):
            status = os.lstat(address["uds"])
            if stat.S_ISSOCK(status.st_mode) and status.st_uid == os.geteuid():
                return
        where = f"the Unix socket {address['uds']}, which is not a socket of uid {os.geteuid()}"
    else:
        host = urlsplit(local_url(str(address.get("url")))).hostname or ""
        if host == "localhost" or loopback_address(host):
            return
        where = f"{address.get('url')}, which is not a loopback address"
    raise MpadviseError(f"{paths.address} names {where}; not sending the daemon token there. Remove {paths.address} "
                        f"if no daemon of yours runs, and check who can write to {paths.directory}")


def local_url(url: str) -> str:
    """``url`` with a wildcard host (``0.0.0.0``, ``::``) replaced by that family's loopback."""
    parts = urlsplit(url)
    if parts.hostname not in ("0.0.0.0", "::"):  # as the daemon writes them (getsockname)
        return url
    loopback = "[::1]" if parts.hostname == "::" else "127.0.0.1"
    return parts._replace(netloc=f"{loopback}:{parts.port}" if parts.port else loopback).geturl()


def tune_job_body(script: Path, script_args: Sequence[str], options: TuneOptions) -> dict[str, Any]:
    """The ``POST /jobs`` body for a tune, its paths made absolute (the daemon's directory is not
    ours); ``options.device`` pins the job to that slot. The caller may add ``cwd``."""
    path = Path(script).expanduser().absolute()
    if not path.is_file():
        raise MpadviseError(f"script {script} does not exist; give the path of a training script")
    if options.out is not None:
        options = options.with_(out=str(Path(options.out).expanduser().absolute()))
    return {"script": str(path), "args": list(script_args), "options": options.to_dict(job=True), "gpu": options.device}


def finished_tune(job: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """A finished job's tune JSON and exit code; MpadviseError for a job that did not succeed."""
    result = job.get("result") or {}
    if job["state"] != "succeeded" or result.get("tune") is None:
        lines = (job.get("log_tail") or "").strip().splitlines()
        why = result.get("error") or (lines[-1] if lines else "no reason recorded")
        raise MpadviseError(f"job {job['id']} {job['state']}: {why} (GET /jobs/{job['id']} has its log tail)")
    return result["tune"], int(result.get("exit_code") or 0)
