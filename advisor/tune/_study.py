"""A study in the Optuna storage: opening it, its records, and its trials asked and told. Workers
sharing a study claim a trial's candidate before running it; a trial whose worker goes silent (no
heartbeat) is failed after a grace period and queued again for a live worker.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import threading
import warnings
import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from advisor._log import get_logger
from advisor.tune._space import Candidate, Measured, SearchSpace
from advisor.tune._storage import (
    StorageLost,
    Worker,
    first_line,
    open_storage,
    quiet,
    shared_storage,
    storage_error,
)
from probes import MpadviseError

STUDY_ATTR_SPACE = "mpadvise:space"
STUDY_ATTR_REPLICATE = "mpadvise:replicate"  # fp32 under another seed: the verdicts' spread
STUDY_ATTR_HARDWARE = "mpadvise:hardware"  # the hardware fingerprint every trial of the study ran on
# The fp32 reference's workload fingerprint and model signature: a study name covers the script
# and its arguments, not what it reads besides (an environment variable, a config file).
STUDY_ATTR_WORKLOAD = "mpadvise:workload"
TRIAL_ATTR_RESULT = "mpadvise:result"
# The candidate a trial runs, its number and its worker, written before the worker looks for rivals.
TRIAL_ATTR_CLAIM = "mpadvise:claim"
TRIAL_ATTR_CLOSED = "mpadvise:closed"  # why a trial ended without a result (FAIL), in words


def open_study(storage: str | None, study_name: str, *, resume: bool, seed: int, worker: str) -> tuple[Any, bool]:
    """The study, and whether this call made it: a shared one is joined as it stands; elsewhere a
    tune without ``resume`` starts afresh. The storage's errors pass through, to be retried."""
    import optuna

    shared = shared_storage(storage)
    # The workers of one study draw different proposals: with one seed, they would all propose
    # the same candidates in the same order and spend their asks skipping each other's.
    sampler = optuna.samplers.TPESampler(seed=zlib.crc32(f"{seed}:{worker}".encode()) if shared else seed,
                                         n_startup_trials=4)
    backend = None if storage is None else open_storage(storage)[0]
    with quiet():
        if not resume and not shared and backend is not None:
            with contextlib.suppress(KeyError):  # no such study yet
                optuna.delete_study(study_name=study_name, storage=backend)
        try:  # the study name is unique in the storage: one worker makes it, the others join it
            return optuna.create_study(study_name=study_name, storage=backend, direction="maximize",
                                       sampler=sampler), True
        except optuna.exceptions.DuplicatedStudyError:
            return optuna.load_study(study_name=study_name, storage=backend, sampler=sampler), False


def stored_study(storage: str, study_name: str, worker: Worker) -> Any:
    """The stored ``optuna.Study`` of that name, or ``None`` when there is none yet."""
    import optuna

    backend, _ = open_storage(storage)

    def load() -> Any:
        with quiet():
            return optuna.load_study(study_name=study_name, storage=backend)

    try:
        return worker.call("opening the study", load)
    except KeyError:  # no such study yet
        return None
    except StorageLost:
        raise
    except Exception as exc:  # a locked file, a refusal
        raise MpadviseError(storage_error(storage, exc)) from None


def check_hardware(study: Any, study_name: str, hardware: str | None, *, record: bool) -> None:
    if hardware is None:
        return
    stored = study.user_attrs.get(STUDY_ATTR_HARDWARE)
    if stored not in (None, hardware):
        raise MpadviseError(
            f"study {study_name!r} holds trials measured on hardware {stored}, and this machine is {hardware}: "
            "measurements from different hardware never mix; give this machine its own study (the study name "
            "mpadvise tune chooses names the hardware)"
        )
    if stored is None and record:
        study.set_user_attr(STUDY_ATTR_HARDWARE, hardware)


def workload_change(stored: Any, workload: Mapping[str, Any]) -> str | None:
    if not isinstance(stored, dict):
        return None
    for key, what in (("model_signature", "the model changed: signature"),
                      ("workload_fingerprint", "the optimizer, global batch or script changed: workload fingerprint")):
        before, now = stored.get(key), workload.get(key)
        if before != now:
            before, now = (str(v)[:12] if v else "none" for v in (before, now))
            return f"{what} {before} then, {now} now"
    return None


def shared_workload_error(study_name: str, changed: str) -> str:
    return (f"study {study_name!r} holds trials of another workload ({changed}); every worker of a shared study must "
            "run the same workload (the same environment, config files and data): fix this worker, or delete the study "
            f"(optuna delete-study --study-name {study_name} --storage URL)")


def claim_workload(study: Any, study_name: str, workload: Mapping[str, Any] | None, *, shared: bool) -> None:
    if workload is None:
        return
    changed = workload_change(study.user_attrs.get(STUDY_ATTR_WORKLOAD), workload)
    if changed:
        raise MpadviseError(shared_workload_error(study_name, changed) if shared else
                            f"study {study_name!r} holds trials of another workload ({changed}); run without --resume "
                            "to start a fresh study")
    study.set_user_attr(STUDY_ATTR_WORKLOAD, dict(workload))


def claim_space(study: Any, space: SearchSpace, study_name: str, *, shared: bool) -> None:
    # Everything that decides which candidates exist: a framework's limits and FSDP2's reduction
    # dimension too, so a script that changed framework or started sharding gets no stale space.
    limits = space.limits
    space_json = json.dumps({"modes": space.modes, "micro_batches": space.micro_batches, "user_batch": space.user_batch,
                             "fsdp": space.fsdp, "loss_scale_kinds": limits.loss_scale_kinds,
                             "loss_scale_settings": limits.loss_scale_settings})
    stored_space = study.user_attrs.get(STUDY_ATTR_SPACE)
    if stored_space is not None and stored_space != space_json:
        fix = ("tune on every worker with the same --mode, --scale-batch and --include-emulated, or delete the study "
               f"(optuna delete-study --study-name {study_name} --storage URL)" if shared
               else "run without --resume to start a fresh study")
        raise MpadviseError(f"study {study_name!r} was made for another search space ({stored_space}); {fix}")
    study.set_user_attr(STUDY_ATTR_SPACE, space_json)


def ask(study: Any) -> Any:
    with quiet():
        return study.ask()


@contextlib.contextmanager
def beating(worker: Worker, trial: Any) -> Iterator[None]:
    """Send the trial's heartbeats while the block runs (Optuna beats only in ``optimize``)."""
    backend = worker.backend
    interval = None if backend is None else backend.get_heartbeat_interval()
    if interval is None:
        yield
        return
    trial_id = trial._trial_id  # Optuna keys heartbeats by the storage's trial id, not the number
    worker.call(f"recording trial {trial.number}'s heartbeat", lambda: backend.record_heartbeat(trial_id))
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(interval):
            try:
                backend.record_heartbeat(trial_id)
            except Exception as exc:  # a hiccup of the server: the next beat may get through
                get_logger().debug(f"heartbeat of trial {trial.number} not recorded: {first_line(exc)}")

    thread = threading.Thread(target=beat, name=f"mpadvise-heartbeat-{trial.number}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def fail_stale(study: Any) -> None:
    """Fail the trials whose workers stopped sending heartbeats; Optuna's retry callback queues a
    copy of each, which the next ``ask`` of a live worker takes."""
    import optuna

    with quiet():
        optuna.storages.fail_stale_trials(study)


@dataclass(frozen=True)
class StudyTrials:
    """A study's trials at one reading: finished results, pruned proposals, and the candidates of
    trials running now or failed as stale (with the trials' numbers)."""

    measured: list[Measured]
    pruned: list[Measured]
    running: dict[Candidate, int]
    silent: dict[Candidate, list[int]]


def read_trials(study: Any, *, exclude: int | None = None) -> StudyTrials:
    """``exclude``: this worker's own trial, no rival to itself."""
    import optuna

    state = optuna.trial.TrialState
    trials = StudyTrials([], [], {}, {})
    for frozen in study.get_trials(deepcopy=False):
        if frozen.state == state.COMPLETE:
            data = frozen.user_attrs.get(TRIAL_ATTR_RESULT)
            if isinstance(data, dict):
                m = measured_from(data)
                # A measured result always has an outcome; an empty one is a pruned proposal
                # stored before pruned proposals were marked as such.
                (trials.pruned if data.get("pruned") or not m.outcome else trials.measured).append(m)
            continue
        # A retried copy inherits its original's claim, which names the original's number.
        data = frozen.user_attrs.get(TRIAL_ATTR_CLAIM)
        if not isinstance(data, dict) or data.get("trial") != frozen.number or frozen.number == exclude:
            continue
        if frozen.state == state.RUNNING:
            trials.running.setdefault(candidate_from(data), frozen.number)
        elif frozen.state == state.FAIL and TRIAL_ATTR_CLOSED not in frozen.user_attrs:
            # Failed as stale: its worker went silent.
            trials.silent.setdefault(candidate_from(data), []).append(frozen.number)
    return trials


def claim(trial: Any, candidate: Candidate, worker: str) -> None:
    # The trial's number tells a retried copy's inherited claim apart.
    trial.set_user_attr(TRIAL_ATTR_CLAIM, {**candidate_to(candidate), "trial": trial.number, "worker": worker})


def store_result(study: Any, trial: Any, measured: Measured, worker: Worker, what: str) -> bool:
    """Tell the study what ``trial`` measured; ``True`` where it was stored as a new trial instead
    (the study had failed the trial as stale meanwhile)."""
    import optuna

    try:
        worker.call(what, lambda: tell(study, trial, measured, source="run", worker=worker.name))
        return False
    except optuna.exceptions.UpdateFinishedTrialError:
        pass

    def add() -> None:
        frozen = optuna.trial.create_trial(state=optuna.trial.TrialState.COMPLETE, value=measured.goodput,
                                           params=trial.params, distributions=trial.distributions)
        _record(frozen, measured, "run", worker.name)
        study.add_trial(frozen)

    worker.call(what, add)
    return True


def refused(exc: BaseException) -> bool:  # the storage refused (an outage is ridden out instead)
    import optuna
    import sqlalchemy.exc

    return isinstance(exc, (sqlalchemy.exc.SQLAlchemyError, optuna.exceptions.StorageInternalError))


def close(study: Any, trial: Any, why: str) -> None:
    """End a trial without a result (FAIL, which the sampler ignores), saying why."""
    import optuna

    with _finished_already(study, trial, optuna.trial.TrialState.FAIL):
        trial.set_user_attr(TRIAL_ATTR_CLOSED, why)
        study.tell(trial, state=optuna.trial.TrialState.FAIL)


def tell(study: Any, trial: Any, measured: Measured, *, source: str, worker: str) -> None:
    """Store a result with the trial and finish it; ``source``: ``run``, ``reference`` (this
    worker's fp32, measured outside the study), ``known`` (a copy) or ``pruned``."""
    import optuna

    with _finished_already(study, trial, optuna.trial.TrialState.COMPLETE), warnings.catch_warnings():
        # A retried tell finds the constraints it set before the storage went away: the same values.
        warnings.filterwarnings("ignore", message="The constraint value is ignored because")
        _record(trial, measured, source, worker)
        study.tell(trial, measured.goodput)


def _record(trial: Any, measured: Measured, source: str, worker: str) -> None:
    # Constraints (> 0 violates): instability and not fitting are what TPE must learn to avoid.
    trial.set_constraint("unstable", 0.0 if measured.stable else 1.0)
    trial.set_constraint("infeasible", 0.0 if measured.feasible else 1.0)
    trial.set_user_attr(TRIAL_ATTR_RESULT, {**measured_to(measured), "pruned": source == "pruned", "source": source,
                                            "worker": worker})


@contextlib.contextmanager
def _finished_already(study: Any, trial: Any, state: Any) -> Iterator[None]:
    """Let finishing a trial pass when the study holds it in ``state`` already (the retry of a tell
    that landed); one failed as stale by another worker still raises when it was to complete."""
    import optuna

    try:
        yield
    except optuna.exceptions.UpdateFinishedTrialError:
        if study._storage.get_trial(trial._trial_id).state != state:  # Optuna keys trials by id
            raise


def candidate_to(c: Candidate) -> dict[str, Any]:
    return dataclasses.asdict(c)


def candidate_from(data: Mapping[str, Any]) -> Candidate:
    return Candidate(**{f.name: data.get(f.name, f.default) for f in dataclasses.fields(Candidate)})


def measured_to(m: Measured) -> dict[str, Any]:
    return {
        **candidate_to(m.candidate), "goodput": m.goodput, "feasible": m.feasible, "stable": m.stable,
        "oom": m.oom, "outcome": m.outcome, "reason": m.reason[:2000], "verdict_kind": m.verdict_kind,
    }


def measured_from(data: Mapping[str, Any]) -> Measured:
    return Measured(
        candidate_from(data), float(data["goodput"]), bool(data["feasible"]), bool(data["stable"]),
        bool(data.get("oom", False)), str(data.get("outcome", "")), str(data.get("reason", "")),
        str(data.get("verdict_kind", "")),
    )
