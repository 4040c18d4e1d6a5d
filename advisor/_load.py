"""load_policy(): find the policy for this script and hardware, and apply it."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING

import probes
from advisor import _paths
from advisor._log import get_logger
from advisor.cache import TunedAnswer, cached_answers, guard_events_for, record_guard_event
from advisor.runtime import (
    AppliedPolicy,
    Guard,
    GuardLimits,
    fallback_words,
    guard_fallback,
    guard_setting,
    safe_fallback,
)
from advisor.trial import applied_for_trial, spec_from_env
from advisor.tune import StabilityThresholds
from policies import (
    HardwareMismatch,
    Policy,
    hardware_mismatch,
    load_config,
    safe_default,
    supported_modes,
)
from probes import MpadviseError

if TYPE_CHECKING:
    from probes import HardwareProfile

    Found = tuple[Policy, str] | Sequence[TunedAnswer] | None
    Cached = Callable[[HardwareProfile, Path | None], Found]

POLICY_ENV = "MPADVISE_POLICY"  # names a config file to use

# The AppliedPolicy of each tuned policy load_policy() resolved, for a second call (load_policy).
_CHECKED_POLICIES: dict[tuple[object, ...], AppliedPolicy] = {}


class PolicySource(Enum):
    """Where a resolved policy comes from, in ``load_policy()``'s order."""

    EXPLICIT = "explicit"  # a config file or Policy the caller named (load_policy(), --config)
    ENV = "env"  # the config file MPADVISE_POLICY names
    BESIDE_SCRIPT = "beside-script"  # <script>.mpadvise.toml
    CACHE = "cache"  # the cache entry for this hardware and script
    SAFE_DEFAULT = "safe-default"  # the safe default, or safe_fallback from a tuned policy


@dataclass(frozen=True)
class Resolution:
    """Which policy applies, where it comes from (``kind``), and why in words (``source``, the
    text of the one line ``load_policy`` logs). ``match_workload``: a tune's answer, for its own
    workload only, else ``alternatives`` in order; ``args`` and ``reference``: the script's
    arguments and fp32's loss per optimizer step in its tune, where recorded."""

    policy: Policy
    source: str
    kind: PolicySource
    mismatch: HardwareMismatch | None = None
    match_workload: bool = False
    alternatives: tuple[TunedAnswer, ...] = ()
    args: tuple[str, ...] | None = None
    reference: tuple[float, ...] = ()


def resolve_policy(source: Policy | str | os.PathLike[str] | None, *, profile: HardwareProfile,
                   script: Path | None, environ: Mapping[str, str] = os.environ,
                   cached: Cached | None = None) -> Resolution:
    """Decide which policy applies: an explicit ``source``; ``MPADVISE_POLICY``; the config file
    beside the script; ``cached(profile, script)`` (the cached answers newest first, one
    ``(Policy, label)``, or ``None``); the safe default. A policy tuned on other hardware or
    versions gives way to ``safe_fallback``, with a warning.

    A tune's answer (cached, or a config file beside the script with a workload fingerprint,
    as ``mpadvise tune`` writes it) is marked ``match_workload``, the script's other answers kept
    for ``setup()``, since the workload is not known yet. A config file the user names is checked
    against the model's structure only: naming it is the decision to apply it to this run."""
    candidate: tuple[Policy, str, PolicySource] | None = None
    if source is not None:
        if isinstance(source, Policy):
            return Resolution(_check_supported(source, profile, "the Policy passed to load_policy"),
                              "the Policy passed to load_policy()", PolicySource.EXPLICIT)
        if not isinstance(source, (str, os.PathLike)):
            raise MpadviseError(
                f"load_policy(source): expected a config file path or an advisor.Policy, got {type(source).__name__}"
            )
        candidate = (load_config(source), f"config file {source}", PolicySource.EXPLICIT)
    elif environ.get(POLICY_ENV):
        path = environ[POLICY_ENV]
        candidate = (load_config(path), f"{POLICY_ENV}={path}", PolicySource.ENV)
    elif script is not None and _paths.config_path_for(script).is_file():
        path = _paths.config_path_for(script)
        policy = load_config(path)
        workload = _workload_of(policy)
        if not workload:  # written by a person, applied as written
            candidate = (policy, f"config file {path}", PolicySource.BESIDE_SCRIPT)
        else:
            # The cache holds this tune's answer too (with fp32's curve, and the arguments it ran
            # with, which older files do not record), and those of the script's other workloads.
            found = _answers(cached, profile, script)
            same = [a for a in found if _workload_of(a.policy) == workload] or [TunedAnswer(policy, "")]
            args = policy.tuned_on.args  # type: ignore[union-attr]
            config = TunedAnswer(policy, f"config file {path}", same[0].args if args is None else args,
                                 same[0].reference)
            others = [a for a in found if _workload_of(a.policy) != workload]
            return _tuned_resolution([config, *others], profile, config=config)
    else:
        answers = _answers(cached, profile, script)
        if answers:
            return _tuned_resolution(answers, profile, config=None)
    if candidate is None:
        return Resolution(safe_default(profile), f"safe default for {profile.name}", PolicySource.SAFE_DEFAULT)
    policy, label, kind = candidate
    mismatch = hardware_mismatch(policy, profile)
    if mismatch is None:
        return Resolution(_check_supported(policy, profile, label), label, kind)
    return _other_hardware(policy, label, mismatch, profile)


def _answers(cached: Cached | None, profile: HardwareProfile,
             script: Path | None) -> list[TunedAnswer]:
    """What ``cached`` found, as answers."""
    found = None if cached is None else cached(profile, script)
    if found is None:
        return []
    if isinstance(found, tuple) and len(found) == 2 and isinstance(found[0], Policy):
        return [TunedAnswer(found[0], found[1])]
    return list(found)  # type: ignore[arg-type]


def _tuned_resolution(answers: list[TunedAnswer], profile: HardwareProfile, *, config: TunedAnswer | None) -> Resolution:
    """The first of the tunes' answers that may apply on this hardware, the others kept for
    ``setup()``; ``config`` is the config file's among them, if any."""
    first = answers[0]
    mismatch = hardware_mismatch(first.policy, profile)
    here = [answer for answer in answers if hardware_mismatch(answer.policy, profile) is None]
    if mismatch is not None:
        if not here:
            return _other_hardware(first.policy, first.label, mismatch, profile)
        get_logger().warning(
            f"not applying the policy from {first.label}: {mismatch.reason()}; run `mpadvise tune` again on this machine"
        )
    chosen, *rest = here
    return Resolution(
        _check_supported(chosen.policy, profile, chosen.label), chosen.label,
        PolicySource.BESIDE_SCRIPT if chosen is config else PolicySource.CACHE, match_workload=True,
        alternatives=tuple(rest), args=chosen.args, reference=chosen.reference,
    )


def _other_hardware(policy: Policy, label: str, mismatch: HardwareMismatch, profile: HardwareProfile) -> Resolution:
    """``safe_fallback`` in place of a policy tuned on other hardware or versions, with a warning."""
    fallback = safe_fallback(policy, profile)
    using, source = fallback_words(fallback, profile)
    get_logger().warning(
        f"not applying the policy from {label}: {mismatch.reason()}; {using} for {profile.name}; "
        "run `mpadvise tune` again on this machine"
    )
    return Resolution(fallback, source, PolicySource.SAFE_DEFAULT, mismatch=mismatch)


def _workload_of(policy: Policy) -> str | None:
    return None if policy.tuned_on is None else policy.tuned_on.workload_fingerprint


def _check_supported(policy: Policy, profile: HardwareProfile, label: str) -> Policy:
    # Judged for the policy itself, so that an FP8 recipe this device lacks is refused here.
    support = supported_modes(profile, policy)
    info = support[policy.mode]
    if not info.supported:
        available = ", ".join(m for m, s in support.items() if s.supported)
        raise MpadviseError(f"mode {policy.mode!r} from {label} cannot run on {profile.name}: "
                            f"{info.reason}; available here: {available}")
    return policy


def load_policy(source: Policy | str | os.PathLike[str] | None = None, *, device: str | None = None,
                guard: str | None = None) -> AppliedPolicy:
    """The precision policy for this script on this hardware, ready to apply.

    Args:
        source: ``None`` to resolve it in the documented order; a config file path; or an
            ``advisor.Policy``.
        device: ``"cpu"`` or ``"cuda:N"`` to override the device; default: the first CUDA
            device if there is one, else the CPU.
        guard: ``"warn"``, ``"fallback"`` or ``"off"``: what the guard does when a long run
            turns unstable; default ``MPADVISE_GUARD``, else ``"off"``. Its events are cached,
            and the next ``load_policy()`` without ``source`` applies the policy fallen back to.

    Returns:
        An ``AppliedPolicy``, also a context manager. A later call that resolves the same tuned
        policy returns the same object, which ``setup()``'s workload check applies to: a second
        one would apply what the check turned down, with a loss scaler of its own.
    """
    spec = spec_from_env()
    if spec is not None:
        # Under `mpadvise tune`/`trial` the injected candidate wins over everything else.
        profile = probes.profile_for(spec.device or device)
        applied = applied_for_trial(spec, profile=profile, device=spec.device or device)
        get_logger().info(f"trial {spec.label or applied.policy.describe()} on {applied.device}")
        return applied
    setting = guard_setting(guard)
    profile = probes.profile_for(device)
    script = _paths.current_script()
    resolution = resolve_policy(source, profile=profile, script=script, cached=cached_answers)
    if source is None and resolution.kind is not PolicySource.ENV:
        resolution = after_guard_events(resolution, guard_events_for(profile, script))
    alternatives = [(answer.policy, answer.label) for answer in resolution.alternatives]
    shared = None
    if not isinstance(source, Policy) and resolution.policy.tuned_on is not None:
        shared = (resolution.source, resolution.policy, tuple(alternatives), device, script, tuple(sys.argv))
        earlier = _CHECKED_POLICIES.get(shared)
        if earlier is not None:
            get_logger().info(
                f"policy {earlier.policy.describe()} on {earlier.device} (from {earlier.source}; the object an "
                "earlier load_policy() returned, which the workload check applies to)"
            )
            return earlier
    applied = AppliedPolicy(
        resolution.policy, profile=profile, source=resolution.source, device=device,
        match_workload=resolution.match_workload, alternatives=alternatives,
        guard=Guard(setting, GuardLimits.from_thresholds(StabilityThresholds()), reference=resolution.reference,
                    trend=guard_fallback(resolution.policy, profile) is not None),
    )
    applied.on_guard_event = lambda event: record_guard_event(
        event.to_dict(), profile=profile, workload_fp=applied.workload_fingerprint, script=script)
    if shared is not None:
        _CHECKED_POLICIES[shared] = applied
    get_logger().info(f"policy {resolution.policy.describe()} on {applied.device} (from {resolution.source})")
    return applied


def after_guard_events(resolution: Resolution, events: Sequence[dict[str, object]]) -> Resolution:
    """``resolution``, or, where a long run under its mode fell back (or was told to), the mode
    fallen back to as a safe-default choice naming the event; followed as a chain (fp16-mixed
    to bf16-mixed, later to fp32). ``events``: the guard's cache rows, newest first."""
    policy, reasons = resolution.policy, []
    for _ in range(len(events)):
        event = next((e for e in events if e.get("policy") == policy.mode and e.get("fallback")), None)
        if event is None:
            break
        reasons.append(f"the guard saw {event['signal']} under {policy.mode} at optimizer step {event['step']} "
                       f"on {str(event['created_at'])[:10]}")
        policy = Policy(mode=str(event["fallback"]))
    if not reasons:
        return resolution
    get_logger().warning(
        f"applying {policy.mode} rather than {resolution.policy.describe()} from {resolution.source}: "
        f"{'; then '.join(reasons)}; `mpadvise tune` again judges the modes afresh"
    )
    return Resolution(policy, f"{policy.mode}, the guard's fallback ({reasons[-1]})", PolicySource.SAFE_DEFAULT,
                      reference=resolution.reference)  # fp32's curve is any mode's yardstick
