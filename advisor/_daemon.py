"""``mpadvise daemon``: a local HTTP service for cached answers and queued tune jobs.

The service answers "what should this workload use on this GPU?" from the cache, and runs
``mpadvise tune`` jobs one per GPU (one CPU slot on a machine without one), starting each only
when NVML shows no other compute process on its GPU, so that tuning does not disturb training
that is already running.

A job API that runs scripts is remote code execution when it is reachable: Ray's
unauthenticated job API bound to 0.0.0.0 became CVE-2023-48022. So:

* it binds 127.0.0.1 (or a Unix socket created with mode 0600); any other address needs
  ``allow_remote`` and is announced with a warning;
* every request that starts, cancels or changes work needs the bearer token kept in a 0600
  file in the cache directory; reads are open to loopback clients only;
* on loopback the ``Host`` header must name the loopback, so a web page cannot reach the
  service through DNS rebinding;
* a job's script must exist under an allowed root, and its arguments travel as a list to
  ``exec``, never through a shell; bodies are limited in size and every field is bounded.

The queue lives in the cache database (:mod:`advisor._cache`), so jobs survive a restart: at
start, a job that was running when the last daemon died has its leftover processes killed
and is queued again once (:meth:`Store.requeue_interrupted`), then marked interrupted.

A job runs ``python -m advisor.cli tune SCRIPT --json --device SLOT [options] -- ARGS`` in its
own process group, so its answer lands in the cache exactly as ``mpadvise tune`` stores it.
Its stderr becomes the job's progress and log tail, its stdout JSON the job's result.

The pure decisions (may this address be bound, is this path under a root, which argv runs a
job, what is a log's tail) are plain functions; the HTTP layer, the worker threads and the
processes are shells around them.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import hmac
import ipaddress
import json
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import uvicorn
from fastapi import Depends, FastAPI, Query, Request
from fastapi import Path as PathParam
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints
from starlette.exceptions import HTTPException

from probes import HardwareProfile, MpadviseError

from ._cache import FINISHED_JOB_STATES, JOB_STATES, Store
from ._daemon_client import DaemonPaths, daemon_running, read_token
from ._trials import WAIT_IDLE_ENV

__all__ = [
    "DEFAULT_HOST",
    "DEFAULT_PORT",
    "DaemonConfig",
    "DaemonPaths",
    "JobRequest",
    "JobRunner",
    "LogTail",
    "Slot",
    "TuneOptions",
    "check_bind",
    "create_app",
    "daemon_running",
    "ensure_token",
    "is_loopback",
    "read_token",
    "serve",
    "slots_for",
    "tune_argv",
    "under_roots",
]

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8757
# A job request is a path, a few dozen options and an argument list: 64 KiB is generous, and
# a bound means a client cannot make the daemon buffer (or store) an arbitrary amount.
MAX_BODY_BYTES = 64 * 1024
MAX_ARGS = 256
MAX_TEXT = 4096
# What the job record keeps of a tune's stderr: enough to see why it failed.
LOG_TAIL_LINES = 40
LOG_TAIL_CHARS = 8000
RECENT_LINES = 20
# The environment variable that marks every process of a job (the tune and its trials, which
# run in sessions of their own): how leftovers are found after a crash or a cancel.
JOB_ENV = "MPADVISE_DAEMON_JOB"

logger = logging.getLogger("mpadvise.daemon")


# --------------------------------------------------------------------------------------
# Files and configuration


@dataclass(frozen=True)
class DaemonConfig:
    """How the daemon listens and what it may run.

    Args:
        host: address to bind; loopback unless ``allow_remote``.
        port: TCP port; 0 lets the system pick a free one (written to ``daemon.json``).
        uds: serve on this Unix socket (mode 0600) instead of TCP.
        allow_remote: permit a non-loopback ``host``.
        allowed_roots: directories a job's script (and working directory and config file)
            must be under; empty means the home directory of the user running the daemon.
        max_body_bytes: larger request bodies are refused with 413.
    """

    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    uds: Path | None = None
    allow_remote: bool = False
    allowed_roots: tuple[Path, ...] = ()
    max_body_bytes: int = MAX_BODY_BYTES

    def roots(self) -> tuple[Path, ...]:
        """The allowed roots, resolved (symlinks followed), defaulting to the home directory."""
        raw = self.allowed_roots or (Path.home(),)
        return tuple(Path(os.path.realpath(root)) for root in raw)


# --------------------------------------------------------------------------------------
# Pure decisions


def is_loopback(host: str) -> bool:
    """Whether ``host`` names only loopback addresses.

    Args:
        host: an IP address (IPv6 may be bracketed) or a host name; a name counts as loopback
            when every address it resolves to is one (so a doctored ``/etc/hosts`` cannot
            turn ``localhost`` into a public bind).

    Returns:
        True for 127.0.0.0/8, ::1 and names resolving only to them.
    """
    bare = host.strip().strip("[]")
    if not bare:
        return False
    try:
        return ipaddress.ip_address(bare).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(bare, None)
    except (OSError, UnicodeError):
        return False
    addresses = {info[4][0] for info in infos}
    return bool(addresses) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses)


def check_bind(host: str, *, allow_remote: bool) -> str | None:
    """Decide whether the daemon may bind ``host``.

    Args:
        host: the address asked for.
        allow_remote: the user passed ``--allow-remote``.

    Returns:
        ``None`` for a loopback address, or the warning to print for a permitted remote one.

    Raises:
        MpadviseError: (exit code 2) a non-loopback address without ``allow_remote``.
    """
    if is_loopback(host):
        return None
    if not allow_remote:
        raise MpadviseError(
            f"--host {host} is not a loopback address; the daemon runs scripts on request, so it "
            "serves on 127.0.0.1 (or --uds PATH) only; pass --allow-remote to bind it anyway",
            exit_code=2,
        )
    return (
        f"serving on {host}, reachable from other machines: every request except GET /health "
        "needs the token, and anyone holding it can run scripts under the allowed roots as "
        f"{_user_name()}; prefer 127.0.0.1 with an SSH tunnel"
    )


def under_roots(path: Path, roots: Sequence[Path]) -> bool:
    """Whether ``path`` (already resolved) is one of ``roots`` or inside one.

    Args:
        path: an absolute, symlink-free path.
        roots: resolved directories.

    Returns:
        True when some root contains ``path``.
    """
    return any(path == root or root in path.parents for root in roots)


def tune_argv(
    script: str,
    args: Sequence[str],
    options: Mapping[str, Any],
    slot: str,
    *,
    python: str = sys.executable,
) -> list[str]:
    """The command line that runs one job: ``mpadvise tune`` with ``--json`` on ``slot``.

    Args:
        script: the training script (absolute).
        args: the script's own arguments; after ``--``, so none is read as an option.
        options: validated :class:`TuneOptions` fields; ``None`` values are left to the
            tune's defaults.
        slot: ``"cpu"`` or ``"cuda:N"``, passed as ``--device``.
        python: the interpreter.

    Returns:
        The argv list for ``subprocess.Popen`` (no shell is involved).
    """
    argv = [python, "-m", "advisor.cli", "tune", script, "--json", "--device", slot]
    for name in ("trials", "time_budget", "steps", "warmup", "memory_limit", "timeout", "seed", "out"):
        value = options.get(name)
        if value is not None:
            argv += [f"--{name.replace('_', '-')}", str(value)]
    for mode in options.get("modes") or ():
        argv += ["--mode", mode]
    for flag in ("scale_batch", "include_emulated", "resume", "no_cache", "no_priors"):
        if options.get(flag):
            argv.append(f"--{flag.replace('_', '-')}")
    return [*argv, "--", *args]


class LogTail:
    """The last lines of a job's stderr, with a count of every line seen.

    Args:
        max_lines: lines kept for the log tail.
    """

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
        """The tail as text, at most :data:`LOG_TAIL_CHARS` characters (the newest kept)."""
        return "\n".join(self.lines())[-LOG_TAIL_CHARS:]

    def error_line(self) -> str | None:
        """What the tune said went wrong: its last ``error:`` line, else its last line."""
        lines = self.lines()
        for line in reversed(lines):
            if line.startswith("error:"):
                return line[len("error:"):].strip()
        return lines[-1] if lines else None


# --------------------------------------------------------------------------------------
# The token, the lock and the address file


def ensure_token(path: Path) -> str:
    """Read the daemon's token, creating it (mode 0600) on first start.

    Args:
        path: the token file.

    Returns:
        The token.

    Raises:
        MpadviseError: the file is readable by others or empty.
    """
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return read_token(path)
    with os.fdopen(fd, "w") as handle:
        handle.write(secrets.token_urlsafe(32) + "\n")
    return read_token(path)


def _acquire_lock(path: Path) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise MpadviseError(
            f"a daemon is already running for {path.parent} (see {path.parent / 'daemon.json'}); "
            "stop it with `mpadvise daemon stop` or use another MPADVISE_HOME"
        ) from None
    return fd


def _write_private(path: Path, text: str, mode: int = 0o600) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
    os.replace(tmp, path)


def _remove_if_ours(path: Path, pid: int) -> None:
    with contextlib.suppress(OSError, ValueError):
        text = path.read_text()
        owner = json.loads(text).get("pid") if text.lstrip().startswith("{") else int(text.strip())
        if owner == pid:
            path.unlink()


def _user_name() -> str:
    try:
        import pwd

        return pwd.getpwuid(os.getuid()).pw_name
    except (ImportError, KeyError):
        return "this user"


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


# --------------------------------------------------------------------------------------
# Request and response shapes (validated; the OpenAPI document is built from them)


def _clean_text(value: str) -> str:
    # A NUL cannot be part of a path or an exec argument, and a lone surrogate (valid in
    # JSON's \u escapes) cannot be encoded for the OS or SQLite: refuse both here, as 422,
    # rather than fail deep inside with a 500.
    if "\x00" in value:
        raise ValueError("must not contain a NUL character")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("must be valid Unicode (it has a lone surrogate)") from None
    return value


def _memory_size(value: str) -> str:
    from probes._trial import parse_memory

    try:
        parse_memory(value)
    except MpadviseError as exc:
        raise ValueError(str(exc)) from None
    return value


Text = Annotated[str, StringConstraints(max_length=MAX_TEXT), AfterValidator(_clean_text)]
MemorySize = Annotated[str, StringConstraints(max_length=32), AfterValidator(_clean_text), AfterValidator(_memory_size)]
ModeName = Annotated[str, StringConstraints(pattern=r"^[a-z0-9][a-z0-9._-]{0,31}$")]
SlotName = Annotated[str, StringConstraints(pattern=r"^(cpu|cuda:[0-9]{1,3})$")]
JobState = Literal["queued", "running", "cancelling", "succeeded", "failed", "cancelled", "interrupted"]


class TuneOptions(BaseModel):
    """The ``mpadvise tune`` options a job may set (bounded; the daemon picks the device)."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    trials: int = Field(20, ge=1, le=10_000, description="Trial budget of the search.")
    time_budget: float | None = Field(None, gt=0, le=30 * 86400, description="Seconds after which no new trial starts.")
    steps: int = Field(40, ge=1, le=1_000_000, description="Measured optimizer steps per trial.")
    warmup: int = Field(5, ge=0, le=100_000, description="Warm-up steps per trial, not timed.")
    modes: list[ModeName] = Field(default_factory=list, max_length=16, description="Restrict the search to these modes.")
    scale_batch: bool = Field(False, description="Also try larger global batches.")
    include_emulated: bool = Field(False, description="Also search FP8 emulated on a CPU.")
    memory_limit: MemorySize | None = Field(None, description="e.g. 4GiB: candidates above it are infeasible.")
    timeout: float = Field(600.0, gt=0, le=7 * 86400, description="Seconds before a trial is killed.")
    seed: int = Field(0, ge=0, le=2**31 - 1, description="Seed shared by every trial and the sampler.")
    resume: bool = Field(False, description="Continue the stored study instead of starting afresh.")
    out: Text | None = Field(None, description="Config file to write (absolute, under an allowed root).")
    no_cache: bool = Field(False, description="Do not store the answer in the cache.")
    no_priors: bool = Field(False, description="Measure candidates the matmul priors rule out.")


class JobRequest(BaseModel):
    """A tune job: the script, its arguments (a list, never a shell line) and tune options."""

    model_config = ConfigDict(extra="forbid", strict=True)

    script: Annotated[Text, StringConstraints(min_length=1)] = Field(
        description="Absolute path of the training script, under an allowed root."
    )
    args: list[Text] = Field(default_factory=list, max_length=MAX_ARGS, description="The script's own arguments.")
    options: TuneOptions = Field(default_factory=TuneOptions)
    gpu: SlotName | None = Field(None, description="Run on this slot (cpu or cuda:N); default: the first free one.")
    cwd: Text | None = Field(None, description="Working directory (absolute, under an allowed root); default: the script's.")


class SlotInfo(BaseModel):
    name: str
    uuid: str | None = None
    job: str | None = None
    phase: str


class Health(BaseModel):
    status: Literal["ok"]
    version: str
    pid: int
    started_at: str
    uptime_s: float
    slots: list[SlotInfo]
    jobs: dict[str, int]


class HardwareReport(BaseModel):
    primary: str
    devices: list[dict[str, Any]]
    slots: list[SlotInfo]
    detected_at: str


class Recommendation(BaseModel):
    id: int
    hardware_fp: str
    workload_fp: str
    script: str | None = None
    mode: str
    policy: dict[str, Any]
    speedup_vs_fp32: float | None = None
    goodput: float | None = None
    created_at: str
    versions: dict[str, Any] | None = None
    summary: dict[str, Any] | None = None
    hardware: dict[str, Any] | None = None
    trials: list[dict[str, Any]] | None = None


class RecommendationList(BaseModel):
    count: int
    recommendations: list[Recommendation]


class Job(BaseModel):
    id: str
    state: JobState
    script: str
    args: list[str]
    options: dict[str, Any]
    created_at: str
    started_at: str | None = None
    finished_at: str | None = None
    attempts: int
    progress: dict[str, Any] | None = None
    result: dict[str, Any] | None = None
    log_tail: str | None = None
    gpu: str | None = None
    requested_gpu: str | None = None


class JobList(BaseModel):
    count: int
    jobs: list[Job]


class ErrorBody(BaseModel):
    detail: str


class ValidationItem(BaseModel):
    loc: list[str | int]
    msg: str
    type: str


class ValidationErrorBody(BaseModel):
    detail: list[ValidationItem]


# --------------------------------------------------------------------------------------
# Slots and the job runner


@dataclass(frozen=True)
class Slot:
    """Where one job at a time runs: a GPU (``cuda:N``) or, without one, the CPU.

    Args:
        name: ``"cpu"`` or ``"cuda:N"`` (torch's index, as ``--device`` takes it).
        index: the CUDA index, ``None`` for the CPU.
        uuid: the GPU's UUID, which NVML matches whatever ``CUDA_VISIBLE_DEVICES`` says.
    """

    name: str
    index: int | None = None
    uuid: str | None = None


def slots_for(profiles: Sequence[HardwareProfile]) -> list[Slot]:
    """One slot per CUDA device; one CPU slot when there is none.

    Args:
        profiles: what :func:`probes.detect` found.

    Returns:
        The slots, GPUs in torch's order.
    """
    gpus = [Slot(f"cuda:{p.index}", p.index, p.uuid) for p in profiles if p.is_cuda and p.index is not None]
    return gpus or [Slot("cpu")]


def nvml_busy(slot: Slot) -> list[int]:
    """PIDs computing on the slot's GPU (none for the CPU slot)."""
    if slot.index is None:
        return []
    from probes import gpu_busy

    return gpu_busy(slot.index, uuid=slot.uuid)


def job_pids(job_id: str, proc: Path = Path("/proc")) -> list[int]:
    """Live processes of one job: those whose environment carries its :data:`JOB_ENV` mark.

    Args:
        job_id: the job.
        proc: the proc file system (Linux); elsewhere nothing is found.

    Returns:
        The PIDs (this user's processes only: others' environments are unreadable).
    """
    marker = f"{JOB_ENV}={job_id}".encode()
    found = []
    try:
        entries = list(os.scandir(proc))
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
    """SIGKILL every process of a job: the tune, its process group, and its trials.

    The trials run in sessions of their own (so that a trial timeout can kill a script's
    children), so killing the tune's group is not enough; they are found by their mark.

    Args:
        job_id: the job.
        process: the tune process, when this daemon started it.
    """
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


@dataclass
class _SlotState:
    job: str | None = None
    phase: str = "idle"


@dataclass
class JobRunner:
    """One worker thread per slot: claim the oldest job, wait for an idle GPU, run the tune.

    Args:
        store: the cache store (shared, thread-safe).
        slots: where jobs run.
        jobs_dir: where each job's full log goes.
        busy: PIDs computing on a slot's GPU (NVML; tests pass a fake).
        python: the interpreter that runs ``advisor.cli tune``.
        poll_s: how often a running job is checked for cancellation and progress.
        gpu_poll_s: how often a waiting job asks NVML again.
        idle_poll_s: how often an idle worker looks at the queue without being woken.
    """

    store: Store
    slots: Sequence[Slot]
    jobs_dir: Path
    busy: Callable[[Slot], list[int]] = nvml_busy
    python: str = sys.executable
    poll_s: float = 0.25
    gpu_poll_s: float = 2.0
    idle_poll_s: float = 2.0
    _stop: threading.Event = field(default_factory=threading.Event)
    _wake: dict[str, threading.Event] = field(default_factory=dict)
    _cancel: set[str] = field(default_factory=set)
    _cancel_lock: threading.Lock = field(default_factory=threading.Lock)
    _threads: list[threading.Thread] = field(default_factory=list)
    _state: dict[str, _SlotState] = field(default_factory=dict)

    def start(self) -> None:
        """Start one worker thread per slot."""
        # Job logs can quote a script's arguments and output: this user's eyes only.
        self.jobs_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        for slot in self.slots:
            self._wake[slot.name] = threading.Event()
            self._state[slot.name] = _SlotState()
            thread = threading.Thread(target=self._work, args=(slot,), name=f"mpadvise-job-{slot.name}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def wake(self) -> None:
        """Tell idle workers that a job was queued."""
        for event in self._wake.values():
            event.set()

    def cancel(self, job_id: str) -> None:
        """Ask the worker running ``job_id`` to stop it (the store already says cancelling)."""
        with self._cancel_lock:
            self._cancel.add(job_id)

    def slot_info(self) -> list[dict[str, Any]]:
        """Each slot, the job on it and what that job is doing."""
        return [
            {"name": s.name, "uuid": s.uuid, "job": self._state.get(s.name, _SlotState()).job,
             "phase": self._state.get(s.name, _SlotState()).phase}
            for s in self.slots
        ]

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the workers, killing running jobs; they stay ``running`` in the store, so the
        next daemon queues them again (once)."""
        self._stop.set()
        self.wake()
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    # -- worker ------------------------------------------------------------------------

    def _cancelled(self, job_id: str) -> bool:
        with self._cancel_lock:
            return job_id in self._cancel

    def _work(self, slot: Slot) -> None:
        state = self._state[slot.name]
        while not self._stop.is_set():
            try:
                job = self.store.claim_next_job(slot.name)
            except MpadviseError as exc:
                logger.warning("cannot read the job queue: %s", exc)
                self._stop.wait(self.idle_poll_s)
                continue
            if job is None:
                wake = self._wake[slot.name]
                wake.wait(self.idle_poll_s)
                wake.clear()
                continue
            state.job, state.phase = job["id"], "starting"
            try:
                self._run(job, slot, state)
            except Exception as exc:  # a worker must outlive any one job
                logger.exception("job %s failed inside the daemon", job["id"])
                with contextlib.suppress(MpadviseError):
                    self.store.finish_job(job["id"], state="failed",
                                          result={"exit_code": None, "error": f"daemon error: {exc}"})
            finally:
                state.job, state.phase = None, "idle"
                with self._cancel_lock:
                    self._cancel.discard(job["id"])

    def _asked_to_cancel(self, job_id: str, record: dict[str, Any] | None) -> bool:
        return self._cancelled(job_id) or record is None or record.get("state") == "cancelling"

    def _wait_for_idle_gpu(self, job: dict[str, Any], slot: Slot, state: _SlotState) -> bool:
        """Block until no other process computes on the slot's GPU. False: cancel or stop."""
        while True:
            pids = self.busy(slot)
            if not pids:
                return True
            state.phase = "waiting"
            record = self.store.update_job(job["id"], progress={
                "phase": "waiting", "slot": slot.name, "waiting_for_pids": pids, "updated_at": _now(),
                "message": f"waiting for {slot.name} to be idle: PIDs {', '.join(map(str, pids))} compute on it",
            })
            if self._asked_to_cancel(job["id"], record):
                self.store.finish_job(job["id"], state="cancelled")
                logger.info("job %s cancelled while waiting for %s", job["id"], slot.name)
                return False
            if self._stop.wait(self.gpu_poll_s):
                return False

    def _run(self, job: dict[str, Any], slot: Slot, state: _SlotState) -> None:
        job_id = job["id"]
        if not self._wait_for_idle_gpu(job, slot, state):
            return
        options = job.get("options") or {}
        argv = tune_argv(job["script"], job.get("args") or [], options, slot.name, python=self.python)
        env = dict(os.environ)
        env[JOB_ENV] = job_id
        env[WAIT_IDLE_ENV] = "1"  # and before every trial, not only before the tune starts
        env["COLUMNS"] = "160"  # the tune's lines are read back one by one: no wrapping
        env.pop("MPADVISE_POLICY", None)
        cwd = options.get("cwd") or os.path.dirname(job["script"])
        log_path = self.jobs_dir / f"{job_id}.log"
        out_path = self.jobs_dir / f"{job_id}.out"
        tail = LogTail()
        state.phase = "running"
        logger.info("job %s started on %s: %s", job_id, slot.name, " ".join(argv[3:]))
        with open(log_path, "ab") as log, open(out_path, "wb") as out:
            process = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.PIPE, cwd=cwd, env=env,
                start_new_session=True,  # its own group: a cancel kills it without touching us
            )
            pump = threading.Thread(target=_pump, args=(process.stderr, tail, log), daemon=True)
            pump.start()
            outcome, progress = self._follow(job_id, slot, process, tail)
            pump.join(timeout=5)
        if outcome == "stopped":
            logger.info("job %s interrupted by the daemon stopping; it runs again at the next start", job_id)
            return
        if outcome == "cancelled":
            self.store.finish_job(job_id, state="cancelled", log_tail=tail.text())
            logger.info("job %s cancelled", job_id)
            return
        code = process.returncode
        result = _result_of(code, out_path, tail)
        final = "succeeded" if result.get("tune") is not None else "failed"
        # The last lines first, so a follower that sees the job finished has seen them all.
        self.store.update_job(job_id, progress={**progress, "phase": "finished", "exit_code": code,
                                                "lines": tail.count, "recent": tail.lines()[-RECENT_LINES:],
                                                "updated_at": _now()})
        self.store.finish_job(job_id, state=final, result=result, log_tail=tail.text())
        with contextlib.suppress(OSError):
            out_path.unlink()
        logger.info("job %s %s (exit code %s)", job_id, final, code)

    def _follow(self, job_id: str, slot: Slot, process: subprocess.Popen[bytes],
                tail: LogTail) -> tuple[str, dict[str, Any]]:
        """Watch a running tune until it exits ("exited"), is cancelled, or the daemon stops.

        Returns:
            The outcome and the job's progress record so far.
        """
        progress: dict[str, Any] = {"phase": "running", "slot": slot.name, "pid": process.pid}
        foreign: set[int] = set()
        last_update = 0.0
        last_count = -1
        dirty = False
        last_gpu_check = time.monotonic()
        record: dict[str, Any] | None = self.store.update_job(job_id, progress={**progress, "updated_at": _now()})
        while True:
            try:
                process.wait(timeout=self.poll_s)
                return "exited", progress
            except subprocess.TimeoutExpired:
                pass
            if self._stop.is_set():
                kill_job(job_id, process)
                process.wait()
                return "stopped", progress
            if self._asked_to_cancel(job_id, record):
                kill_job(job_id, process)
                process.wait()
                return "cancelled", progress
            now = time.monotonic()
            if slot.index is not None and now - last_gpu_check >= self.gpu_poll_s:
                # The tune's own trials compute on this GPU too; anything else is someone
                # else's work that started after ours, and it skews what we measure.
                last_gpu_check = now
                ours = set(job_pids(job_id))
                others = set(self.busy(slot)) - ours
                if others - foreign:
                    foreign |= others
                    logger.warning("job %s: PIDs %s started computing on %s during the tune", job_id,
                                   sorted(others), slot.name)
                    progress["foreign_gpu_pids"] = sorted(foreign)
                    dirty = True
            changed = dirty or tail.count != last_count
            # At most one write a second while lines come in, one every 5 s when quiet.
            if (changed and now - last_update >= 1.0) or now - last_update >= 5.0:
                dirty = False
                last_count = tail.count
                last_update = now
                recent = tail.lines()[-RECENT_LINES:]
                record = self.store.update_job(job_id, log_tail=tail.text(), progress={
                    **progress, "lines": tail.count, "recent": recent, "updated_at": _now(),
                })


def _pump(stream: Any, tail: LogTail, log: Any) -> None:
    for raw in iter(stream.readline, b""):
        log.write(raw)
        log.flush()
        tail.add(raw.decode("utf-8", errors="replace"))
    stream.close()


def _result_of(code: int | None, out_path: Path, tail: LogTail) -> dict[str, Any]:
    """The job result: the tune's JSON when it answered (exit 0 or 3), else why it failed."""
    data = None
    with contextlib.suppress(OSError, ValueError):
        text = out_path.read_text(encoding="utf-8", errors="replace")
        data = json.loads(text) if text.strip() else None
    if code in (0, 3) and isinstance(data, dict):
        return {"exit_code": code, "tune": data}
    error = tail.error_line() or f"mpadvise tune exited with code {code} and no output"
    return {"exit_code": code, "error": error}


def recover_jobs(store: Store, *, max_retries: int = 1) -> list[dict[str, Any]]:
    """At start: kill what is left of jobs the last daemon was running, and queue them again.

    A daemon killed with -9 leaves its tune processes running (they are in their own process
    groups); left alone they would store an answer while the same job runs again.

    Args:
        store: the cache store.
        max_retries: how many restarts a job survives.

    Returns:
        The jobs changed (now queued, interrupted or cancelled).
    """
    for job in store.list_jobs(states=("running", "cancelling")):
        kill_job(job["id"])
    return store.requeue_interrupted(max_retries=max_retries)


# --------------------------------------------------------------------------------------
# The HTTP application


@dataclass
class DaemonState:
    """What the request handlers share: stores, hardware, token, runner."""

    config: DaemonConfig
    token: str
    store: Store
    read_store: Store
    report: dict[str, Any]
    slots: list[Slot]
    runner: JobRunner
    mode_names: frozenset[str]
    answers: AnswerCache
    started: float = field(default_factory=time.time)
    started_at: str = field(default_factory=_now)
    local_only: bool = True


def _json_bytes(data: Any) -> bytes:
    # Plain json with ASCII escapes: no response model is re-validated on the hot path, and
    # no stored text can make encoding fail.
    return json.dumps(data, separators=(",", ":"), default=str).encode()


def _json(data: Any, status: int = 200, headers: Mapping[str, str] | None = None) -> Response:
    return Response(_json_bytes(data), status_code=status, headers=headers, media_type="application/json")


class AnswerCache:
    """Encoded ``GET /recommendations`` answers, valid until anyone commits to the database.

    SQLite's ``PRAGMA data_version`` changes when another connection (in this process or any
    other: a tune storing its answer, ``mpadvise cache clear``) commits, and costs a few
    microseconds, against the query, the JSON decoding of every row and the encoding of the
    answer. Bounded: past ``max_entries`` distinct queries it starts afresh.

    Args:
        store: the store whose connection is only read from (its data_version would not
            change for its own writes).
        max_entries: distinct queries kept.
    """

    def __init__(self, store: Store, max_entries: int = 256) -> None:
        self._store = store
        self._max = max_entries
        self._answers: dict[Any, bytes] = {}
        self._version: int | None = None

    def _current(self) -> int | None:
        try:
            return int(self._store.db.execute("PRAGMA data_version").fetchone()[0])
        except Exception:  # a closed or replaced connection: never serve from the cache then
            return None

    def get(self, key: Any) -> bytes | None:
        """The stored answer for ``key`` if nothing was committed since it was stored."""
        version = self._current()
        if version is None or version != self._version:
            self._answers.clear()
            self._version = version
            return None
        return self._answers.get(key)

    def put(self, key: Any, body: bytes) -> None:
        if self._version is None:
            return
        if len(self._answers) >= self._max:
            self._answers.clear()
        self._answers[key] = body


def _error_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    text = {400: "Bad Host header, or a body that is not JSON", 401: "Token missing", 403: "Token wrong, or path outside the allowed roots",
            404: "No such job", 409: "The job has already finished", 413: "Body too large",
            422: "Invalid request: each item says where (loc) and what (msg)",
            503: "The cache database is busy or unusable"}
    if 422 in codes:
        return {**{code: {"model": ErrorBody, "description": text[code]} for code in codes if code != 422},
                422: {"model": ValidationErrorBody, "description": text[422]}}
    return {code: {"model": ErrorBody, "description": text[code]} for code in codes}


class _Guard:
    """ASGI middleware: Host check on loopback, and the body size limit (413).

    Plain ASGI rather than a Starlette ``BaseHTTPMiddleware``: it adds nothing measurable to a
    GET, and it refuses an oversized body before the application reads it.
    """

    def __init__(self, app: Any, *, max_body: int, check_host: bool) -> None:
        self.app = app
        self.max_body = max_body
        self.check_host = check_host

    async def __call__(self, scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = None
        host = None
        for name, value in scope["headers"]:
            if name == b"content-length":
                length = value
            elif name == b"host":
                host = value
        if self.check_host and not _loopback_host_header(host):
            await _send_error(send, 400, "the Host header must name the loopback (127.0.0.1, localhost or [::1]); "
                                         "this daemon serves local clients only")
            return
        if length is not None:
            try:
                size = int(length)
            except ValueError:
                await _send_error(send, 400, "Content-Length is not a number")
                return
            if size > self.max_body:
                await _send_error(send, 413, f"request body is {size} bytes; the limit is {self.max_body}")
                return
        if scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        # A chunked body has no length up front: read it (bounded) before the app does.
        chunks, total = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                await self.app(scope, _replay([message], receive), send)
                return
            chunk = message.get("body", b"")
            total += len(chunk)
            if total > self.max_body:
                await _send_error(send, 413, f"request body is over the limit of {self.max_body} bytes")
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        await self.app(scope, _replay([body], receive), send)


def _replay(messages: list[dict[str, Any]], receive: Callable[..., Any]) -> Callable[..., Any]:
    async def replayed() -> dict[str, Any]:
        if messages:
            return messages.pop(0)
        return await receive()

    return replayed


async def _send_error(send: Callable[..., Any], status: int, detail: str) -> None:
    body = json.dumps({"detail": detail}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


_LOOPBACK_HOSTS = frozenset({b"127.0.0.1", b"localhost", b"[::1]"})


def _loopback_host_header(host: bytes | None) -> bool:
    if not host:
        return False
    name = host.rsplit(b":", 1)[0] if not host.endswith(b"]") else host
    if name in _LOOPBACK_HOSTS:
        return True
    # 127.0.0.0/8 as a whole is loopback; only literal addresses count (no DNS look-up here).
    return _client_is_loopback(name.decode("ascii", errors="replace").strip("[]"))


_bearer = HTTPBearer(auto_error=False, description="The contents of daemon.token in the cache directory.")


async def _require_token(
    request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
) -> None:
    """The bearer token, for every request that starts or stops work (401 missing, 403 wrong)."""
    token: str = request.app.state.daemon.token
    if credentials is None:
        raise HTTPException(401, "this request needs `Authorization: Bearer <token>`; the token is in "
                                 "daemon.token in the cache directory", headers={"WWW-Authenticate": "Bearer"})
    if not hmac.compare_digest(credentials.credentials.encode("utf-8", "replace"), token.encode()):
        raise HTTPException(403, "wrong token; read it again from daemon.token in the cache directory "
                                 "(it changes when the file is deleted)")


async def _require_read(request: Request) -> None:
    """Reads are open to this machine only; a remote client (possible with --allow-remote) must
    show the token for them too."""
    client = request.client
    if client is None or not client.host or _client_is_loopback(client.host):
        return
    token: str = request.app.state.daemon.token
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.encode("utf-8", "replace"), token.encode()):
        raise HTTPException(401, "reads from other machines need `Authorization: Bearer <token>`",
                            headers={"WWW-Authenticate": "Bearer"})


def create_app(state: DaemonState) -> FastAPI:
    """The FastAPI application over ``state``; the lifespan starts and stops the job runner.

    Args:
        state: stores, hardware report, token and runner.

    Returns:
        The ASGI app (with the Host and body-size guard around it).
    """
    from advisor import __version__

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        state.runner.start()
        try:
            yield
        finally:
            state.runner.stop()

    app = FastAPI(
        title="mpadvise daemon",
        version=__version__,
        summary="Cached precision recommendations and queued tune jobs for this machine.",
        description=(
            "Reads are open to loopback clients. `POST /jobs` and `DELETE /jobs/{id}` need "
            "`Authorization: Bearer <token>`, the token being the contents of `daemon.token` "
            "in the cache directory (mode 0600)."
        ),
        docs_url=None,
        redoc_url=None,
        openapi_url="/openapi.json",
        lifespan=lifespan,
    )
    app.state.daemon = state

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> Response:
        # The default handler echoes each input back (up to the whole body) and cannot encode
        # a lone surrogate; say where and what, nothing more.
        errors = [{"loc": list(e.get("loc", ())), "msg": e.get("msg", ""), "type": e.get("type", "")}
                  for e in exc.errors()]
        return _json({"detail": errors}, 422)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException) -> Response:
        headers = dict(exc.headers or {})
        if exc.status_code == 405:
            # Starlette names only the methods of the first route on the path; a client (and
            # RFC 9110) needs all of them.
            headers["Allow"] = ", ".join(_allowed_methods(app, request.scope))
        return _json({"detail": exc.detail}, exc.status_code, headers=headers)

    @app.exception_handler(MpadviseError)
    async def _store_error(_: Request, exc: MpadviseError) -> Response:
        return _json({"detail": str(exc)}, 503)

    @app.get("/health", response_model=Health, tags=["service"], responses=_error_responses(400))
    async def health() -> Response:
        """Whether the daemon answers, its slots, and how many jobs are in each state."""
        counts = {name: 0 for name in JOB_STATES}
        for job in state.read_store.list_jobs(states=("queued", "running", "cancelling")):
            counts[job["state"]] += 1
        return _json({
            "status": "ok", "version": __version__, "pid": os.getpid(), "started_at": state.started_at,
            "uptime_s": round(time.time() - state.started, 3), "slots": state.runner.slot_info(),
            "jobs": {k: v for k, v in counts.items() if k in ("queued", "running", "cancelling")},
        })

    @app.get("/hardware", response_model=HardwareReport, tags=["service"], dependencies=[Depends(_require_read)],
             responses=_error_responses(400, 401))
    async def hardware() -> Response:
        """This machine's devices (as `mpadvise probe --json` reports them) and the job slots."""
        return _json({**state.report, "slots": state.runner.slot_info()})

    @app.get("/recommendations", response_model=RecommendationList, tags=["cache"],
             responses=_error_responses(400, 401, 422, 503))
    async def recommendations(
        request: Request,
        workload: Annotated[str | None, Query(pattern=r"^[0-9a-f]{16,64}$", description="Workload fingerprint.")] = None,
        script: Annotated[str | None, Query(min_length=1, max_length=MAX_TEXT,
                                            description="Script path, or its file name.")] = None,
        hardware: Annotated[str | None, Query(pattern=r"^[A-Za-z0-9][\x21-\x7e]{0,255}$",
                                              description="Hardware fingerprint (GET /hardware lists this machine's).")] = None,
        trials: Annotated[bool, Query(description="Include each entry's trials.")] = False,
        limit: Annotated[int, Query(ge=1, le=1000, description="At most this many, newest first.")] = 100,
    ) -> Response:
        """Cached recommendations, newest first, filtered by workload, script and hardware."""
        # Called here rather than as a dependency: the hottest path, and FastAPI's dependency
        # resolution costs a tenth of a request.
        await _require_read(request)
        key = (workload, script, hardware, trials, limit)
        body = state.answers.get(key)
        if body is None:
            rows = state.read_store.find_recommendations(
                hardware_fp=hardware, script=script, workload_fp=workload, with_trials=trials
            )
            body = _json_bytes({"count": len(rows), "recommendations": rows[:limit]})
            state.answers.put(key, body)
        return Response(body, media_type="application/json")

    @app.post("/jobs", response_model=Job, status_code=201, tags=["jobs"], dependencies=[Depends(_require_token)],
              responses=_error_responses(400, 401, 403, 413, 422, 503))
    def create_job(request: JobRequest) -> Response:
        """Queue a tune job; it runs when a slot (and its GPU) is free."""
        roots = state.config.roots()
        script = _checked_path(request.script, roots, "script", want="file")
        cwd = _checked_path(request.cwd, roots, "cwd", want="dir") if request.cwd is not None else None
        options = request.options.model_dump()
        if request.options.out is not None:
            out = _checked_path(request.options.out, roots, "options.out", want="new")
            options["out"] = str(out)
        unknown = sorted(set(request.options.modes) - state.mode_names)
        if unknown:
            raise _invalid(["body", "options", "modes"], f"unknown mode {', '.join(unknown)}; "
                                     f"expected some of {', '.join(sorted(state.mode_names))}")
        names = [slot.name for slot in state.slots]
        if request.gpu is not None and request.gpu not in names:
            raise _invalid(["body", "gpu"], f"gpu {request.gpu!r} is not a slot of this daemon; expected one of "
                                     f"{', '.join(names)} (or none for the first free one)")
        if cwd is not None:
            options["cwd"] = str(cwd)
        job_id = state.store.enqueue_job(script=str(script), args=request.args, options=options, gpu=request.gpu)
        state.runner.wake()
        job = state.store.get_job(job_id)
        return _json(job, 201, headers={"Location": f"/jobs/{job_id}"})

    @app.get("/jobs", response_model=JobList, tags=["jobs"], dependencies=[Depends(_require_read)],
             responses=_error_responses(400, 401, 422, 503))
    async def list_jobs(
        state_filter: Annotated[list[JobState] | None, Query(alias="state", description="Only jobs in these states.")] = None,
        limit: Annotated[int, Query(ge=1, le=1000, description="At most this many, the newest.")] = 100,
    ) -> Response:
        """Jobs in queue order (oldest first); the newest ``limit`` of them."""
        jobs = state.read_store.list_jobs(states=state_filter)
        return _json({"count": len(jobs), "jobs": jobs[-limit:]})

    @app.get("/jobs/{job_id}", response_model=Job, tags=["jobs"], dependencies=[Depends(_require_read)],
             responses=_error_responses(400, 401, 404, 422, 503))
    async def get_job(job_id: Annotated[str, PathParam(max_length=64)]) -> Response:
        """One job: state, progress, result (the tune's JSON) and the tail of its log."""
        job = state.read_store.get_job(job_id)
        if job is None:
            raise HTTPException(404, f"no job {job_id!r}; GET /jobs lists them")
        return _json(job)

    @app.delete("/jobs/{job_id}", response_model=Job, tags=["jobs"], dependencies=[Depends(_require_token)],
                responses={**_error_responses(400, 401, 403, 404, 409, 422, 503),
                           202: {"model": Job, "description": "Cancelling: the running tune is being stopped"}})
    def cancel_job(job_id: Annotated[str, PathParam(max_length=64)]) -> Response:
        """Cancel a job: a queued one at once (200), a running one by killing its tune (202)."""
        before = state.store.get_job(job_id)
        if before is None:
            raise HTTPException(404, f"no job {job_id!r}; GET /jobs lists them")
        if before["state"] in FINISHED_JOB_STATES:
            raise HTTPException(409, f"job {job_id} has already finished ({before['state']}); nothing to cancel")
        job = state.store.cancel_job(job_id)
        state.runner.cancel(job_id)
        if job is None:  # deleted in between: the cache was cleared
            raise HTTPException(404, f"no job {job_id!r}; GET /jobs lists them")
        return _json(job, 202 if job["state"] == "cancelling" else 200)

    return _Guard(app, max_body=state.config.max_body_bytes, check_host=state.local_only)  # type: ignore[return-value]


def _allowed_methods(app: Any, scope: dict[str, Any]) -> list[str]:
    from starlette.routing import Match

    methods: set[str] = set()
    for route in app.router.routes:
        match, _ = route.matches(scope)
        if match != Match.NONE and getattr(route, "methods", None):
            methods |= set(route.methods)
    return sorted(methods)


def _client_is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _invalid(loc: list[str], message: str) -> HTTPException:
    """A 422 shaped like FastAPI's own (``detail`` a list of ``loc``/``msg``/``type``), so that
    a client reads every validation failure the same way."""
    return HTTPException(422, [{"loc": loc, "msg": message, "type": "value_error"}])


def _checked_path(raw: str, roots: Sequence[Path], what: str, *, want: Literal["file", "dir", "new"]) -> Path:
    """Resolve a path from a request and check it against the allowed roots (403/422)."""
    if not os.path.isabs(raw):
        raise _invalid(["body", *what.split(".")], f"{what} {raw!r} is not absolute; send the full path (the daemon's working "
                                 "directory is not yours)")
    try:
        path = Path(os.path.realpath(raw))
    except (OSError, ValueError) as exc:
        raise _invalid(["body", *what.split(".")], f"{what} {raw!r} cannot be resolved ({exc})") from None
    if not under_roots(path, roots):
        raise HTTPException(403, f"{what} {raw!r} is outside the allowed roots ({', '.join(map(str, roots))}); "
                                 "move it under one, or start the daemon with --allowed-root")
    try:
        if want == "file" and not path.is_file():
            raise _invalid(["body", *what.split(".")], f"{what} {raw!r} does not exist or is not a file")
        if want == "dir" and not path.is_dir():
            raise _invalid(["body", *what.split(".")], f"{what} {raw!r} does not exist or is not a directory")
        if want == "new" and not path.parent.is_dir():
            raise _invalid(["body", *what.split(".")], f"{what} {raw!r}: its directory does not exist")
    except OSError as exc:
        raise _invalid(["body", *what.split(".")], f"{what} {raw!r} cannot be read ({exc.strerror or exc})") from None
    return path


# --------------------------------------------------------------------------------------
# Serving


def _bind(config: DaemonConfig) -> tuple[socket.socket, dict[str, Any]]:
    """Create the listening socket (so port 0 and the socket's mode are ours to control)."""
    if config.uds is not None:
        path = Path(config.uds).absolute()
        if path.exists() or path.is_symlink():
            if not path.is_socket():
                raise MpadviseError(f"--uds {path} exists and is not a socket; choose another path")
            path.unlink()  # a stale socket from a daemon that died (the lock says none runs)
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
    infos = socket.getaddrinfo(config.host, config.port, type=socket.SOCK_STREAM)
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


def _setup_logging() -> None:
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s mpadvise daemon: %(message)s", "%Y-%m-%d %H:%M:%S"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False


@contextlib.contextmanager
def _daemon_files(paths: DaemonPaths, address: dict[str, Any]) -> Iterator[None]:
    pid = os.getpid()
    _write_private(paths.pid, f"{pid}\n", 0o644)
    _write_private(paths.address, json.dumps(address, indent=2) + "\n", 0o644)
    try:
        yield
    finally:
        _remove_if_ours(paths.address, pid)
        _remove_if_ours(paths.pid, pid)


def serve(config: DaemonConfig, *, busy: Callable[[Slot], list[int]] | None = None) -> None:
    """Run the daemon in this process until SIGTERM or Ctrl-C.

    Args:
        config: where to listen and what may run.
        busy: PIDs computing on a slot's GPU; default NVML.

    Raises:
        MpadviseError: a refused or failed bind (exit code 2 for a refused address), another
            daemon on this cache directory, an unusable token file or cache.
    """
    from ._probe_report import probe_report

    remote_warning = None if config.uds is not None else check_bind(config.host, allow_remote=config.allow_remote)
    for root in config.roots():
        if not root.is_dir():
            raise MpadviseError(f"--allowed-root {root} is not a directory; give an existing directory", exit_code=2)
    _setup_logging()
    paths = DaemonPaths.here()
    paths.directory.mkdir(parents=True, exist_ok=True)
    lock = _acquire_lock(paths.lock)
    stores: list[Store] = []
    try:
        token = ensure_token(paths.token)
        store = Store()
        stores.append(store)
        read_store = Store()
        stores.append(read_store)
        for job in recover_jobs(store):
            logger.info("job %s was running when the last daemon stopped: now %s (attempt %s)",
                        job["id"], job["state"], job["attempts"])
        report = {**probe_report(), "detected_at": _now()}
        slots = slots_for([HardwareProfile.from_dict(d["profile"]) for d in report["devices"]])
        modes = frozenset(name for device in report["devices"] for name in device["modes"])
        runner = JobRunner(store=store, slots=slots, jobs_dir=paths.jobs, busy=busy or nvml_busy)
        sock, address = _bind(config)
        from advisor import __version__

        address.update(pid=os.getpid(), started_at=_now(), version=__version__, log=str(paths.log),
                       token_file=str(paths.token), slots=[s.name for s in slots],
                       roots=[str(r) for r in config.roots()])
        state = DaemonState(config=config, token=token, store=store, read_store=read_store, report=report,
                            slots=slots, runner=runner, mode_names=modes, answers=AnswerCache(read_store),
                            local_only=config.uds is None and remote_warning is None)
        app = create_app(state)
        server = _Server(uvicorn.Config(
            app, log_config=None, log_level="warning", access_log=False, lifespan="on",
            proxy_headers=False,  # request.client must be the real peer: reads are open by address
            server_header=False, timeout_keep_alive=5,
        ))
        with _daemon_files(paths, address):
            if remote_warning:
                logger.warning(remote_warning)
            logger.info("listening on %s; jobs run on %s; token in %s", address["url"],
                        ", ".join(s.name for s in slots), paths.token)
            try:
                server.run(sockets=[sock])
            finally:
                sock.close()
                if config.uds is not None:
                    with contextlib.suppress(OSError):
                        Path(address["uds"]).unlink()
            logger.info("stopped")
    finally:
        for opened in stores:
            opened.close()
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
