"""A small client for the local ``mpadvise daemon``: ``tune --submit`` and ``daemon status``.

Standard library only (``http.client``), so the commands that use it import neither FastAPI
nor an HTTP library. It finds the daemon through ``daemon.json`` in the cache directory (a
TCP URL or a Unix socket) and reads the token from ``daemon.token`` beside it.
"""

from __future__ import annotations

import fcntl
import http.client
import json
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

from rich.console import Console
from rich.table import Table

from advisor._paths import cache_dir
from probes import MpadviseError

__all__ = ["DaemonClient", "DaemonPaths", "daemon_running", "read_token", "render_job_result", "submit_tune"]

FINISHED = ("succeeded", "failed", "cancelled", "interrupted")


@dataclass(frozen=True)
class DaemonPaths:
    """The daemon's files, all in the cache directory beside ``mpadvise.db``.

    Args:
        directory: the cache directory (:func:`advisor._paths.cache_dir`).
    """

    directory: Path

    @classmethod
    def here(cls) -> DaemonPaths:
        """The paths for the current cache directory (``MPADVISE_HOME`` or XDG)."""
        return cls(cache_dir())

    @property
    def token(self) -> Path:
        return self.directory / "daemon.token"

    @property
    def pid(self) -> Path:
        return self.directory / "daemon.pid"

    @property
    def log(self) -> Path:
        return self.directory / "daemon.log"

    @property
    def address(self) -> Path:
        """JSON saying where the running daemon listens (written at start, removed at stop)."""
        return self.directory / "daemon.json"

    @property
    def lock(self) -> Path:
        return self.directory / "daemon.lock"

    @property
    def jobs(self) -> Path:
        return self.directory / "jobs"


def read_token(path: Path) -> str:
    """Read the token file, refusing one that others can read.

    Args:
        path: the token file.

    Returns:
        The token text.

    Raises:
        MpadviseError: the file is missing, empty, or not private to its owner.
    """
    try:
        mode = path.stat().st_mode & 0o777
        text = path.read_text().strip()
    except FileNotFoundError:
        raise MpadviseError(
            f"no daemon token at {path}; `mpadvise daemon start` creates it (with the same "
            "MPADVISE_HOME)"
        ) from None
    except OSError as exc:
        raise MpadviseError(f"cannot read the daemon token {path} ({exc.strerror or exc})") from None
    if mode & 0o077:
        raise MpadviseError(
            f"daemon token {path} has mode {mode:04o}; expected 0600 (private to its owner); "
            f"run `chmod 600 {path}`, or delete it to get a new token at the next start"
        )
    if not text:
        raise MpadviseError(f"daemon token {path} is empty; delete it to get a new one at the next start")
    return text


def daemon_running(paths: DaemonPaths) -> bool:
    """Whether a daemon holds this cache directory's lock (it does for as long as it lives).

    Args:
        paths: the daemon files.

    Returns:
        True while a daemon process for this directory is alive; False once it has exited,
        however it ended (the lock goes with its last open file, even under kill -9).
    """
    if not paths.lock.exists():
        return False
    try:
        fd = os.open(paths.lock, os.O_RDWR)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self._path)
        self.sock = sock


class DaemonClient:
    """Talk to one daemon over HTTP (TCP or a Unix socket).

    Args:
        url: ``http://host:port`` of a TCP daemon.
        uds: the Unix socket of a socket daemon (instead of ``url``).
        token: the bearer token, for requests that start or stop work.
        timeout: seconds per request.
    """

    def __init__(self, *, url: str | None = None, uds: str | None = None, token: str | None = None,
                 timeout: float = 10.0) -> None:
        if (url is None) == (uds is None):
            raise ValueError("give exactly one of url and uds")
        self.url = url
        self.uds = uds
        self.token = token
        self.timeout = timeout
        self.roots: list[Path] = []  # where the daemon lets jobs run (from daemon.json)

    @classmethod
    def local(cls, *, need_token: bool = False, timeout: float = 10.0) -> DaemonClient:
        """The daemon of this cache directory, as its ``daemon.json`` says.

        Args:
            need_token: read the token file too (for submitting or cancelling).
            timeout: seconds per request.

        Raises:
            MpadviseError: no daemon has written its address, or the token cannot be read.
        """
        paths = DaemonPaths.here()
        address = _read_address(paths.address)
        if address is None or not daemon_running(paths):
            raise MpadviseError(
                f"no mpadvise daemon is running for {paths.directory}; start one with "
                "`mpadvise daemon start` (with the same MPADVISE_HOME)"
            )
        token = read_token(paths.token) if need_token else None
        if address.get("uds"):
            client = cls(uds=address["uds"], token=token, timeout=timeout)
        else:
            client = cls(url=address["url"], token=token, timeout=timeout)
        client.roots = [Path(root) for root in address.get("roots") or []]
        return client

    @property
    def where(self) -> str:
        return self.url if self.url is not None else f"unix socket {self.uds}"

    def request(self, method: str, path: str, body: Any = None, *, auth: bool = False) -> tuple[int, Any]:
        """One request; returns ``(status, decoded JSON body)``.

        Args:
            method: HTTP method.
            path: path and query, starting with ``/``.
            body: sent as JSON when not ``None``.
            auth: send the bearer token.

        Raises:
            MpadviseError: the daemon cannot be reached or answers with something not JSON.
        """
        headers = {"Accept": "application/json"}
        payload = None
        if body is not None:
            payload = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        if auth and self.token:
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
            raise MpadviseError(
                f"the mpadvise daemon at {self.where} does not answer ({exc}); is it running? "
                "`mpadvise daemon status` tells, `mpadvise daemon start` starts it"
            ) from None
        finally:
            conn.close()
        try:
            data = json.loads(raw) if raw else None
        except ValueError:
            raise MpadviseError(
                f"the daemon at {self.where} answered {method} {path} with HTTP {response.status} "
                "and a body that is not JSON; is something else listening there?"
            ) from None
        return response.status, data

    def call(self, method: str, path: str, body: Any = None, *, auth: bool = False) -> Any:
        """Like :meth:`request`, raising MpadviseError (naming the daemon's reason) unless 2xx."""
        status, data = self.request(method, path, body, auth=auth)
        if 200 <= status < 300:
            return data
        detail = data.get("detail") if isinstance(data, dict) else data
        if isinstance(detail, list):
            detail = "; ".join(
                f"{'.'.join(str(p) for p in d.get('loc', [])[1:]) or 'body'}: {d.get('msg')}" for d in detail
            )
        # Refused requests (bad options, a path outside the roots) are usage errors.
        code = 2 if status in (400, 403, 413, 422) else 1
        raise MpadviseError(f"the daemon refused {method} {path} (HTTP {status}): {detail}", exit_code=code)

    def health(self) -> dict[str, Any]:
        return self.call("GET", "/health")

    def jobs(self, *, limit: int = 100) -> list[dict[str, Any]]:
        return self.call("GET", f"/jobs?limit={limit}")["jobs"]

    def job(self, job_id: str) -> dict[str, Any]:
        return self.call("GET", f"/jobs/{quote(job_id, safe='')}")

    def submit(self, body: dict[str, Any]) -> dict[str, Any]:
        return self.call("POST", "/jobs", body, auth=True)

    def cancel(self, job_id: str) -> dict[str, Any]:
        return self.call("DELETE", f"/jobs/{quote(job_id, safe='')}", auth=True)


def _read_address(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and (data.get("url") or data.get("uds")) else None


def submit_tune(
    script: Path,
    script_args: list[str],
    *,
    options: dict[str, Any],
    device: str | None,
    json_output: bool,
    console: Console,
    poll_s: float = 1.0,
) -> int:
    """Queue a tune with the local daemon, follow it, and report it as ``mpadvise tune`` does.

    Args:
        script: the training script (made absolute here: the daemon's directory is not ours).
        script_args: the script's own arguments.
        options: ``TuneOptions`` fields (``trials``, ``steps``, ``modes``...).
        device: ``cpu`` or ``cuda:N`` to pin the job to that slot; ``None`` for any.
        json_output: print the tune's JSON (exactly what ``tune --json`` prints) on stdout.
        console: where the summary goes.
        poll_s: seconds between looks at the job.

    Returns:
        The tune's exit code: 0 when a stable policy was found, 3 when none was.

    Raises:
        MpadviseError: no daemon, the job was refused, failed, was cancelled or interrupted.
    """
    path = Path(script).expanduser().absolute()
    if not path.is_file():
        raise MpadviseError(f"script {script} does not exist; give the path of a training script")
    if options.get("out") is not None:
        options = {**options, "out": str(Path(options["out"]).expanduser().absolute())}
    client = DaemonClient.local(need_token=True)
    err = Console(stderr=True) if json_output else console
    body: dict[str, Any] = {"script": str(path), "args": list(script_args), "options": options, "gpu": device}
    # Run where a local tune would, in this directory, when the daemon allows it there;
    # otherwise the daemon runs the job in the script's directory.
    cwd = Path(os.path.realpath(os.getcwd()))
    if any(cwd == root or root in cwd.parents for root in client.roots):
        body["cwd"] = str(cwd)
    else:
        err.print(f"note: the job runs in {path.parent} (the daemon does not allow {cwd})", highlight=False)
    job = client.submit(body)
    err.print(f"queued job {job['id']} with the daemon at {client.where}", highlight=False)
    seen = 0
    waiting_shown = None
    try:
        while job["state"] not in FINISHED:
            time.sleep(poll_s)
            job = client.job(job["id"])
            progress = job.get("progress") or {}
            if progress.get("phase") == "waiting" and progress.get("message") != waiting_shown:
                waiting_shown = progress.get("message")
                err.print(waiting_shown, highlight=False)
            count = int(progress.get("lines") or 0)
            recent = progress.get("recent") or []
            if count > seen:
                for line in recent[-min(count - seen, len(recent)):]:
                    err.print(line, highlight=False, markup=False)
                seen = count
    except KeyboardInterrupt:
        client.cancel(job["id"])
        err.print(f"cancelled job {job['id']}", highlight=False)
        raise
    return _finish(job, json_output=json_output, console=console)


def _finish(job: dict[str, Any], *, json_output: bool, console: Console) -> int:
    result = job.get("result") or {}
    if job["state"] != "succeeded" or result.get("tune") is None:
        why = result.get("error") or (job.get("log_tail") or "").strip().splitlines()[-1:] or "no reason recorded"
        if isinstance(why, list):
            why = why[0]
        raise MpadviseError(f"job {job['id']} {job['state']}: {why} (GET /jobs/{job['id']} has its log tail)")
    tune = result["tune"]
    if json_output:
        sys.stdout.write(json.dumps(tune, indent=2, default=str) + "\n")
    else:
        render_job_result(tune, console)
    return int(result.get("exit_code") or 0)


def render_job_result(tune: dict[str, Any], console: Console) -> None:
    """The summary of a tune run by the daemon, from its JSON: ranking, winner, files.

    Args:
        tune: what ``mpadvise tune --json`` printed.
        console: where to print.
    """
    ref = (tune.get("reference") or {}).get("goodput") or 0.0
    table = Table(title=f"{Path(tune.get('script') or '?').name} on {(tune.get('hardware') or {}).get('name', '?')}: "
                  f"{tune.get('trials_run', 0)} trials run", title_justify="left")
    for col, justify in (("", "left"), ("candidate", "left"), ("samples/s", "right"), ("vs fp32", "right"),
                         ("verdict", "left")):
        table.add_column(col, justify=justify, no_wrap=True)
    for cand in tune.get("candidates") or []:
        goodput = cand.get("goodput")
        table.add_row("→" if cand.get("winner") else "", str(cand.get("label")),
                      f"{goodput:,.0f}" if goodput else "-", f"{goodput / ref:.2f}x" if ref and goodput else "-",
                      str(cand.get("outcome") or "ok"))
    console.print(table)
    console.print(f"search stopped: {tune.get('stop_reason')}", highlight=False)
    if tune.get("winner") is None:
        console.print("[bold red]no stable policy fits[/]: every candidate was unstable, out of memory or failed")
        return
    speed = tune.get("speedup_vs_fp32")
    console.print(f"[bold green]winner[/]: {tune.get('winner_label')}" + (f", {speed:.2f}x fp32 goodput" if speed else ""),
                  highlight=False)
    if tune.get("config_file"):
        console.print(f"wrote {tune['config_file']}", highlight=False)
    if tune.get("cache_id") is not None:
        console.print(f"cached for this GPU/CPU as entry #{tune['cache_id']} (mpadvise show)", highlight=False)
    console.print("add to the script: [bold]mp = advisor.load_policy()[/] (it reads the config file beside it)")
