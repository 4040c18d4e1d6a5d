"""Tune jobs: the slots they run on (one per GPU, or the CPU), the runner threads that claim,
cancel and recover them, one job's request, files and processes, and pruning old jobs."""

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
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import probes
from advisor._entry import module_argv
from advisor._secure import ensure_private_dir, open_private_new
from advisor.cache import Store
from advisor.daemon._config import PRUNE_EVERY_S, logger, under_roots, utc_now_seconds
from advisor.frameworks import check_plan_modes, plan_for
from advisor.tune import WAIT_IDLE_ENV, ScriptLaunch, TuneOptions, TuneRequest, resolve_storage
from probes import HardwareProfile, MpadviseError

JOB_TMP = "tmp"  # the jobs directory's subdirectory of the running jobs' temporary directories
# The environment variable that marks every process of a job (the tune and its trials, which
# run in sessions of their own): how leftovers are found after a crash or a cancel.
JOB_ENV = "MPADVISE_DAEMON_JOB"
# What the job record keeps of a tune's stderr: enough to see why it failed.
LOG_TAIL_LINES = 40
LOG_TAIL_CHARS = 8000
RECENT_LINES = 20
MAX_JOB_LOGS = 200  # full job logs kept in the jobs directory (the newest); older ones are deleted

PathKind = Literal["file", "dir", "new"]  # an existing file, an existing directory, a new file


def tune_argv(request: str | os.PathLike[str], result: str | os.PathLike[str], *,
              python: str = sys.executable) -> list[str]:
    """``python -m advisor.tune.job REQUEST.json RESULT.json``, without the working directory on
    ``sys.path``; the script's arguments travel in the request file, never on this line."""
    return [python, *module_argv("advisor.tune.job"), os.fspath(request), os.fspath(result)]


def job_request(job: Mapping[str, Any], slot: str) -> tuple[TuneRequest, str]:
    """The tune a stored job asks for on ``slot`` (planned as ``mpadvise tune`` plans it), and the
    directory it runs in; MpadviseError for what ``mpadvise tune`` would refuse."""
    stored = dict(job.get("options") or {})
    cwd = stored.pop("cwd", None) or os.path.dirname(job["script"])  # kept beside the options
    # The slot, whatever the job said. A study's URL (with its password) comes from the daemon's
    # environment, as `mpadvise tune` takes it from the user's: it travels in the private
    # request file, never in a job's arguments, which every user can read in `ps`.
    options = TuneOptions.from_dict(stored).with_(device=slot, storage=resolve_storage(None, os.environ))
    if job.get("attempts") and not options.fresh:
        # A job run again (its daemon stopped mid-tune) continues its own study: the finished
        # trials there are this job's, and a tune without --resume refuses to delete them.
        options = options.with_(resume=True)
    script = Path(job["script"])
    plan = plan_for(script, options.framework, device=slot)
    check_plan_modes(plan, list(options.modes))
    return TuneRequest(script, tuple(job.get("args") or ()), options, ScriptLaunch.of(plan)), cwd


def path_refusal(what: str, raw: Any, roots: Sequence[Path], want: PathKind) -> tuple[int, str] | None:
    """Why a job's path may not be used under ``roots``: an HTTP status and one line; or ``None``.
    The one rule, at submission and again when a job is claimed: an absolute path whose real
    path lies under an allowed root (else 403), and is what ``want`` says (else 422)."""
    if not isinstance(raw, str) or not os.path.isabs(raw):
        return 422, f"{what} {raw!r} is not absolute; send the full path (the daemon's working directory is not yours)"
    try:
        path = Path(os.path.realpath(raw))
    except (OSError, ValueError) as exc:
        return 422, f"{what} {raw!r} cannot be resolved ({exc})"
    if not under_roots(path, roots):
        return 403, (f"{what} {raw!r} is outside the allowed roots ({', '.join(map(str, roots))}); "
                     "move it under one, or start the daemon with --allowed-root")
    try:
        if want == "file" and not path.is_file():
            return 422, f"{what} {raw!r} does not exist or is not a file"
        if want == "dir" and not path.is_dir():
            return 422, f"{what} {raw!r} does not exist or is not a directory"
        if want == "new" and not path.parent.is_dir():
            return 422, f"{what} {raw!r}: its directory does not exist"
    except OSError as exc:
        return 422, f"{what} {raw!r} cannot be read ({exc.strerror or exc})"
    return None


def outside_roots(job: Mapping[str, Any], roots: Sequence[Path]) -> str | None:
    """Why a queued job's script, ``cwd`` or ``--out`` may not be used under ``roots``; or None."""
    options = job.get("options") or {}
    checks: list[tuple[str, Any, PathKind]] = [("script", job.get("script"), "file"),
                                               ("cwd", options.get("cwd"), "dir"),
                                               ("options.out", options.get("out"), "new")]
    for what, raw, want in checks:
        problem = None if raw is None and what != "script" else path_refusal(what, raw, roots, want)
        if problem is not None:
            return problem[1]
    return None


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
        errors = [line[len("error:"):].strip() for line in lines if line.startswith("error:")]
        return errors[-1] if errors else (lines[-1] if lines else None)


class JobFiles:
    """A job's log (kept), request, result and private temporary directory (removed at its end)."""

    def __init__(self, directory: Path, job_id: str) -> None:
        self.log = directory / f"{job_id}.log"
        self.request = directory / f"{job_id}.request.json"
        self.result = directory / f"{job_id}.result.json"
        self.tmp = directory / JOB_TMP / job_id

    def remove(self, *, log: bool = False) -> None:
        for path in (self.request, self.result, self.tmp, *((self.log,) if log else ())):
            remove_tree(path)


@dataclass(frozen=True)
class Slot:
    """Where one job at a time runs: a GPU (``cuda:N``, with the UUID that NVML matches whatever
    ``CUDA_VISIBLE_DEVICES`` says) or, without one, the CPU."""

    name: str
    index: int | None = None
    uuid: str | None = None


def slots_for(profiles: Sequence[HardwareProfile]) -> list[Slot]:
    return [Slot(f"cuda:{p.index}", p.index, p.uuid) for p in profiles
            if p.is_cuda and p.index is not None] or [Slot("cpu")]


def nvml_busy(slot: Slot) -> list[int]:
    return [] if slot.index is None else probes.gpu_busy(slot.index, uuid=slot.uuid)


@dataclass
class SlotState:
    job: str | None = None
    phase: str = "idle"


@dataclass
class JobRunner:
    """One worker thread per slot: claim the oldest job, wait for an idle GPU, run the tune. A
    claimed job's paths are checked against ``roots`` again (``None``: tests only): whoever can
    write the queue could have put it there."""

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
    stopping: threading.Event = field(default_factory=threading.Event)
    _wake: dict[str, threading.Event] = field(default_factory=dict)
    _cancel: set[str] = field(default_factory=set)  # asked over HTTP, before the store says so
    _threads: list[threading.Thread] = field(default_factory=list)
    _state: dict[str, SlotState] = field(default_factory=dict)

    def start(self) -> None:
        # Job logs can quote a script's arguments and output: this user's eyes only, and a
        # jobs/ that someone else owns or may write is refused.
        ensure_private_dir(self.jobs_dir)
        # No job runs yet: every temporary directory left is an orphan of a daemon that died.
        remove_tree(self.jobs_dir / JOB_TMP)
        for slot in self.slots:
            self._wake[slot.name] = threading.Event()
            self._state[slot.name] = SlotState()
            self._threads.append(threading.Thread(target=self._work, args=(slot,), daemon=True))
        if self.retention_s is not None:
            self._threads.append(threading.Thread(target=self._prune, args=(self.retention_s,), daemon=True))
        for thread in self._threads:
            thread.start()

    def _prune(self, retention_s: float) -> None:
        while True:
            try:
                pruned = prune_jobs(self.store, self.jobs_dir, retention_s=retention_s)
                if pruned:
                    logger.info("deleted %d finished jobs older than %g days, with their logs", len(pruned),
                                retention_s / 86400)
            except Exception:  # housekeeping must never stop the daemon
                logger.exception("cannot prune old jobs")
            if self.stopping.wait(PRUNE_EVERY_S):
                return

    def wake(self) -> None:
        for event in self._wake.values():
            event.set()

    def cancel(self, job_id: str) -> None:
        self._cancel.add(job_id)

    def asked_to_cancel(self, job_id: str, record: dict[str, Any] | None) -> bool:
        return job_id in self._cancel or record is None or record.get("state") == "cancelling"

    def slot_info(self) -> list[dict[str, Any]]:
        return [{"name": s.name, "uuid": s.uuid, **asdict(self._state.get(s.name) or SlotState())}
                for s in self.slots]

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the workers, killing running jobs (the next daemon queues them again, once)."""
        self.stopping.set()
        self.wake()
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def _work(self, slot: Slot) -> None:
        state = self._state[slot.name]
        while not self.stopping.is_set():
            try:
                job = self.store.claim_next_job(slot.name)
            except Exception as exc:  # a worker must outlive anything the queue holds
                if isinstance(exc, MpadviseError):
                    logger.warning("cannot read the job queue: %s", exc)
                else:
                    logger.exception("cannot read the job queue")
                self.stopping.wait(self.idle_poll_s)
                continue
            if job is None:
                self._wake[slot.name].wait(self.idle_poll_s)
                self._wake[slot.name].clear()
                continue
            state.job, state.phase = job["id"], "starting"
            try:
                prune_job_logs(self.jobs_dir)
                JobRun(self, job, slot, state).run()
            except Exception as exc:  # a worker must outlive any one job
                logger.exception("job %s failed inside the daemon", job["id"])
                with contextlib.suppress(MpadviseError):
                    self.store.finish_job(job["id"], state="failed",
                                          result={"exit_code": None, "error": f"daemon error: {exc}"})
            finally:
                state.job, state.phase = None, "idle"
                self._cancel.discard(job["id"])


class JobRun:
    """One job on one slot: check its paths again, wait for an idle GPU, run the tune, record it."""

    def __init__(self, runner: JobRunner, job: dict[str, Any], slot: Slot, state: SlotState) -> None:
        self.runner, self.store = runner, runner.store
        self.job, self.job_id, self.slot, self.state = job, job["id"], slot, state

    def run(self) -> None:
        job_id, runner = self.job_id, self.runner
        refusal = None if runner.roots is None else outside_roots(self.job, runner.roots)
        if refusal is not None:
            logger.warning("job %s refused: %s", job_id, refusal)
            self.store.finish_job(job_id, state="failed", result={"exit_code": None, "error": f"refused: {refusal}"})
            return
        if not self._wait_for_idle_gpu():
            return
        try:
            request, cwd = job_request(self.job, self.slot.name)
        except MpadviseError as exc:  # what `mpadvise tune` would refuse before any trial
            logger.info("job %s failed: %s", job_id, exc)
            self.store.finish_job(job_id, state="failed", result={"exit_code": exc.exit_code, "error": str(exc)})
            return
        files = JobFiles(runner.jobs_dir, job_id)
        files.remove()  # what an earlier attempt left
        with os.fdopen(open_private_new(files.request), "w", encoding="utf-8") as out:
            json.dump(request.to_dict(), out)
        tail = LogTail()
        # The daemon's environment on purpose: a secret set there (MPADVISE_STORAGE, an API key)
        # reaches the job without appearing in its arguments, which every user can read in `ps`.
        # The mark finds every process of the job; each trial waits for an idle GPU.
        env = {name: value for name, value in os.environ.items() if name != "MPADVISE_POLICY"}
        env.update(dict.fromkeys(("TMPDIR", "TMP", "TEMP"), str(files.tmp)))
        env.update({JOB_ENV: job_id, WAIT_IDLE_ENV: "1"})
        self.state.phase = "running"
        # The arguments can hold secrets (keys, tokens): the log names the job, not its command.
        logger.info("job %s started on %s: %s", job_id, self.slot.name, self.job["script"])
        try:
            ensure_private_dir(files.tmp.parent)
            os.mkdir(files.tmp, 0o700)
            with open_job_log(files.log) as log:
                process = subprocess.Popen(
                    tune_argv(files.request, files.result, python=runner.python), stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=cwd, env=env,
                    start_new_session=True,  # its own group: a cancel kills it without touching us
                )
                pump = threading.Thread(target=_pump_output, args=(process.stdout, tail, log), daemon=True)
                pump.start()
                outcome, progress = self._follow(process, tail)
                pump.join(timeout=5)
            self._finish(process.returncode, outcome, progress, tail, files)
        finally:
            # However the job ended, its request, result and what its trials left under TMPDIR
            # go; its processes are gone by now (_follow waited).
            files.remove()

    def _wait_for_idle_gpu(self) -> bool:
        """Block until no other process computes on the slot's GPU. False: cancel or stop."""
        name = self.slot.name
        while pids := self.runner.busy(self.slot):
            self.state.phase = "waiting"
            record = self.store.update_job(self.job_id, progress={
                "phase": "waiting", "slot": name, "waiting_for_pids": pids, "updated_at": utc_now_seconds(),
                "message": f"waiting for {name} to be idle: PIDs {', '.join(map(str, pids))} compute on it",
            })
            if self.runner.asked_to_cancel(self.job_id, record):
                self.store.finish_job(self.job_id, state="cancelled")
                logger.info("job %s cancelled while waiting for %s", self.job_id, name)
                return False
            if self.runner.stopping.wait(self.runner.gpu_poll_s):
                return False
        return True

    def _finish(self, code: int | None, outcome: str, progress: dict[str, Any], tail: LogTail,
                files: JobFiles) -> None:
        job_id = self.job_id
        if outcome == "stopped":
            logger.info("job %s interrupted by the daemon stopping; it runs again at the next start", job_id)
            return
        if outcome == "cancelled":
            self.store.finish_job(job_id, state="cancelled", log_tail=tail.text())
            logger.info("job %s cancelled", job_id)
            return
        result: dict[str, Any] = {"exit_code": code, "error": tail.error_line()
                                  or f"the tune exited with code {code} and wrote no result"}
        with contextlib.suppress(OSError, ValueError):  # the tune's answer, if it gave one (0 or 3)
            data = json.loads(files.result.read_text(encoding="utf-8", errors="replace"))
            if code in (0, 3) and isinstance(data, dict):
                result = {"exit_code": code, "tune": data}
        final = "succeeded" if result.get("tune") is not None else "failed"
        # The last lines first, so a follower that sees the job finished has seen them all.
        self.store.update_job(job_id, progress={**progress, "phase": "finished", "exit_code": code,
                                                "lines": tail.count, "recent": tail.lines()[-RECENT_LINES:],
                                                "updated_at": utc_now_seconds()})
        self.store.finish_job(job_id, state=final, result=result, log_tail=tail.text())
        logger.info("job %s %s (exit code %s)", job_id, final, code)

    def _follow(self, process: subprocess.Popen[bytes], tail: LogTail) -> tuple[str, dict[str, Any]]:
        job_id, runner, slot = self.job_id, self.runner, self.slot
        progress: dict[str, Any] = {"phase": "running", "slot": slot.name, "pid": process.pid}
        foreign: set[int] = set()
        last_update, last_count, last_gpu_check = 0.0, -1, time.monotonic()
        record = self.store.update_job(job_id, progress={**progress, "updated_at": utc_now_seconds()})
        while True:
            try:
                process.wait(timeout=runner.poll_s)
                return "exited", progress
            except subprocess.TimeoutExpired:
                pass
            stopping = runner.stopping.is_set()
            if stopping or runner.asked_to_cancel(job_id, record):
                kill_job(job_id, process)
                process.wait()
                return ("stopped" if stopping else "cancelled"), progress
            now = time.monotonic()
            if slot.index is not None and now - last_gpu_check >= runner.gpu_poll_s:
                # The tune's own trials compute on this GPU too; anything else is someone
                # else's work that started after ours, and it skews what we measure.
                last_gpu_check = now
                others = set(runner.busy(slot)) - set(job_pids(job_id))
                if others - foreign:
                    foreign |= others
                    logger.warning("job %s: PIDs %s started computing on %s during the tune", job_id,
                                   sorted(others), slot.name)
                    progress["foreign_gpu_pids"] = sorted(foreign)
                    last_count = -1  # news to write at once
            # At most one write a second while lines come in, one every 5 s when quiet.
            if (tail.count != last_count and now - last_update >= 1.0) or now - last_update >= 5.0:
                last_count, last_update = tail.count, now
                record = self.store.update_job(job_id, log_tail=tail.text(), progress={
                    **progress, "lines": tail.count, "recent": tail.lines()[-RECENT_LINES:],
                    "updated_at": utc_now_seconds(),
                })


def open_job_log(path: Path) -> Any:
    """Open a job's log for appending, never through a symlink: new, or an earlier attempt's
    only if it is a plain private file of ours with one link."""
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


def _pump_output(stream: Any, tail: LogTail, log: Any) -> None:
    for raw in iter(stream.readline, b""):
        log.write(raw)
        log.flush()
        tail.add(raw.decode("utf-8", errors="replace"))
    stream.close()


def remove_tree(path: Path) -> None:
    """Remove ``path`` and what is in it, never following a symlink (rmtree follows none inside)."""
    if path.is_symlink() or not path.is_dir():
        with contextlib.suppress(OSError):
            path.unlink()
    else:
        shutil.rmtree(path, ignore_errors=True)


def _job_logs(jobs_dir: Path) -> list[os.DirEntry[str]]:
    try:
        return [entry for entry in os.scandir(jobs_dir) if entry.name.endswith(".log") and entry.is_file()]
    except OSError:
        return []


def prune_job_logs(jobs_dir: Path, *, keep: int = MAX_JOB_LOGS) -> None:
    with contextlib.suppress(OSError):
        logs = sorted(_job_logs(jobs_dir), key=lambda entry: entry.stat().st_mtime, reverse=True)
        for entry in logs[keep:]:
            with contextlib.suppress(OSError):
                os.unlink(entry.path)


def prune_jobs(store: Store, jobs_dir: Path, *, retention_s: float) -> list[str]:
    """Delete the jobs that finished more than ``retention_s`` ago, with their files; returns
    their ids. A job log older than that whose job is gone (``mpadvise cache clear``) goes too."""
    cutoff = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(seconds=retention_s)
    ids = store.prune_finished_jobs(finished_before=cutoff.isoformat(timespec="microseconds"))
    for job_id in ids:
        JobFiles(jobs_dir, job_id).remove(log=True)
    for entry in _job_logs(jobs_dir):
        job_id = entry.name[: -len(".log")]
        with contextlib.suppress(OSError, MpadviseError):
            if entry.stat().st_mtime < cutoff.timestamp() and store.get_job(job_id) is None:
                JobFiles(jobs_dir, job_id).remove(log=True)
    return ids


def job_pids(job_id: str) -> list[int]:
    """This user's live processes whose environment has the job's :data:`JOB_ENV` mark (/proc)."""
    marker = f"{JOB_ENV}={job_id}".encode()
    found = []
    with contextlib.suppress(OSError):
        for entry in os.scandir("/proc"):
            if entry.name.isdigit():
                with contextlib.suppress(OSError), open(os.path.join(entry.path, "environ"), "rb") as handle:
                    if marker in handle.read().split(b"\0"):
                        found.append(int(entry.name))
    return found


def kill_job(job_id: str, process: subprocess.Popen[bytes] | None = None) -> None:
    """SIGKILL every process of a job: the tune's process group, and its trials, which run in
    sessions of their own (so a trial timeout can kill a script's children), by their mark."""
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


def recover_jobs(store: Store) -> list[dict[str, Any]]:
    """At start: kill what is left of jobs the last daemon was running (after kill -9 its tunes
    run on, and would store an answer while the same job runs again); queue them again."""
    for job in store.list_jobs(states=("running", "cancelling")):
        kill_job(job["id"])
    return store.requeue_interrupted()
