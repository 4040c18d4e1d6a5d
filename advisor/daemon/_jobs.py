"""The job slots (one per GPU, or one CPU slot), and the runner threads that start, follow,
cancel and recover tune jobs."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import probes
from advisor._secure import ensure_private_dir
from advisor.cache import Store
from advisor.daemon._config import PRUNE_EVERY_S, RECENT_LINES, logger, utc_now_seconds
from advisor.daemon._job_files import (
    JOB_TMP,
    JobFiles,
    LogTail,
    job_env,
    job_pids,
    job_request,
    kill_job,
    open_job_log,
    outside_roots,
    prune_job_logs,
    prune_jobs,
    pump_output,
    remove_tree,
    result_of,
    tune_argv,
)
from probes import HardwareProfile, MpadviseError


@dataclass(frozen=True)
class Slot:
    """Where one job at a time runs: a GPU (``cuda:N``, with the UUID that NVML matches whatever
    ``CUDA_VISIBLE_DEVICES`` says) or, without one, the CPU."""

    name: str
    index: int | None = None
    uuid: str | None = None


def slots_for(profiles: Sequence[HardwareProfile]) -> list[Slot]:
    gpus = [Slot(f"cuda:{p.index}", p.index, p.uuid) for p in profiles if p.is_cuda and p.index is not None]
    return gpus or [Slot("cpu")]


def nvml_busy(slot: Slot) -> list[int]:
    if slot.index is None:
        return []
    return probes.gpu_busy(slot.index, uuid=slot.uuid)


@dataclass
class _SlotState:
    job: str | None = None
    phase: str = "idle"


@dataclass
class JobRunner:
    """One worker thread per slot: claim the oldest job, wait for an idle GPU, run the tune.

    ``busy`` gives the PIDs computing on a slot's GPU (NVML). Finished jobs older than
    ``retention_s`` are deleted at start and every ``prune_every_s`` (``None`` keeps them). Each
    job's paths are checked against ``roots`` again when it is claimed, since whoever can write
    the queue could have put it there (``None``, in tests only, skips that check).
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
        # Job logs can quote a script's arguments and output: this user's eyes only, and a
        # jobs/ that someone else owns or may write is refused.
        ensure_private_dir(self.jobs_dir)
        # No job runs yet: every temporary directory left is an orphan of a daemon that died.
        remove_tree(self.jobs_dir / JOB_TMP)
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
        for event in self._wake.values():
            event.set()

    def cancel(self, job_id: str) -> None:
        with self._cancel_lock:
            self._cancel.add(job_id)

    def slot_info(self) -> list[dict[str, Any]]:
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
                _JobRun(self).run(job, slot, state)
            except Exception as exc:  # a worker must outlive any one job
                logger.exception("job %s failed inside the daemon", job["id"])
                with contextlib.suppress(MpadviseError):
                    self.store.finish_job(job["id"], state="failed",
                                          result={"exit_code": None, "error": f"daemon error: {exc}"})
            finally:
                state.job, state.phase = None, "idle"
                with self._cancel_lock:
                    self._cancel.discard(job["id"])

    def asked_to_cancel(self, job_id: str, record: dict[str, Any] | None) -> bool:
        with self._cancel_lock:
            if job_id in self._cancel:
                return True
        return record is None or record.get("state") == "cancelling"


class _JobRun:
    """One job on one slot, for its runner: wait for an idle GPU, run the tune, follow it, record its end."""

    def __init__(self, runner: JobRunner) -> None:
        self.runner = runner

    def wait_for_idle_gpu(self, job: dict[str, Any], slot: Slot, state: _SlotState) -> bool:
        """Block until no other process computes on the slot's GPU. False: cancel or stop."""
        while True:
            pids = self.runner.busy(slot)
            if not pids:
                return True
            state.phase = "waiting"
            record = self.runner.store.update_job(job["id"], progress={
                "phase": "waiting", "slot": slot.name, "waiting_for_pids": pids, "updated_at": utc_now_seconds(),
                "message": f"waiting for {slot.name} to be idle: PIDs {', '.join(map(str, pids))} compute on it",
            })
            if self.runner.asked_to_cancel(job["id"], record):
                self.runner.store.finish_job(job["id"], state="cancelled")
                logger.info("job %s cancelled while waiting for %s", job["id"], slot.name)
                return False
            if self.runner._stop.wait(self.runner.gpu_poll_s):
                return False

    def run(self, job: dict[str, Any], slot: Slot, state: _SlotState) -> None:
        """Check the job's paths again, wait for the GPU, then run the tune and record how it ended."""
        job_id = job["id"]
        refusal = None if self.runner.roots is None else outside_roots(job, self.runner.roots)
        if refusal is not None:
            logger.warning("job %s refused: %s", job_id, refusal)
            self.runner.store.finish_job(job_id, state="failed", result={"exit_code": None, "error": f"refused: {refusal}"})
            return
        if not self.wait_for_idle_gpu(job, slot, state):
            return
        try:
            request, cwd = job_request(job, slot.name)
        except MpadviseError as exc:  # what `mpadvise tune` would refuse before any trial
            logger.info("job %s failed: %s", job_id, exc)
            self.runner.store.finish_job(job_id, state="failed", result={"exit_code": exc.exit_code, "error": str(exc)})
            return
        files = JobFiles(self.runner.jobs_dir, job_id)
        files.write_request(request)
        tail = LogTail()
        state.phase = "running"
        # The arguments can hold secrets (keys, tokens): the log names the job, not its command.
        logger.info("job %s started on %s: %s", job_id, slot.name, job["script"])
        try:
            tmp = files.make_tmp()
            with open_job_log(files.log) as log:
                process = subprocess.Popen(
                    tune_argv(files.request, files.result, python=self.runner.python), stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=cwd, env=job_env(job_id, tmp),
                    start_new_session=True,  # its own group: a cancel kills it without touching us
                )
                pump = threading.Thread(target=pump_output, args=(process.stdout, tail, log), daemon=True)
                pump.start()
                outcome, progress = self._follow(job_id, slot, process, tail)
                pump.join(timeout=5)
            self._finish(job_id, process.returncode, outcome, progress, tail, files)
        finally:
            # However the job ended (done, failed, cancelled, the daemon stopping), its request,
            # its result and what its trials left under TMPDIR go; its processes are gone by
            # now (_follow waited).
            files.remove()

    def _finish(self, job_id: str, code: int | None, outcome: str, progress: dict[str, Any], tail: LogTail,
                files: JobFiles) -> None:
        if outcome == "stopped":
            logger.info("job %s interrupted by the daemon stopping; it runs again at the next start", job_id)
            return
        if outcome == "cancelled":
            self.runner.store.finish_job(job_id, state="cancelled", log_tail=tail.text())
            logger.info("job %s cancelled", job_id)
            return
        result = result_of(code, files.result, tail)
        final = "succeeded" if result.get("tune") is not None else "failed"
        # The last lines first, so a follower that sees the job finished has seen them all.
        self.runner.store.update_job(job_id, progress={**progress, "phase": "finished", "exit_code": code,
                                                       "lines": tail.count, "recent": tail.lines()[-RECENT_LINES:],
                                                       "updated_at": utc_now_seconds()})
        self.runner.store.finish_job(job_id, state=final, result=result, log_tail=tail.text())
        logger.info("job %s %s (exit code %s)", job_id, final, code)

    def _follow(self, job_id: str, slot: Slot, process: subprocess.Popen[bytes],
                tail: LogTail) -> tuple[str, dict[str, Any]]:
        """Watch a running tune until it exits, is cancelled, or the daemon stops; returns the
        outcome and the job's progress record so far."""
        progress: dict[str, Any] = {"phase": "running", "slot": slot.name, "pid": process.pid}
        foreign: set[int] = set()
        last_update = 0.0
        last_count = -1
        dirty = False
        last_gpu_check = time.monotonic()
        record: dict[str, Any] | None = self.runner.store.update_job(job_id, progress={**progress, "updated_at": utc_now_seconds()})
        while True:
            try:
                process.wait(timeout=self.runner.poll_s)
                return "exited", progress
            except subprocess.TimeoutExpired:
                pass
            if self.runner._stop.is_set():
                kill_job(job_id, process)
                process.wait()
                return "stopped", progress
            if self.runner.asked_to_cancel(job_id, record):
                kill_job(job_id, process)
                process.wait()
                return "cancelled", progress
            now = time.monotonic()
            if slot.index is not None and now - last_gpu_check >= self.runner.gpu_poll_s:
                # The tune's own trials compute on this GPU too; anything else is someone
                # else's work that started after ours, and it skews what we measure.
                last_gpu_check = now
                ours = set(job_pids(job_id))
                others = set(self.runner.busy(slot)) - ours
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
                record = self.runner.store.update_job(job_id, log_tail=tail.text(), progress={
                    **progress, "lines": tail.count, "recent": recent, "updated_at": utc_now_seconds(),
                })


def recover_jobs(store: Store, *, max_retries: int = 1) -> list[dict[str, Any]]:
    """At start: kill what is left of jobs the last daemon was running (a daemon killed with -9
    leaves its tunes running, which would store an answer while the same job runs again), and
    queue them again; returns the jobs changed."""
    for job in store.list_jobs(states=("running", "cancelling")):
        kill_job(job["id"])
    return store.requeue_interrupted(max_retries=max_retries)
