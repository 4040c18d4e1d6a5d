"""Tuned answers in the cache: record a tune's winner, find it again, tell when it no longer
holds; and what the runtime guard saw in long runs. A lookup never raises for cache trouble
(at most one warning); the store is imported only when a cache exists."""

from __future__ import annotations

import contextlib
import datetime
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from advisor._log import get_logger
from advisor._paths import database_path
from advisor.cache._base import nothing_cached_yet
from advisor.cache._records import _trials
from policies import (
    HardwareMismatch,
    Policy,
    PolicyError,
    TunedOn,
    hardware_mismatch,
    supported_modes,
)
from probes import MpadviseError, hardware_fingerprint

if TYPE_CHECKING:
    from advisor.cache._store import Store
    from probes import HardwareProfile

# Profile fields that describe one card at one moment rather than the hardware model: they
# stay out of the stored profile, which travels in exports to other machines and people.
_MOMENTARY_PROFILE_FIELDS = ("uuid", "memory_free")


def record_tune(*, profile: HardwareProfile, policy: Policy, script: str | os.PathLike[str],
                workload_fingerprint: str, trials: list[dict[str, Any]], speedup_vs_fp32: float | None,
                goodput: float | None, store: Store | None = None, args: Sequence[str] | None = None,
                utilisation: dict[str, Any] | None = None,
                reference_losses: Sequence[float] | None = None) -> int | None:
    """Store a tune's winner for this hardware and workload, with its trials: its id, or ``None``
    when no cache is usable. The policy gets a complete ``[tuned_on]``; ``args``, ``utilisation``
    and ``reference_losses`` (fp32's loss per step, for the run's guard) go in the summary."""
    _trials("trials", list(trials))  # checked before any cache is opened: a wrong field is a bug
    script_path = str(Path(script).resolve())
    fingerprint = hardware_fingerprint(profile)
    earlier = policy.tuned_on or TunedOn()
    # The workload facts and the speed-up's interval and basis, as the tune measured them, kept.
    tuned = replace(
        earlier, hardware_fingerprint=fingerprint, device=profile.name,
        torch=profile.torch_version or "", libraries=tuple(sorted(profile.libraries)),
        date=earlier.date or datetime.date.today().isoformat(),
        speedup_vs_fp32=speedup_vs_fp32, goodput=goodput, workload_fingerprint=workload_fingerprint,
        script=script_path, trials=len(trials), cuda=profile.cuda_runtime or "",
        args=earlier.args if args is None else tuple(str(arg) for arg in args),
    )
    summary = {"speedup_vs_fp32": speedup_vs_fp32, "goodput": goodput, "trial_count": len(trials),
               "device": profile.name, "date": tuned.date, "model_signature": tuned.model_signature}
    if args is not None:
        summary["args"] = [str(arg) for arg in args]
    if utilisation is not None:
        summary["utilisation"] = dict(utilisation)
    if reference_losses is not None:
        summary["fp32_losses"] = [float(v) if math.isfinite(v) else None for v in reference_losses]
    with contextlib.ExitStack() as opened:
        if store is None:
            from advisor.cache._store import open_store

            store = open_store()
            if store is None:
                return None
            opened.enter_context(store)
        store.put_hardware(fingerprint, {name: value for name, value in profile.to_dict().items()
                                         if name not in _MOMENTARY_PROFILE_FIELDS})
        return store.put_recommendation(
            hardware_fp=fingerprint, workload_fp=workload_fingerprint, script=script_path,
            policy=replace(policy, tuned_on=tuned).to_dict(), speedup_vs_fp32=speedup_vs_fp32,
            # The store needs a number: an unmeasured goodput is 0 there (the summary keeps None).
            goodput=goodput if goodput is not None else 0.0, summary=summary, trials=[dict(t) for t in trials],
            versions={"torch": profile.torch_version, **dict(profile.libraries)},
        )


@dataclass(frozen=True)
class TunedAnswer:
    """A tune's answer for this script: the policy, a label for logs, the script's arguments at
    tuning time (``None`` if unknown), and fp32's loss per step, for the run's guard."""

    policy: Policy
    label: str
    args: tuple[str, ...] | None = None
    reference: tuple[float, ...] = ()


def cached_answers(profile: HardwareProfile, script: str | os.PathLike[str] | None) -> list[TunedAnswer]:
    """Every cached answer for this hardware and this very script file, newest first; an entry
    that cannot be read or run here is skipped with a warning. Empty on any cache trouble."""
    rows = _read(script, "cache lookup", "the cache", lambda store, path: store.find_recommendations(
        hardware_fp=hardware_fingerprint(profile), script=path))
    answers = (_answer(row, profile, database_path()) for row in rows)
    return [answer for answer in answers if answer is not None]


def _read(script: str | os.PathLike[str] | None, doing: str, without: str,
          query: Callable[[Store, str], list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """What ``query`` finds for this very script file; empty without a script, on any cache
    trouble, or when nothing is cached yet (a plain training run leaves no files behind)."""
    path = database_path()
    if script is None or nothing_cached_yet(path):
        return []
    from advisor.cache._store import open_store

    store = open_store(path)
    if store is None:
        return []
    try:
        with store:
            return query(store, str(Path(script).resolve()))
    except (MpadviseError, OSError, ValueError) as exc:
        # ValueError: a row whose JSON was damaged by hand. A cache must never stop training.
        get_logger().warning(f"{doing} in {path} failed: {exc}; continuing without {without}")
        return []


def record_guard_event(event: Mapping[str, Any], *, profile: HardwareProfile, workload_fp: str | None,
                       script: str | os.PathLike[str] | None) -> bool:
    """Store the runtime guard's ``event`` (``GuardEvent.to_dict()``) for this hardware, workload
    and script; whether it was stored. A cache that cannot be written costs one warning."""
    from advisor.cache._store import open_store

    path = database_path()
    store = open_store(path)
    if store is None:
        return False
    try:
        with store:
            store.put_guard_event(event, hardware_fp=hardware_fingerprint(profile), workload_fp=workload_fp,
                                  script=None if script is None else str(Path(script).resolve()))
    except (MpadviseError, OSError) as exc:
        get_logger().warning(f"the guard could not record its event in {path}: {exc}")
        return False
    return True


def guard_events_for(profile: HardwareProfile, script: str | os.PathLike[str] | None) -> list[dict[str, Any]]:
    """This hardware's and script's guard events, newest first; empty on any cache trouble."""
    return _read(script, "reading the guard's events", "them", lambda store, path: store.list_guard_events(
        hardware_fp=hardware_fingerprint(profile), script=path))


def _answer(row: dict[str, Any], profile: HardwareProfile, path: Path) -> TunedAnswer | None:
    """The answer a cache row holds, or ``None`` (with a warning) when it cannot apply here."""
    label = f"cache entry #{row['id']} (tuned {str(row['created_at'])[:10]})"  # how logs name it
    try:
        policy = Policy.from_dict(row["policy"], source=f"cache entry #{row['id']}")
    except PolicyError as exc:
        get_logger().warning(f"{label} in {path} cannot be read ({exc}); ignoring it; "
                             "`mpadvise cache clear` removes it, `mpadvise tune` writes a new one")
        return None
    support = supported_modes(profile, policy).get(policy.mode)
    if support is None or not support.supported:
        # Same hardware, but this mpadvise no longer runs the mode here (its support table
        # changed): skipping the entry beats failing the run on it.
        why = support.reason if support is not None else "unknown mode"
        get_logger().warning(f"not applying {label}: mode {policy.mode} cannot run on {profile.name} "
                             f"({why}); run `mpadvise tune` again")
        return None
    summary = row.get("summary") or {}
    args, losses = summary.get("args"), summary.get("fp32_losses")
    recorded = tuple(args) if isinstance(args, list) and all(isinstance(arg, str) for arg in args) else None
    reference = tuple(math.nan if v is None else float(v) for v in losses) if isinstance(losses, list) and all(
        v is None or isinstance(v, (int, float)) for v in losses) else ()
    return TunedAnswer(policy, label, recorded, reference)


def lookup(profile: HardwareProfile, script: str | os.PathLike[str] | None) -> tuple[Policy, str] | None:
    answers = cached_answers(profile, script)
    return (answers[0].policy, answers[0].label) if answers else None


@dataclass(frozen=True)
class EntryStatus:
    """Why a cache entry would not be applied on some hardware: ``mismatch`` when its policy
    says what differs, else ``detail``."""

    detail: str
    mismatch: HardwareMismatch | None = None

    def describe(self) -> str:
        """One line for people: ``"tuned on other hardware or versions (torch a -> b)"``."""
        return self.mismatch.describe() if self.mismatch is not None else self.detail

    def what_differs(self) -> str:
        """Only what changed (``"torch a -> b"``) where that is known, else ``describe()``."""
        return self.mismatch.detail() if self.mismatch is not None else self.detail


def entry_status(row: dict[str, Any], profile: HardwareProfile) -> EntryStatus | None:
    """Why a cache entry would not be applied on ``profile``, or ``None`` when it would be."""
    try:
        policy = Policy.from_dict(row["policy"], source=f"cache entry #{row['id']}")
    except PolicyError as exc:
        return EntryStatus(f"unreadable policy ({exc})")
    mismatch = hardware_mismatch(policy, profile)
    if mismatch is not None:
        return EntryStatus("", mismatch)
    if row["hardware_fp"] != hardware_fingerprint(profile):
        # A policy stored without a [tuned_on] fingerprint: the row's key still says where it
        # was measured.
        return EntryStatus(f"tuned on other hardware (fingerprint {row['hardware_fp']})")
    support = supported_modes(profile, policy).get(policy.mode)
    if support is not None and not support.supported:
        return EntryStatus(f"mode {policy.mode} cannot run here ({support.reason})")
    return None
