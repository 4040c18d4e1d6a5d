"""The job slots (one per GPU, or one CPU slot), and the runner threads that claim, cancel and
recover tune jobs."""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import probes
from advisor._secure import ensure_private_dir
from advisor.cache import Store
from advisor.daemon._config import PRUNE_EVERY_S, logger
from advisor.daemon._job import JOB_TMP, JobRun, kill_job, prune_job_logs, prune_jobs, remove_tree
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
    return [] if slot.index is None else probes.gpu_busy(slot.index, uuid=slot.uuid)


@dataclass
class SlotState:
    job: str | None = None
    phase: str = "idle"


@dataclass
class JobRunner:
    """One worker thread per slot: claim the oldest job, wait for an idle GPU, run the tune.
    ``busy`` gives the PIDs computing on a slot's GPU (NVML). Finished jobs older than
    ``retention_s`` are deleted at start and every ``prune_every_s`` (``None`` keeps them). Each
    job's paths are checked against ``roots`` again when it is claimed, since whoever can write
    the queue could have put it there (``None``, in tests only, skips that check)."""

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
            if self.stopping.wait(self.prune_every_s):
                return

    def wake(self) -> None:
        for event in self._wake.values():
            event.set()

    def cancel(self, job_id: str) -> None:
        self._cancel.add(job_id)

    def asked_to_cancel(self, job_id: str, record: dict[str, Any] | None) -> bool:
        return job_id in self._cancel or record is None or record.get("state") == "cancelling"

    def slot_info(self) -> list[dict[str, Any]]:
        idle = SlotState()
        return [{"name": s.name, "uuid": s.uuid, **asdict(self._state.get(s.name, idle))} for s in self.slots]

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the workers, killing running jobs; they stay ``running`` in the store, so the
        next daemon queues them again (once)."""
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
            except MpadviseError as exc:
                logger.warning("cannot read the job queue: %s", exc)
                self.stopping.wait(self.idle_poll_s)
                continue
            except Exception:  # a worker must outlive anything the queue holds
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


def recover_jobs(store: Store, *, max_retries: int = 1) -> list[dict[str, Any]]:
    """At start: kill what is left of jobs the last daemon was running (a daemon killed with -9
    leaves its tunes running, which would store an answer while the same job runs again), and
    queue them again; returns the jobs changed."""
    for job in store.list_jobs(states=("running", "cancelling")):
        kill_job(job["id"])
    return store.requeue_interrupted(max_retries=max_retries)
