"""Tuned answers in the cache: record a tune's winner, find it again, tell when it no longer holds.

The store (:mod:`advisor.cache._store`) keeps rows; this module decides what a row means for
this machine and this script:

* :func:`record_tune` stores the hardware profile and the winning policy with its trials. The
  stored policy carries a complete ``[tuned_on]`` record (hardware fingerprint, versions, model
  signature...), so every later check can be made from the policy alone.
* :func:`cached_answers` is what ``load_policy()`` consults in a plain run: every entry for
  this hardware fingerprint and this script, by its exact path, newest first (:func:`lookup`
  gives the newest alone). The hardware fingerprint covers the device model, compute
  capability and the torch and CUDA release lines, so an entry tuned under anything else
  simply misses; an FP8 answer also needs its FP8 library at the version it was tuned with
  (``policies.hardware_mismatch``). One script has one entry per workload it was tuned on
  (other arguments, another learning rate...); which of them matches this run's *workload*
  (model, optimizer, global batch, script content and arguments) is decided later, in
  ``AppliedPolicy.setup()`` and ``micro_batch_size()``, where it is known.
* :func:`stale_entries` and :func:`entry_status` say, for ``mpadvise show``, which entries do
  not apply here and why.

Nothing here raises for cache trouble during a lookup: a missing, damaged, locked or
read-only cache costs at most one warning and the run continues with the next source.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from advisor._log import get_logger
from advisor._paths import database_path
from advisor.cache._base import nothing_cached_yet
from advisor.cache._records import TRIAL_FIELDS
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

__all__ = [
    "EntryStatus",
    "TunedAnswer",
    "cached_answers",
    "entry_label",
    "entry_status",
    "lookup",
    "nothing_cached_yet",
    "policy_of",
    "record_tune",
    "recorded_args",
    "stale_entries",
    "stored_profile",
    "versions_of",
]

# Profile fields that describe one card at one moment rather than the hardware model: they
# stay out of the stored profile, which travels in exports to other machines and people.
_MOMENTARY_PROFILE_FIELDS = ("uuid", "memory_free")



def versions_of(profile: HardwareProfile) -> dict[str, str | None]:
    """The library versions an answer was measured with: torch and each FP8 library.

    Args:
        profile: the hardware profile of the tune.

    Returns:
        ``{"torch": "2.5.1", "torchao": "0.10.0", "transformer_engine": None}``.
    """
    versions: dict[str, str | None] = {"torch": profile.torch_version}
    versions.update(dict(profile.libraries))
    return versions


def stored_profile(profile: HardwareProfile) -> dict[str, Any]:
    """The profile as the cache stores it: JSON-ready, without per-card identifiers.

    Args:
        profile: any hardware profile.

    Returns:
        ``profile.to_dict()`` without the UUID and the momentary free memory; its hardware
        fingerprint is the same as the profile's.
    """
    data = profile.to_dict()
    for name in _MOMENTARY_PROFILE_FIELDS:
        data.pop(name, None)
    return data


def record_tune(
    *,
    profile: HardwareProfile,
    policy: Policy,
    script: str | os.PathLike[str],
    workload_fingerprint: str,
    trials: list[dict[str, Any]],
    speedup_vs_fp32: float | None,
    goodput: float | None,
    store: Store | None = None,
    args: Sequence[str] | None = None,
    utilisation: dict[str, Any] | None = None,
) -> int | None:
    """Store a tune's winner for this hardware and workload, with the trials behind it.

    The policy is stored with a complete ``[tuned_on]`` record: the hardware fingerprint,
    device, torch, CUDA and FP8 library versions come from ``profile``, the measurements from
    the arguments; the workload facts already on ``policy.tuned_on`` (``model_signature``,
    ``global_batch``, ``script_digest``) and its ``date`` are kept. An earlier answer for the
    same (hardware, workload) key is replaced.

    Args:
        profile: the hardware the tune ran on.
        policy: the winning policy.
        script: the tuned training script; stored as an absolute path, so that a plain run
            of the same file finds it.
        workload_fingerprint: the workload's cache key (16 to 64 lowercase hex characters).
        trials: one dict per trial, with keys among ``number``, ``mode``, ``params``,
            ``outcome``, ``verdict``, ``reason``, ``goodput``, ``metrics``.
        speedup_vs_fp32: the winner's goodput over the fp32 reference, if measured.
        goodput: the winner's samples per second, if measured (stored as 0.0 when unknown).
        store: an open store; default: the user's cache (``MPADVISE_HOME`` or XDG).
        args: the script's command-line arguments the tune ran it with, kept in the summary
            so that ``mpadvise run`` can tell a framework script run with others before the
            framework builds the model (see :class:`TunedAnswer`); ``None`` when unknown.
        utilisation: the winner's achieved TFLOP/s and MFU (``tflops``, ``mfu``, ``dtype``,
            ``peak_tflops``, ``flops_per_step``, ``flops_basis``), kept in the summary; ``None``
            when the FLOPs were not counted.

    Returns:
        The new recommendation's id, or ``None`` when there is no usable cache (after one
        warning).

    Raises:
        MpadviseError: a field has the wrong type or shape (the message names it), or a trial
            has a key the store does not accept.
    """
    _check_trial_keys(trials)
    script_path = str(Path(script).resolve())
    fingerprint = hardware_fingerprint(profile)
    tuned = _tuned_on(profile, policy, script_path, workload_fingerprint, len(trials), speedup_vs_fp32, goodput)
    if args is not None:
        tuned = replace(tuned, args=tuple(str(arg) for arg in args))
    stored_policy = replace(policy, tuned_on=tuned)
    summary = {
        "speedup_vs_fp32": speedup_vs_fp32,
        "goodput": goodput,
        "trial_count": len(trials),
        "device": profile.name,
        "date": tuned.date,
        "model_signature": tuned.model_signature,
    }
    if args is not None:
        summary["args"] = [str(arg) for arg in args]
    if utilisation is not None:
        summary["utilisation"] = dict(utilisation)
    owned = store is None
    if store is None:
        from advisor.cache._store import open_store

        store = open_store()
        if store is None:
            return None
    try:
        store.put_hardware(fingerprint, stored_profile(profile))
        return store.put_recommendation(
            hardware_fp=fingerprint,
            workload_fp=workload_fingerprint,
            script=script_path,
            policy=stored_policy.to_dict(),
            speedup_vs_fp32=speedup_vs_fp32,
            # The store needs a number; an unmeasured goodput is recorded as 0, and the
            # summary keeps the None.
            goodput=goodput if goodput is not None else 0.0,
            versions=versions_of(profile),
            summary=summary,
            trials=[dict(trial) for trial in trials],
        )
    finally:
        if owned:
            store.close()


def _check_trial_keys(trials: list[dict[str, Any]]) -> None:
    """Refuse a trial dict with a key the store does not keep, naming the key and the allowed ones."""
    for index, trial in enumerate(trials):
        unknown = sorted(set(trial) - set(TRIAL_FIELDS))
        if unknown:
            raise MpadviseError(
                f"record_tune: trials[{index}] has key {unknown[0]!r}; allowed keys are "
                f"{', '.join(TRIAL_FIELDS)} (put anything else in 'metrics')"
            )


def _tuned_on(
    profile: HardwareProfile,
    policy: Policy,
    script_path: str,
    workload_fingerprint: str,
    trial_count: int,
    speedup_vs_fp32: float | None,
    goodput: float | None,
) -> TunedOn:
    """The complete ``[tuned_on]`` record: hardware and versions from ``profile``, the workload
    facts and date already on ``policy.tuned_on`` kept."""
    earlier = policy.tuned_on or TunedOn()
    return TunedOn(
        hardware_fingerprint=hardware_fingerprint(profile),
        device=profile.name,
        torch=profile.torch_version or "",
        libraries=tuple(sorted(profile.libraries)),
        date=earlier.date or datetime.date.today().isoformat(),
        speedup_vs_fp32=speedup_vs_fp32,
        goodput=goodput,
        workload_fingerprint=workload_fingerprint,
        model_signature=earlier.model_signature,
        script=script_path,
        trials=trial_count,
        cuda=profile.cuda_runtime or "",
        global_batch=earlier.global_batch,
        script_digest=earlier.script_digest,
        # The speed-up's interval and basis, as the tune measured them (they go with its figure).
        speedup_low=earlier.speedup_low,
        speedup_high=earlier.speedup_high,
        speedup_basis=earlier.speedup_basis,
        speedup_threads=earlier.speedup_threads,
        args=earlier.args,
    )


@dataclass(frozen=True)
class TunedAnswer:
    """A tune's answer for this script: the policy, where it came from, and the script's
    arguments it was tuned with.

    Attributes:
        policy: the tuned policy, with its ``[tuned_on]`` record.
        label: where it came from, for log lines (``"cache entry #7 (tuned 2025-03-01)"``,
            ``"config file /path/train.mpadvise.toml"``).
        args: the script's command-line arguments at tuning time, where the tune recorded
            them (``record_tune(args=...)``); ``None`` when unknown. The workload fingerprint
            covers them too, but checking it needs the model and optimizer, which
            ``mpadvise run`` does not have before a framework builds them.
    """

    policy: Policy
    label: str
    args: tuple[str, ...] | None = None


def cached_answers(profile: HardwareProfile, script: str | os.PathLike[str] | None) -> list[TunedAnswer]:
    """Every cached answer for this hardware and script, newest first, for ``load_policy()``.

    The entries with this hardware fingerprint whose script is this very file (by its resolved
    path). A script of the same name elsewhere is another workload, and misses: its code, data
    and arguments may differ. One script may have several entries, one per workload it was
    tuned on; ``AppliedPolicy`` applies the one whose workload is this run's.

    An entry that cannot be read, or whose mode no longer runs here, is skipped with one
    warning. A cache that does not exist yet is not created and costs no warning; one that
    cannot be used (damaged beyond repair, locked, unreadable directory) costs one warning.

    Args:
        profile: the hardware this run trains on.
        script: the running script's path, or ``None`` (notebook, REPL: nothing to match).

    Returns:
        The answers, labelled ``"cache entry #ID (tuned DATE)"``; empty on a miss or any cache
        trouble.
    """
    if script is None:
        return []
    from advisor.cache._store import open_store

    path = database_path()
    if nothing_cached_yet(path):
        # Opening would create the directory and the database file for a lookup that cannot
        # hit; a plain training run should leave no files behind.
        return []
    store = open_store(path)
    if store is None:
        return []
    script_path = str(Path(script).resolve())
    try:
        with store:
            # Given a full path, the store matches the stored path exactly.
            rows = store.find_recommendations(hardware_fp=hardware_fingerprint(profile), script=script_path)
    except (MpadviseError, OSError, ValueError) as exc:
        # ValueError: a row whose JSON was damaged by hand. A cache must never stop training.
        get_logger().warning(f"cache lookup in {path} failed: {exc}; continuing without the cache")
        return []
    answers = []
    for row in rows:
        answer = _answer(row, profile, path)
        if answer is not None:
            answers.append(answer)
    return answers


def _answer(row: dict[str, Any], profile: HardwareProfile, path: Path) -> TunedAnswer | None:
    """The answer a cache row holds, or ``None`` (with a warning) when it cannot apply here."""
    try:
        policy = policy_of(row)
    except PolicyError as exc:
        get_logger().warning(
            f"{entry_label(row)} in {path} cannot be read ({exc}); ignoring it; "
            "`mpadvise cache clear` removes it, `mpadvise tune` writes a new one"
        )
        return None
    support = supported_modes(profile, policy).get(policy.mode)
    if support is None or not support.supported:
        # Same hardware, but this mpadvise no longer runs the mode here (its support table
        # changed): skipping the entry beats failing the run on it.
        why = support.reason if support is not None else "unknown mode"
        get_logger().warning(
            f"not applying {entry_label(row)}: mode {policy.mode} cannot run on {profile.name} "
            f"({why}); run `mpadvise tune` again"
        )
        return None
    return TunedAnswer(policy, entry_label(row), recorded_args(row))


def recorded_args(row: dict[str, Any]) -> tuple[str, ...] | None:
    """The script's arguments a cache row was tuned with, when the tune recorded them.

    Args:
        row: a recommendation record from the store.

    Returns:
        The arguments, or ``None`` for a row that does not say (an older tune).
    """
    args = (row.get("summary") or {}).get("args")
    if isinstance(args, list) and all(isinstance(arg, str) for arg in args):
        return tuple(args)
    return None


def lookup(profile: HardwareProfile, script: str | os.PathLike[str] | None) -> tuple[Policy, str] | None:
    """The newest cached policy for this hardware and script (see :func:`cached_answers`).

    Args:
        profile: the hardware this run trains on.
        script: the running script's path, or ``None`` (notebook, REPL: nothing to match).

    Returns:
        ``(policy, "cache entry #ID (tuned DATE)")``, or ``None`` on a miss or any cache
        trouble.
    """
    answers = cached_answers(profile, script)
    return (answers[0].policy, answers[0].label) if answers else None


def policy_of(row: dict[str, Any]) -> Policy:
    """The Policy stored in a cache row.

    Args:
        row: a recommendation record from the store.

    Returns:
        The validated Policy, with its ``tuned_on`` record.

    Raises:
        PolicyError: the stored policy is not valid for this version of mpadvise.
    """
    return Policy.from_dict(row["policy"], source=f"cache entry #{row['id']}")


def entry_label(row: dict[str, Any]) -> str:
    """``"cache entry #7 (tuned 2025-03-01)"``: how logs and commands name a cache row."""
    return f"cache entry #{row['id']} (tuned {str(row['created_at'])[:10]})"


@dataclass(frozen=True)
class EntryStatus:
    """Why a cache entry would not be applied on some hardware: data, formatted where shown.

    Attributes:
        kind: ``"unreadable"`` (its policy does not validate), ``"other_hardware"`` (tuned
            elsewhere; ``mismatch`` says what differs), ``"other_fingerprint"`` (a policy without
            a ``[tuned_on]`` fingerprint, stored under another hardware key) or
            ``"unsupported"`` (its mode cannot run here).
        mismatch: the named differences, for ``"other_hardware"``.
        detail: the validation error, the other fingerprint, or the sentence saying which mode
            cannot run here and why.
    """

    kind: str
    mismatch: HardwareMismatch | None = None
    detail: str = ""

    def describe(self) -> str:
        """One line for people: ``"tuned on other hardware or versions (torch a -> b)"``."""
        if self.mismatch is not None:
            return self.mismatch.describe()
        if self.kind == "unreadable":
            return f"unreadable policy ({self.detail})"
        if self.kind == "other_fingerprint":
            return f"tuned on other hardware (fingerprint {self.detail})"
        return self.detail

    def what_differs(self) -> str:
        """Only what changed (``"torch a -> b"``) where that is known, else ``describe()``."""
        return self.mismatch.detail() if self.mismatch is not None else self.describe()


def entry_status(row: dict[str, Any], profile: HardwareProfile) -> EntryStatus | None:
    """Why a cache entry would not be applied on ``profile``, or ``None`` when it would be.

    Args:
        row: a recommendation record from the store.
        profile: the hardware to judge it for.

    Returns:
        ``None`` when the entry is valid here; otherwise what stands in the way.
    """
    try:
        policy = policy_of(row)
    except PolicyError as exc:
        return EntryStatus("unreadable", detail=str(exc))
    mismatch = hardware_mismatch(policy, profile)
    if mismatch is not None:
        return EntryStatus("other_hardware", mismatch=mismatch)
    if row["hardware_fp"] != hardware_fingerprint(profile):
        # A policy stored without a [tuned_on] fingerprint: the row's key still says where it
        # was measured.
        return EntryStatus("other_fingerprint", detail=row["hardware_fp"])
    support = supported_modes(profile, policy).get(policy.mode)
    if support is not None and not support.supported:
        return EntryStatus("unsupported", detail=f"mode {policy.mode} cannot run here ({support.reason})")
    return None


def stale_entries(
    profile: HardwareProfile,
    script: str | os.PathLike[str] | None,
    *,
    store: Store | None = None,
) -> list[tuple[dict[str, Any], str]]:
    """Cache entries for ``script`` that were tuned on other hardware or versions, with why.

    Other versions include an FP8 library that changed since an FP8 answer was tuned.

    Args:
        profile: the hardware this machine has.
        script: a script path or base name; ``None`` for every script.
        store: an open store; default: the user's cache, opened for this call.

    Returns:
        ``[(row, reason), ...]``, newest first; empty when there is no cache.
    """
    owned = store is None
    if store is None:
        from advisor.cache._store import open_store

        store = open_store()
        if store is None:
            return []
    try:
        fingerprint = hardware_fingerprint(profile)
        name = None if script is None else os.path.basename(os.fspath(script))
        rows = store.find_recommendations(script=name)
    finally:
        if owned:
            store.close()
    stale = []
    for row in rows:
        status = entry_status(row, profile)
        if row["hardware_fp"] == fingerprint and (status is None or status.kind != "other_hardware"):
            # This hardware's own entry; an FP8 answer whose library changed since is stale.
            continue
        stale.append((row, status.describe() if status is not None else "tuned on other hardware"))
    return stale
