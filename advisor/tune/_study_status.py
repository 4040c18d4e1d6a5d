"""What a stored study holds (read before a tune's search, or by ``mpadvise study status``), and
the answer a finished tune keeps with it: the same tune run again prints it while the versions
and the options that shape the search still hold and the study holds no trial since.
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from advisor._log import get_logger
from advisor._version import __version__
from advisor.tune._options import TuneOptions
from advisor.tune._storage import (
    open_storage,
    quiet,
    riding_out,
    shared_storage,
    shown_url,
    sqlite_path,
    storage_exists,
    storage_failure,
    storage_url,
    timeout_kwargs,
)
from advisor.tune._study import (
    STUDY_ATTR_HARDWARE,
    STUDY_ATTR_REPLICATE,
    STUDY_ATTR_WORKLOAD,
    TRIAL_ATTR_CLAIM,
    TRIAL_ATTR_RESULT,
    check_hardware,
    measured_from,
    shared_workload_error,
    stored_study,
    workload_change,
)
from probes import HardwareProfile, MpadviseError, UsageError

STUDY_ATTR_ANSWER = "mpadvise:answer"
# Options that do not change what a tune measures or answers: where the study lives, how it is
# opened, and the device (the study's name holds the hardware fingerprint already).
_NOT_IN_KEY = frozenset({"storage", "resume", "fresh", "device"})


def check_storage(storage: str | None) -> None:
    """Open the Optuna storage once, so a bad URL fails before any trial runs (in one line)."""
    if storage is not None:
        open_storage(storage)


def check_study(storage: str | None, study_name: str, *, hardware: str, resume: bool, fresh: bool = False,
                spelling: tuple[str, str] = ("--resume", "--fresh")) -> None:
    """Refuse, before any trial runs, to continue a stored study of other hardware, or to delete
    one with finished trials unless ``fresh`` says so (``spelling`` names the two options)."""
    if storage is None:
        return
    if not (resume or shared_storage(storage)):
        held = None if fresh else kept_study(storage, study_name)
        if held is not None and held.finished:
            keep, drop = spelling
            raise UsageError(f"{held.describe()}; it is kept: pass {keep} to continue it, or {drop} to delete it "
                             "and start afresh")
        return
    _read_study(storage, study_name, "checking the study's hardware",
                lambda study: check_hardware(study, study_name, hardware, record=False))


def _read_study(storage: str, study_name: str, what: str, read: Callable[[Any], Any]) -> Any:
    """``read(study)`` on the stored study, riding out an outage; ``None`` where there is none."""
    with riding_out(storage) as worker:
        study = stored_study(storage, study_name, worker)
        return None if study is None else worker.call(what, lambda: read(study))


@dataclass(frozen=True)
class KeptStudy:
    """What a fresh start would delete: ``finished`` measured trials, the latest at ``last``."""

    name: str
    storage: str
    finished: int
    last: str | None

    @property
    def trials(self) -> str:
        when = f" from {self.last}" if self.last else ""
        return f"{self.finished} finished trial{'' if self.finished == 1 else 's'}{when}"

    def describe(self) -> str:
        return f"study {self.name!r} in {self.storage!r} holds {self.trials}"


def kept_study(storage: str | None, study_name: str) -> KeptStudy | None:
    """The stored study of that name, read without writing anything, or ``None``."""
    if storage is None or not storage_exists(storage):
        return None
    found = study_status(storage, study_name, missing_ok=True)
    if not found:
        return None
    return KeptStudy(study_name, shown_url(storage) or storage, found[0]["measured"], found[0]["last_finished"])


def finished_trials(storage: str | None, study_name: str) -> int:
    """How many finished trials the stored study holds; a storage that cannot be read counts none."""
    try:
        held = kept_study(storage, study_name)
    except MpadviseError:
        return 0
    return 0 if held is None else held.finished


def check_study_workload(storage: str | None, study_name: str, workload: Mapping[str, Any], *, resume: bool) -> bool:
    """``resume``, or ``False`` when a stored study of another workload (fp32's fingerprint and
    model signature) must not be continued: a shared one, or one of this machine with finished
    trials, is refused; an empty one starts afresh with a warning."""
    shared = shared_storage(storage)
    if storage is None or not (resume or shared):
        return resume
    found = _read_study(storage, study_name, "reading the study's workload", lambda study: (
        study.user_attrs.get(STUDY_ATTR_WORKLOAD), not study.get_trials(deepcopy=False)))
    if found is None:  # no such study yet: nothing to continue
        return resume
    # A study without a workload fingerprint and without trials has no verdicts to doubt.
    stored, empty = found
    changed = workload_change(stored, workload)
    if shared and changed:
        raise MpadviseError(shared_workload_error(study_name, changed))
    if stored is None and not empty:
        changed = "it keeps no workload fingerprint (stored by an earlier mpadvise), so its verdicts cannot be checked"
    if shared or changed is None:
        return resume
    held = kept_study(storage, study_name)
    if held is not None and held.finished:
        raise UsageError(f"--resume: {held.describe()} measured on another workload ({changed}); it is kept: pass "
                         "--fresh to delete it and start afresh, or run the workload it was measured on")
    get_logger().warning(f"--resume: study {study_name!r} was measured on another workload ({changed}): its trials "
                         "and replicate are not reused; a fresh study starts")
    return False


def stored_replicate(storage: str | None, study_name: str) -> dict[str, Any] | None:
    """The fp32 replicate kept with a stored study, for ``--resume`` to reuse, or ``None``."""
    if storage is None:
        return None
    stored = _read_study(storage, study_name, "reading fp32's replicate",
                         lambda study: study.user_attrs.get(STUDY_ATTR_REPLICATE))
    return stored if isinstance(stored, dict) else None


def study_status(storage: str, study_name: str | None = None, *, missing_ok: bool = False) -> list[dict[str, Any]]:
    """What a study storage holds, read without writing anything (no tables made, no trial failed
    as stale): per study, by name, ``study``, ``hardware``, ``trials`` (counts by state),
    ``workers``, ``best``, ``measured`` and ``last_finished``."""
    import optuna
    import sqlalchemy

    shown = shown_url(storage)
    if not storage_exists(storage):
        path = sqlite_path(storage) or "(none)"
        raise UsageError(f"no study storage at {shown!r}: the file {path} does not exist; expected "
                         "the SQLite file a tune wrote (by default studies.db in the cache directory)")
    engine_kwargs = timeout_kwargs(storage)
    try:
        # Only a storage fully made is read, its schema version stamped (Optuna's storage, opened
        # before that, writes the stamp itself, racing the tune that is making it).
        engine = sqlalchemy.create_engine(storage_url(storage), **engine_kwargs)
        try:
            made = {"studies", "version_info", "alembic_version"} <= set(sqlalchemy.inspect(engine).get_table_names())
            if made:
                with engine.connect() as connection:
                    made = all(connection.execute(sqlalchemy.text(f"SELECT COUNT(*) FROM {table}")).scalar()
                               for table in ("version_info", "alembic_version"))
        finally:
            engine.dispose()
        studies, backend = [], None  # none yet: a tune is making the storage now, or none ever did
        if made:
            with quiet():
                backend = optuna.storages.RDBStorage(storage_url(storage), engine_kwargs=engine_kwargs,
                                                     skip_compatibility_check=True, skip_table_creation=True)
            studies = backend.get_all_studies()
        if study_name is not None:
            studies = [s for s in studies if s.study_name == study_name]
            if not studies and not missing_ok:
                raise MpadviseError(f"no study {study_name!r} in {shown!r}; mpadvise study status --storage URL lists "
                                    "the studies it holds")
        out = [_study_summary(s, backend.get_all_trials(s._study_id, deepcopy=False)) for s in studies]
    except MpadviseError:
        raise
    except Exception as exc:  # an unreachable server, a refused login, a driver missing, a bad URL
        raise storage_failure(storage, exc) from None
    return sorted(out, key=lambda summary: summary["study"])


def _study_summary(study: Any, trials: list[Any]) -> dict[str, Any]:
    import optuna

    counts = dict.fromkeys(("complete", "running", "waiting", "failed", "pruned"), 0)
    workers: set[str] = set()
    best: dict[str, Any] | None = None
    measured, ends = 0, []
    for frozen in trials:
        counts["failed" if frozen.state == optuna.trial.TrialState.FAIL else frozen.state.name.lower()] += 1
        claim = frozen.user_attrs.get(TRIAL_ATTR_CLAIM)
        if isinstance(claim, dict) and claim.get("worker"):
            workers.add(str(claim["worker"]))
        data = frozen.user_attrs.get(TRIAL_ATTR_RESULT)
        if frozen.state != optuna.trial.TrialState.COMPLETE or not isinstance(data, dict) or data.get("pruned"):
            continue
        if data.get("worker"):
            workers.add(str(data["worker"]))
        # The trials a fresh start would lose: results measured by a trial (not a copy of a worker's
        # fp32 reference, measured outside the study, nor a proposal the priors ruled out).
        if data.get("source", "run") == "run":
            measured += 1
            if frozen.datetime_complete is not None:
                ends.append(frozen.datetime_complete)
        try:
            m = measured_from(data)
        except (KeyError, TypeError, ValueError):  # a result stored by another version: not ranked
            continue
        if m.stable and m.feasible and m.goodput > 0 and (best is None or m.goodput > best["goodput"]):
            best = {"label": m.candidate.label, "goodput": round(m.goodput, 3), "worker": data.get("worker"),
                    "trial": frozen.number}
    return {"study": study.study_name, "hardware": study.user_attrs.get(STUDY_ATTR_HARDWARE), "trials": counts,
            "workers": sorted(workers), "best": best, "measured": measured,
            "last_finished": max(ends).strftime("%Y-%m-%d %H:%M") if ends else None}


@dataclass(frozen=True)
class StoredAnswer:
    """A finished tune's answer as its study keeps it: its JSON, its config file and when (UTC)."""

    payload: dict[str, Any]
    config_text: str | None
    at: str


def answer_key(options: TuneOptions, profile: HardwareProfile) -> dict[str, Any]:
    shaping = {k: v for k, v in options.to_dict().items() if k not in _NOT_IN_KEY}
    return {"mpadvise": __version__, "torch": profile.torch_version, "options": shaping}


def store_answer(storage: str | None, study_name: str, key: dict[str, Any], payload: dict[str, Any],
                 config_text: str | None) -> None:
    """Keep a finished tune's answer with its study (not a shared one: no one worker owns it); a
    storage that fails here loses only the shortcut."""
    if storage is None or shared_storage(storage):
        return
    at = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M")

    def keep(study: Any) -> None:
        trials = len(study.get_trials(deepcopy=False))
        study.set_user_attr(STUDY_ATTR_ANSWER, {"key": key, "json": payload, "config": config_text,
                                                "at": at, "trials": trials})

    with contextlib.suppress(MpadviseError):
        _read_study(storage, study_name, "keeping the answer", keep)


def stored_answer(storage: str | None, study_name: str, key: dict[str, Any]) -> StoredAnswer | None:
    """The answer kept with the study, where it was tuned with ``key`` and no trial was added since."""
    if storage is None or shared_storage(storage) or not storage_exists(storage):
        return None
    found = _read_study(storage, study_name, "reading the study's answer", lambda study: (
        study.user_attrs.get(STUDY_ATTR_ANSWER), len(study.get_trials(deepcopy=False))))
    kept, trials = found or (None, None)
    if (not isinstance(kept, dict) or kept.get("key") != key
            or not isinstance(kept.get("json"), dict) or trials != kept.get("trials")):
        return None
    return StoredAnswer(kept["json"], kept.get("config"), str(kept.get("at") or "?"))
