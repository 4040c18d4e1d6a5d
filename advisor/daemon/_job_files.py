"""A tune job's files (log, request, result, temporary directory) and processes, and pruning
what old jobs left."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import shutil
import signal
import stat
import subprocess
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from advisor._secure import ensure_private_dir, open_private_new
from advisor.cache import Store
from advisor.daemon._config import JOB_ENV, LOG_TAIL_CHARS, LOG_TAIL_LINES, MAX_JOB_LOGS
from advisor.tune import TuneRequest
from probes import MpadviseError

JOB_TMP = "tmp"  # the jobs directory's subdirectory of the running jobs' temporary directories


class LogTail:
    """The last ``max_lines`` lines of a job's stderr, with a count of every line seen."""

    def __init__(self, max_lines: int = LOG_TAIL_LINES) -> None:
        self._lines: deque[str] = deque(maxlen=max_lines)
        self._lock = threading.Lock()
        self.count = 0

    def add(self, raw: str) -> None:
        """Record one line (a carriage-return redraw keeps only its last state)."""
        line = raw.rstrip("\n").split("\r")[-1].rstrip()
        if not line.strip():
            return
        with self._lock:
            self._lines.append(line[:1000])
            self.count += 1

    def lines(self) -> list[str]:
        with self._lock:
            return list(self._lines)

    def text(self) -> str:
        return "\n".join(self.lines())[-LOG_TAIL_CHARS:]

    def error_line(self) -> str | None:
        lines = self.lines()
        for line in reversed(lines):
            if line.startswith("error:"):
                return line[len("error:"):].strip()
        return lines[-1] if lines else None


@dataclass(frozen=True)
class JobFiles:
    """A job's files: its log (kept), its request and result (removed once the job has ended)."""

    directory: Path
    job_id: str

    @property
    def log(self) -> Path:
        return self.directory / f"{self.job_id}.log"

    @property
    def request(self) -> Path:
        return self.directory / f"{self.job_id}.request.json"

    @property
    def result(self) -> Path:
        return self.directory / f"{self.job_id}.result.json"

    def write_request(self, request: TuneRequest) -> None:
        self.remove()
        with os.fdopen(open_private_new(self.request), "w", encoding="utf-8") as out:
            json.dump(request.to_dict(), out)

    @property
    def tmp(self) -> Path:
        return self.directory / JOB_TMP / self.job_id

    def make_tmp(self) -> Path:
        ensure_private_dir(self.tmp.parent)
        _remove_tree(self.tmp)
        os.mkdir(self.tmp, 0o700)
        return self.tmp

    def remove_tmp(self) -> None:
        _remove_tree(self.tmp)

    def remove_all(self) -> None:
        self.remove()
        self.remove_tmp()
        with contextlib.suppress(OSError):
            self.log.unlink()

    def remove(self) -> None:
        for path in (self.request, self.result):
            with contextlib.suppress(OSError):
                path.unlink()  # unlink never follows a symlink: it removes the link itself


def open_job_log(path: Path) -> Any:
    """Open a job's log (appended to across attempts), never through a symlink: created new or,
    when an earlier attempt left one, reopened only if it is a plain file of ours with one link."""
    try:
        return os.fdopen(open_private_new(path, os.O_WRONLY | os.O_APPEND), "ab")
    except FileExistsError:
        pass
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_nlink != 1 or st.st_mode & 0o077:
        os.close(fd)
        raise MpadviseError(f"job log {path} is not a private file of ours; remove it so that the job can run")
    return os.fdopen(fd, "ab")


def pump_output(stream: Any, tail: LogTail, log: Any) -> None:
    for raw in iter(stream.readline, b""):
        log.write(raw)
        log.flush()
        tail.add(raw.decode("utf-8", errors="replace"))
    stream.close()


def result_of(code: int | None, result_path: Path, tail: LogTail) -> dict[str, Any]:
    """The job result: the tune's result file when it answered (exit 0 or 3), else why it failed."""
    data = None
    with contextlib.suppress(OSError, ValueError):
        text = result_path.read_text(encoding="utf-8", errors="replace")
        data = json.loads(text) if text.strip() else None
    if code in (0, 3) and isinstance(data, dict):
        return {"exit_code": code, "tune": data}
    error = tail.error_line() or f"the tune exited with code {code} and wrote no result"
    return {"exit_code": code, "error": error}


def remove_job_tmp_dirs(jobs_dir: Path) -> None:
    try:
        entries = list(os.scandir(jobs_dir / JOB_TMP))
    except OSError:
        return
    for entry in entries:
        _remove_tree(Path(entry.path))


def _remove_tree(path: Path) -> None:
    """Remove ``path`` and what is in it, never following a symlink (a link is removed itself)."""
    if path.is_symlink() or not path.is_dir():
        with contextlib.suppress(OSError):
            path.unlink()
        return
    # rmtree does not follow the links inside either (it works through descriptors on Linux).
    shutil.rmtree(path, ignore_errors=True)


def prune_job_logs(jobs_dir: Path, *, keep: int = MAX_JOB_LOGS) -> None:
    try:
        logs = sorted((entry for entry in os.scandir(jobs_dir) if entry.name.endswith(".log") and entry.is_file()),
                      key=lambda entry: entry.stat().st_mtime, reverse=True)
    except OSError:
        return
    for entry in logs[keep:]:
        with contextlib.suppress(OSError):
            os.unlink(entry.path)


def prune_jobs(store: Store, jobs_dir: Path, *, retention_s: float) -> list[str]:
    """Delete the jobs that finished more than ``retention_s`` ago, with their files; returns
    their ids. A job log older than that whose job is gone (``mpadvise cache clear``) goes too."""
    cutoff = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(seconds=retention_s)
    ids = store.prune_finished_jobs(finished_before=cutoff.isoformat(timespec="microseconds"))
    for job_id in ids:
        JobFiles(jobs_dir, job_id).remove_all()
    try:
        entries = [entry for entry in os.scandir(jobs_dir) if entry.name.endswith(".log") and entry.is_file()]
    except OSError:
        entries = []
    for entry in entries:
        job_id = entry.name[: -len(".log")]
        with contextlib.suppress(OSError, MpadviseError):
            if entry.stat().st_mtime < cutoff.timestamp() and store.get_job(job_id) is None:
                JobFiles(jobs_dir, job_id).remove_all()
    return ids


def job_pids(job_id: str) -> list[int]:
    """Live processes of one job: this user's whose environment carries its :data:`JOB_ENV` mark
    (Linux's /proc; elsewhere nothing is found)."""
    marker = f"{JOB_ENV}={job_id}".encode()
    found = []
    try:
        entries = list(os.scandir("/proc"))
    except OSError:
        return []
    for entry in entries:
        if not entry.name.isdigit():
            continue
        try:
            with open(os.path.join(entry.path, "environ"), "rb") as handle:
                environ = handle.read()
        except OSError:
            continue
        if marker in environ.split(b"\0"):
            found.append(int(entry.name))
    return found


def kill_job(job_id: str, process: subprocess.Popen[bytes] | None = None) -> None:
    """SIGKILL every process of a job: the tune (``process``, when this daemon started it), its
    process group, and its trials, which run in sessions of their own (so that a trial timeout
    can kill a script's children) and are found by their mark."""
    if process is not None and process.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
    for _ in range(10):
        pids = [pid for pid in job_pids(job_id) if pid != os.getpid()]
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)
