"""Jobs: the request and argv a tune job runs, the slots (one per GPU, or one CPU slot), and the runner
threads that start, follow, cancel and recover them."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import probes
from advisor._entry import module_argv
from advisor._secure import ensure_private_dir, open_private_new
from advisor.cache import Store
from advisor.daemon._config import (
    JOB_ENV,
    LOG_TAIL_CHARS,
    LOG_TAIL_LINES,
    MAX_JOB_LOGS,
    PRUNE_EVERY_S,
    RECENT_LINES,
    logger,
    under_roots,
)
from advisor.daemon._files import utc_now_seconds
from advisor.frameworks import check_plan_modes, plan_for
from advisor.tune import WAIT_IDLE_ENV, ScriptLaunch, TuneOptions, TuneRequest, resolve_storage
from probes import HardwareProfile, MpadviseError

JOB_TMP = "tmp"
"""The jobs directory's subdirectory that holds each running job's temporary directory."""

JOB_MODULE = "advisor.tune.job"
"""The entry point a job runs: ``python -m advisor.tune.job REQUEST.json RESULT.json``."""


def tune_argv(request: str | os.PathLike[str], result: str | os.PathLike[str], *, python: str = sys.executable) -> list[str]:
    """The command line that runs one job: the tune job entry point on its request file.

    Args:
        request: the job's request file (``TuneRequest.to_dict()`` as JSON).
        result: where the entry point writes the tune's result (``ScriptTune.to_dict()``).
        python: the interpreter.

    Returns:
        The argv list for ``subprocess.Popen`` (no shell is involved; the script's arguments
        travel in the request file, never on this command line).
    """
    return [*_module_entry(python, JOB_MODULE), os.fspath(request), os.fspath(result)]


def job_request(job: Mapping[str, Any], slot: str) -> tuple[TuneRequest, str]:
    """The tune a stored job asks for on ``slot``, and the directory it runs in.

    The script's plan (its framework, read from its imports unless the job names one, and
    what that framework can apply on the slot's device) is made here, as ``mpadvise tune``
    makes it. A job on its second attempt or later resumes its study (unless it asked for
    ``fresh``).

    Raises:
        MpadviseError: the stored options hold an unknown key or a value out of bounds; the
            script cannot be read; an unknown framework (exit 2), or a mode it cannot apply;
            ``MPADVISE_STORAGE`` and ``MPADVISE_STORAGE_FILE`` both set, or an unusable file.
    """
    options, cwd = job_options(job)
    options = options.with_(device=slot)  # the slot, whatever the job said
    # A study's URL (with its password) comes from the daemon's own environment, as
    # `mpadvise tune` takes it from the user's: it travels in the private request file, never
    # in a job's arguments, which every user of the machine can read in `ps`.
    options = options.with_(storage=resolve_storage(None, os.environ))
    if job.get("attempts") and not options.fresh:
        # A job run again (its daemon stopped mid-tune) continues its own study: the finished
        # trials there are this job's, and a tune without --resume refuses to delete them.
        options = options.with_(resume=True)
    script = Path(job["script"])
    plan = plan_for(script, options.framework, device=slot)
    check_plan_modes(plan, list(options.modes))
    return TuneRequest(script, tuple(job.get("args") or ()), options, ScriptLaunch.of(plan)), cwd


def _module_entry(python: str, module: str) -> list[str]:
    """The argv that runs ``module`` without the working directory on ``sys.path``
    (``advisor._entry.module_argv``); the runner's interpreter is the daemon's own."""
    return [python, *module_argv(module)]


def job_options(job: Mapping[str, Any]) -> tuple[TuneOptions, str]:
    """A stored job's tune options and the directory it runs in (its own, else the script's).

    Raises:
        MpadviseError: the stored options hold an unknown key or a value out of bounds.
    """
    stored = dict(job.get("options") or {})
    cwd = stored.pop("cwd", None) or os.path.dirname(job["script"])  # kept beside the options
    return TuneOptions.from_dict(stored), cwd


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
    return probes.gpu_busy(slot.index, uuid=slot.uuid)


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
        python: the interpreter that runs the job entry point (``advisor.tune.job``).
        poll_s: how often a running job is checked for cancellation and progress.
        gpu_poll_s: how often a waiting job asks NVML again.
        idle_poll_s: how often an idle worker looks at the queue without being woken.
        retention_s: finished jobs older than this are deleted with their files
            (:func:`prune_jobs`), at start and every ``prune_every_s``; ``None`` keeps them.
        prune_every_s: seconds between prunings.
        roots: the allowed roots (resolved); each job's paths are checked against them again
            when it is claimed, since whoever can write the queue could have put it there.
            ``None`` (runners built by hand in tests) skips that check; the daemon always
            passes its roots.
    """

    store: Store
    slots: Sequence[Slot]
    jobs_dir: Path
    busy: Callable[[Slot], list[int]] = nvml_busy
    python: str = sys.executable
    poll_s: float = 0.25
    gpu_poll_s: float = 2.0
    idle_poll_s: float = 2.0
    roots: Sequence[Path] | None = None
    retention_s: float | None = None
    prune_every_s: float = PRUNE_EVERY_S
    _stop: threading.Event = field(default_factory=threading.Event)
    _wake: dict[str, threading.Event] = field(default_factory=dict)
    _cancel: set[str] = field(default_factory=set)
    _cancel_lock: threading.Lock = field(default_factory=threading.Lock)
    _threads: list[threading.Thread] = field(default_factory=list)
    _state: dict[str, _SlotState] = field(default_factory=dict)

    def start(self) -> None:
        """Start one worker thread per slot."""
        # Job logs can quote a script's arguments and output: this user's eyes only, and a
        # jobs/ that someone else owns or may write is refused.
        ensure_private_dir(self.jobs_dir)
        # No job runs yet: every temporary directory left is an orphan of a daemon that died.
        remove_job_tmp_dirs(self.jobs_dir)
        for slot in self.slots:
            self._wake[slot.name] = threading.Event()
            self._state[slot.name] = _SlotState()
            thread = threading.Thread(target=self._work, args=(slot,), name=f"mpadvise-job-{slot.name}", daemon=True)
            thread.start()
            self._threads.append(thread)
        if self.retention_s is not None:
            thread = threading.Thread(target=self._prune, args=(self.retention_s,), name="mpadvise-job-prune",
                                      daemon=True)
            thread.start()
            self._threads.append(thread)

    def _prune(self, retention_s: float) -> None:
        """Delete old finished jobs now, then every ``prune_every_s`` until stopped."""
        while True:
            try:
                pruned = prune_jobs(self.store, self.jobs_dir, retention_s=retention_s)
                if pruned:
                    logger.info("deleted %d finished jobs older than %g days, with their logs", len(pruned),
                                retention_s / 86400)
            except Exception:  # housekeeping must never stop the daemon
                logger.exception("cannot prune old jobs")
            if self._stop.wait(self.prune_every_s):
                return

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
            except Exception:  # a worker must outlive anything the queue holds
                logger.exception("cannot read the job queue")
                self._stop.wait(self.idle_poll_s)
                continue
            if job is None:
                wake = self._wake[slot.name]
                wake.wait(self.idle_poll_s)
                wake.clear()
                continue
            state.job, state.phase = job["id"], "starting"
            try:
                prune_job_logs(self.jobs_dir)
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
                "phase": "waiting", "slot": slot.name, "waiting_for_pids": pids, "updated_at": utc_now_seconds(),
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
        refusal = None if self.roots is None else outside_roots(job, self.roots)
        if refusal is not None:
            logger.warning("job %s refused: %s", job_id, refusal)
            self.store.finish_job(job_id, state="failed", result={"exit_code": None, "error": f"refused: {refusal}"})
            return
        if not self._wait_for_idle_gpu(job, slot, state):
            return
        try:
            request, cwd = job_request(job, slot.name)
        except MpadviseError as exc:  # what `mpadvise tune` would refuse before any trial
            logger.info("job %s failed: %s", job_id, exc)
            self.store.finish_job(job_id, state="failed", result={"exit_code": exc.exit_code, "error": str(exc)})
            return
        files = _JobFiles(self.jobs_dir, job_id)
        files.write_request(request)
        tail = LogTail()
        state.phase = "running"
        # The arguments can hold secrets (keys, tokens): the log names the job, not its command.
        logger.info("job %s started on %s: %s", job_id, slot.name, job["script"])
        try:
            tmp = files.make_tmp()
            with _open_job_log(files.log) as log:
                process = subprocess.Popen(
                    tune_argv(files.request, files.result, python=self.python), stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=cwd, env=_job_env(job_id, tmp),
                    start_new_session=True,  # its own group: a cancel kills it without touching us
                )
                pump = threading.Thread(target=_pump, args=(process.stdout, tail, log), daemon=True)
                pump.start()
                outcome, progress = self._follow(job_id, slot, process, tail)
                pump.join(timeout=5)
            self._finish(job_id, process.returncode, outcome, progress, tail, files)
        finally:
            # However the job ended (done, failed, cancelled, the daemon stopping), what its
            # trials left under TMPDIR goes; its processes are gone by now (_follow waited).
            files.remove_tmp()

    def _finish(self, job_id: str, code: int | None, outcome: str, progress: dict[str, Any], tail: LogTail,
                files: _JobFiles) -> None:
        """Record how a job's process ended: its result file's tune, or why there is none."""
        try:
            if outcome == "stopped":
                logger.info("job %s interrupted by the daemon stopping; it runs again at the next start", job_id)
                return
            if outcome == "cancelled":
                self.store.finish_job(job_id, state="cancelled", log_tail=tail.text())
                logger.info("job %s cancelled", job_id)
                return
            result = _result_of(code, files.result, tail)
            final = "succeeded" if result.get("tune") is not None else "failed"
            # The last lines first, so a follower that sees the job finished has seen them all.
            self.store.update_job(job_id, progress={**progress, "phase": "finished", "exit_code": code,
                                                    "lines": tail.count, "recent": tail.lines()[-RECENT_LINES:],
                                                    "updated_at": utc_now_seconds()})
            self.store.finish_job(job_id, state=final, result=result, log_tail=tail.text())
            logger.info("job %s %s (exit code %s)", job_id, final, code)
        finally:
            files.remove()

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
        record: dict[str, Any] | None = self.store.update_job(job_id, progress={**progress, "updated_at": utc_now_seconds()})
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
                    **progress, "lines": tail.count, "recent": recent, "updated_at": utc_now_seconds(),
                })


def prune_job_logs(jobs_dir: Path, *, keep: int = MAX_JOB_LOGS) -> None:
    """Delete all but the newest ``keep`` job logs, so that they cannot fill the disk."""
    try:
        logs = sorted((entry for entry in os.scandir(jobs_dir) if entry.name.endswith(".log") and entry.is_file()),
                      key=lambda entry: entry.stat().st_mtime, reverse=True)
    except OSError:
        return
    for entry in logs[keep:]:
        with contextlib.suppress(OSError):
            os.unlink(entry.path)


def prune_jobs(store: Store, jobs_dir: Path, *, retention_s: float,
               now: datetime.datetime | None = None) -> list[str]:
    """Delete the jobs that finished more than ``retention_s`` ago, with their files.

    Queued, running and cancelling jobs are never touched. A job log in ``jobs_dir`` that is
    older than the retention and whose job is gone (``mpadvise cache clear``, an older
    daemon) goes too.

    Args:
        store: the cache store.
        jobs_dir: the jobs directory.
        retention_s: how long a finished job is kept.
        now: the current time (UTC); default the clock.

    Returns:
        The ids of the jobs deleted.
    """
    now = now or datetime.datetime.now(datetime.timezone.utc)
    cutoff = now - datetime.timedelta(seconds=retention_s)
    ids = store.prune_finished_jobs(finished_before=cutoff.isoformat(timespec="microseconds"))
    for job_id in ids:
        _JobFiles(jobs_dir, job_id).remove_all()
    try:
        entries = [entry for entry in os.scandir(jobs_dir) if entry.name.endswith(".log") and entry.is_file()]
    except OSError:
        entries = []
    for entry in entries:
        job_id = entry.name[: -len(".log")]
        with contextlib.suppress(OSError, MpadviseError):
            if entry.stat().st_mtime < cutoff.timestamp() and store.get_job(job_id) is None:
                _JobFiles(jobs_dir, job_id).remove_all()
    return ids


def outside_roots(job: Mapping[str, Any], roots: Sequence[Path]) -> str | None:
    """Why a queued job may not run under ``roots``, or ``None`` when it may.

    The same rule as at submission: the script (a file), the working directory and the
    ``--out`` file's directory must lie under an allowed root once symlinks are resolved.

    Args:
        job: the job as the queue stores it.
        roots: the allowed roots, resolved.

    Returns:
        ``None``, or one line naming the path and the rule.
    """
    options = job.get("options") or {}
    checks = [("script", job.get("script"), "file"), ("cwd", options.get("cwd"), "dir"),
              ("options.out", options.get("out"), "new")]
    shown = ", ".join(map(str, roots))
    for what, raw, want in checks:
        if raw is None and what != "script":
            continue
        if not isinstance(raw, str) or not os.path.isabs(raw) or "\0" in raw:
            return f"{what} {raw!r} is not an absolute path"
        path = Path(os.path.realpath(raw))
        if not under_roots(path, roots):
            return f"{what} {raw!r} is outside the allowed roots ({shown})"
        if (want == "file" and not path.is_file()) or (want == "dir" and not path.is_dir()) or (
                want == "new" and not path.parent.is_dir()):
            return f"{what} {raw!r} does not exist or is not a {'directory' if want == 'dir' else 'file'}"
    return None


def _open_job_log(path: Path) -> Any:
    """Open a job's log (appended to across attempts), never through a symlink: created new or,
    when an earlier attempt left one, reopened only if it is a plain file of ours with one link.
    """
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


def _pump(stream: Any, tail: LogTail, log: Any) -> None:
    for raw in iter(stream.readline, b""):
        log.write(raw)
        log.flush()
        tail.add(raw.decode("utf-8", errors="replace"))
    stream.close()


def _result_of(code: int | None, result_path: Path, tail: LogTail) -> dict[str, Any]:
    """The job result: the tune's result file when it answered (exit 0 or 3), else why it failed."""
    data = None
    with contextlib.suppress(OSError, ValueError):
        text = result_path.read_text(encoding="utf-8", errors="replace")
        data = json.loads(text) if text.strip() else None
    if code in (0, 3) and isinstance(data, dict):
        return {"exit_code": code, "tune": data}
    error = tail.error_line() or f"the tune exited with code {code} and wrote no result"
    return {"exit_code": code, "error": error}


def remove_job_tmp_dirs(jobs_dir: Path, keep: Sequence[str] = ()) -> None:
    """Remove the jobs' temporary directories (``jobs/tmp/ID``), but those of ``keep``.

    Args:
        jobs_dir: the jobs directory.
        keep: ids of jobs still running.
    """
    root = jobs_dir / JOB_TMP
    try:
        entries = list(os.scandir(root))
    except OSError:
        return
    for entry in entries:
        if entry.name not in keep:
            _remove_tree(Path(entry.path))


def _remove_tree(path: Path) -> None:
    """Remove ``path`` and what is in it, never following a symlink (a link is removed itself)."""
    if path.is_symlink() or not path.is_dir():
        with contextlib.suppress(OSError):
            path.unlink()
        return
    # rmtree does not follow the links inside either (it works through descriptors on Linux).
    shutil.rmtree(path, ignore_errors=True)


def _job_env(job_id: str, tmp: Path | None = None) -> dict[str, str]:
    """The environment of a job's process: the daemon's, marked with the job (so that every
    process of it can be found), waiting for an idle GPU before each trial, with its own
    private temporary directory as ``TMPDIR``.

    The daemon's environment is inherited on purpose: a secret set there (a study's
    ``MPADVISE_STORAGE`` URL, an API key) reaches the job without appearing in its arguments,
    which every user of the machine can read in ``ps``.
    """
    env = dict(os.environ)
    env[JOB_ENV] = job_id
    if tmp is not None:
        env["TMPDIR"] = env["TMP"] = env["TEMP"] = str(tmp)
    env[WAIT_IDLE_ENV] = "1"  # and before every trial, not only before the tune starts
    env.pop("MPADVISE_POLICY", None)
    return env


@dataclass(frozen=True)
class _JobFiles:
    """A job's files in the jobs directory: its log (kept), its request and result (removed
    once the job has ended)."""

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
        """Write the request file (new and private; a stale one, or a stale result, removed first)."""
        self.remove()
        with os.fdopen(open_private_new(self.request), "w", encoding="utf-8") as out:
            json.dump(request.to_dict(), out)

    @property
    def tmp(self) -> Path:
        """The job's temporary directory (its ``TMPDIR``), removed when the job ends."""
        return self.directory / JOB_TMP / self.job_id

    def make_tmp(self) -> Path:
        """Create the temporary directory afresh, mode 0700 (one left by an earlier attempt removed)."""
        ensure_private_dir(self.tmp.parent)
        _remove_tree(self.tmp)
        os.mkdir(self.tmp, 0o700)
        return self.tmp

    def remove_tmp(self) -> None:
        _remove_tree(self.tmp)

    def remove_all(self) -> None:
        """Remove every file of the job: log, request, result and temporary directory."""
        self.remove()
        self.remove_tmp()
        with contextlib.suppress(OSError):
            self.log.unlink()

    def remove(self) -> None:
        for path in (self.request, self.result):
            with contextlib.suppress(OSError):
                path.unlink()  # unlink never follows a symlink: it removes the link itself


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
