"""A real ``mpadvise daemon run`` on loopback for tests, and plain-HTTP helpers to talk to it."""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent / "scripts"
FINISHED = ("succeeded", "failed", "cancelled", "interrupted")
JOB_DEADLINE_FLOOR_S = 300.0


def daemon_env(home: Path) -> dict[str, str]:
    """The environment of a daemon (and of CLI commands that talk to it) on ``home``."""
    env = dict(os.environ, MPADVISE_HOME=str(home), COLUMNS="200")
    env.pop("MPADVISE_POLICY", None)
    return env


def copy_scripts(root: Path, *names: str) -> None:
    """Put test scripts under the daemon's allowed root."""
    root.mkdir(parents=True, exist_ok=True)
    for name in names:
        shutil.copy(SCRIPTS / name, root / name)


def seed_recommendations(home: Path, count: int) -> None:
    """Store ``count`` recommendations for made-up scripts ``/work/train_N.py``."""
    from advisor.cache._store import Store

    with Store(home / "mpadvise.db") as store:
        for number in range(count):
            store.put_recommendation(
                hardware_fp="testhardware0001", workload_fp=f"{number:016x}", script=f"/work/train_{number}.py",
                policy={"schema": 1, "mode": "bf16-mixed"}, speedup_vs_fp32=1.5, goodput=100.0 + number,
                versions={"torch": "2.13.0"}, summary={"trials": 1},
                trials=[{"number": 0, "mode": "fp32", "outcome": "ok", "verdict": "stable", "goodput": 50.0}],
            )


class Daemon:
    """``mpadvise daemon run --port 0`` in a subprocess; stop it with :meth:`stop` or :meth:`kill`.

    Args:
        home: the cache directory (``MPADVISE_HOME``).
        root: the allowed root for jobs' scripts.
        extra: more ``daemon run`` options.
        nofile: the daemon's soft limit of open descriptors (default: this process's).
        env: more environment variables for the daemon.
    """

    def __init__(self, home: Path, root: Path, *extra: str, nofile: int | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.home = home
        self.nofile = nofile
        self.env = env or {}
        self.root = root
        self.extra = extra
        self.proc: subprocess.Popen[bytes] | None = None
        self.host = "127.0.0.1"
        self.port = 0
        self.token = ""
        self.output = home.parent / f"{home.name}-daemon-output.txt"

    def start(self, timeout: float = 60.0) -> Daemon:
        """Start it and wait until ``daemon.json`` names it and ``/health`` answers."""
        self.home.mkdir(parents=True, exist_ok=True)
        argv = [sys.executable, "-m", "advisor.cli", "daemon", "run", "--port", "0",
                "--allowed-root", str(self.root), *self.extra]
        with open(self.output, "ab") as out:
            self.proc = subprocess.Popen(argv, cwd=ROOT, env={**daemon_env(self.home), **self.env}, stdout=out,
                                         stderr=out, stdin=subprocess.DEVNULL, preexec_fn=self._limits)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {self.proc.returncode}: {self.log()[-3000:]}")
            try:
                info = json.loads((self.home / "daemon.json").read_text())
            except (OSError, ValueError):
                info = {}
            if info.get("pid") == self.proc.pid:
                # A wildcard bind (--allow-remote tests) is still reached through the loopback.
                self.host = "127.0.0.1" if info["host"] in ("0.0.0.0", "::") else info["host"]
                self.port = info["port"]
                self.token = (self.home / "daemon.token").read_text().strip()
                if self.get("/health")[0] == 200:
                    return self
            time.sleep(0.1)
        self.kill()
        raise RuntimeError(f"daemon did not answer within {timeout} s: {self.log()[-3000:]}")

    def _limits(self) -> None:
        if self.nofile is not None:
            import resource

            _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            resource.setrlimit(resource.RLIMIT_NOFILE, (min(self.nofile, hard), hard))

    def log(self) -> str:
        try:
            return self.output.read_text(errors="replace")
        except OSError:
            return ""

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM and wait (SIGKILL if it does not exit); returns its exit code."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def kill(self) -> None:
        """SIGKILL: the daemon dies without cleaning up (its job processes live on)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    # -- HTTP ---------------------------------------------------------------------------

    def request(self, method: str, path: str, body: Any = None, *, token: str | None = None,
                raw: bytes | None = None, headers: dict[str, str] | None = None) -> tuple[int, Any, dict[str, str]]:
        """One request; ``(status, decoded JSON or None, headers)``."""
        conn = http.client.HTTPConnection(self.host, self.port, timeout=30)
        sent = dict(headers or {})
        payload = raw
        if body is not None:
            payload = json.dumps(body).encode()
        if payload is not None:
            sent.setdefault("Content-Type", "application/json")
        if token is not None:
            sent["Authorization"] = f"Bearer {token}"
        try:
            conn.request(method, path, body=payload, headers=sent)
            response = conn.getresponse()
            data = response.read()
            reply_headers = {k.lower(): v for k, v in response.getheaders()}
        finally:
            conn.close()
        try:
            decoded = json.loads(data) if data else None
        except ValueError:
            decoded = data.decode(errors="replace")
        return response.status, decoded, reply_headers

    def get(self, path: str, **kwargs: Any) -> tuple[int, Any]:
        """GET with the token (every read but /health needs it); ``token=None`` sends none."""
        kwargs.setdefault("token", self.token or None)
        status, data, _ = self.request("GET", path, **kwargs)
        return status, data

    def submit(self, script: str, args: list[str] | None = None, **options: Any) -> dict[str, Any]:
        """POST /jobs with the token; the job record (asserts 201)."""
        status, data, _ = self.request("POST", "/jobs", {"script": script, "args": args or [], "options": options},
                                       token=self.token)
        if status != 201:
            raise AssertionError(f"POST /jobs answered {status}: {data}")
        return data

    def wait_job(self, job_id: str, states: tuple[str, ...] = FINISHED, timeout: float = 120.0,
                 until: Any = None) -> dict[str, Any]:
        """Poll GET /jobs/{id} until its state is in ``states`` (and ``until(job)`` holds).

        ``timeout`` is a deadline, never a speed check: it is at least ``JOB_DEADLINE_FLOOR_S``,
        since on a loaded machine a job that fails in ten seconds when idle takes over a minute
        (its tune starts Python, torch and a trial like any other)."""
        timeout = max(timeout, JOB_DEADLINE_FLOOR_S)
        deadline = time.monotonic() + timeout
        job: dict[str, Any] = {}
        while time.monotonic() < deadline:
            status, job = self.get(f"/jobs/{job_id}")
            if status == 200 and job["state"] in states and (until is None or until(job)):
                return job
            time.sleep(0.2)
        raise AssertionError(f"job {job_id} did not reach {states} in {timeout} s: {job}\n{self.log()[-3000:]}")


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` is a live (not zombie) process."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
