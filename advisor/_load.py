"""load_policy(): find the policy for this script and hardware, and apply it."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from policies import Policy, load_config, safe_default_mode, supported_modes
from probes import MpadviseError, hardware_fingerprint

from ._log import get_logger
from ._runtime import AppliedPolicy

if TYPE_CHECKING:
    from probes import HardwareProfile

POLICY_ENV = "MPADVISE_POLICY"
"""Environment variable naming a config file to use."""
CONFIG_SUFFIX = ".mpadvise.toml"


@dataclass(frozen=True)
class Resolution:
    """Which policy applies, and why (the one line ``load_policy`` logs)."""

    policy: Policy
    source: str
    fallback_reason: str | None = None


def config_path_for(script: str | os.PathLike[str]) -> Path:
    """``train.py`` -> ``train.mpadvise.toml`` beside it."""
    script = Path(script)
    return script.with_name(script.stem + CONFIG_SUFFIX)


def current_script() -> Path | None:
    """The script this process runs (``__main__.__file__``), or ``None`` in a REPL/notebook."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None) or (sys.argv[0] if sys.argv and sys.argv[0] else None)
    if not path or path == "-c":
        return None
    return Path(path).resolve()


def foreign_reason(policy: Policy, profile: HardwareProfile) -> str | None:
    """Why a tuned policy must not be applied on this hardware, or ``None`` when it may be.

    A policy without a ``[tuned_on]`` record was written by hand and applies anywhere it is
    supported.
    """
    tuned = policy.tuned_on
    if tuned is None or not tuned.hardware_fingerprint:
        return None
    if tuned.hardware_fingerprint == hardware_fingerprint(profile):
        return None
    differences = []
    if tuned.device and tuned.device != profile.name:
        differences.append(f"device {tuned.device} -> {profile.name}")
    if tuned.torch and tuned.torch != profile.torch_version:
        differences.append(f"torch {tuned.torch} -> {profile.torch_version}")
    now_libs = dict(profile.libraries)
    for name, version in tuned.libraries:
        if now_libs.get(name) != version:
            differences.append(f"{name} {version or 'absent'} -> {now_libs.get(name) or 'absent'}")
    detail = "; ".join(differences) or "driver, CUDA or hardware details differ"
    return f"it was tuned on other hardware or versions ({detail})"


def resolve_policy(
    source: Policy | str | os.PathLike[str] | None,
    *,
    profile: HardwareProfile,
    script: Path | None,
    environ: dict[str, str] | os._Environ[str] = os.environ,
    cached: Any = None,
) -> Resolution:
    """Decide which policy applies, in the documented order.

    Order: an explicit ``source``; ``MPADVISE_POLICY``; ``<script>.mpadvise.toml`` beside the
    script; ``cached`` (a callable ``(profile, script) -> (Policy, label) | None``); the
    hardware's safe default. A tuned policy from other hardware or versions falls back to the
    safe default with a warning.
    """
    candidates: list[tuple[Policy, str]] = []
    if source is not None:
        if isinstance(source, Policy):
            return Resolution(_check_supported(source, profile, "the Policy passed to load_policy"), "the Policy passed to load_policy()")
        if isinstance(source, (str, os.PathLike)):
            candidates.append((load_config(source), f"config file {source}"))
        else:
            raise MpadviseError(
                f"load_policy(source): expected a config file path or an advisor.Policy, got {type(source).__name__}"
            )
    elif environ.get(POLICY_ENV):
        path = environ[POLICY_ENV]
        candidates.append((load_config(path), f"{POLICY_ENV}={path}"))
    elif script is not None and config_path_for(script).is_file():
        path = config_path_for(script)
        candidates.append((load_config(path), f"config file {path}"))
    elif cached is not None:
        hit = cached(profile, script)
        if hit is not None:
            candidates.append(hit)
    for policy, label in candidates:
        reason = foreign_reason(policy, profile)
        if reason is None:
            return Resolution(_check_supported(policy, profile, label), label)
        default = safe_default(profile)
        get_logger().warning(
            f"not applying the policy from {label}: {reason}; using the safe default "
            f"{default.mode} for {profile.name}; run `mpadvise tune` again on this machine"
        )
        return Resolution(default, f"safe default for {profile.name}", fallback_reason=reason)
    return Resolution(safe_default(profile), f"safe default for {profile.name}")


def safe_default(profile: HardwareProfile) -> Policy:
    """The policy used when nothing was tuned for this hardware."""
    mode, _why = safe_default_mode(profile)
    return Policy(mode=mode)


def _check_supported(policy: Policy, profile: HardwareProfile, label: str) -> Policy:
    support = supported_modes(profile)
    info = support[policy.mode]
    if not info.supported:
        available = ", ".join(m for m, s in support.items() if s.supported)
        raise MpadviseError(
            f"mode {policy.mode!r} from {label} cannot run on {profile.name}: {info.reason}; "
            f"available here: {available}"
        )
    return policy


def load_policy(
    source: Policy | str | os.PathLike[str] | None = None,
    *,
    device: str | None = None,
) -> AppliedPolicy:
    """The precision policy for this script on this hardware, ready to apply.

    Args:
        source: ``None`` to resolve it (a trial spec from ``mpadvise tune``, then
            ``MPADVISE_POLICY``, then ``<script>.mpadvise.toml``, then the cache, then the
            hardware's safe default); a config file path; or an ``advisor.Policy``.
        device: ``"cpu"`` or ``"cuda:N"`` to override the device; default: the first CUDA
            device if there is one, else the CPU.

    Returns:
        An ``AppliedPolicy``: ``setup``, ``autocast``, ``step``, ``to_device``,
        ``micro_batch_size``, ``state_dict``/``load_state_dict``; also a context manager.
    """
    from ._trial_child import applied_for_trial, spec_from_env

    spec = spec_from_env()
    if spec is not None:
        # Under `mpadvise tune`/`trial` the injected candidate wins over everything else.
        profile = _profile_for(spec.device or device)
        applied = applied_for_trial(spec, profile=profile, device=spec.device or device)
        get_logger().info(f"trial {spec.label or applied.policy.describe()} on {applied.device}")
        return applied
    profile = _profile_for(device)
    resolution = resolve_policy(source, profile=profile, script=current_script(), cached=_cached)
    applied = AppliedPolicy(resolution.policy, profile=profile, source=resolution.source, device=device)
    get_logger().info(f"policy {resolution.policy.describe()} on {applied.device} (from {resolution.source})")
    return applied


def _cached(profile: HardwareProfile, script: Path | None) -> tuple[Policy, str] | None:
    """The cache entry for this hardware and script; imported only when no earlier source applies."""
    from ._recommend import lookup

    return lookup(profile, script)


def _profile_for(device: str | None) -> HardwareProfile:
    import probes

    if device is None:
        return probes.primary_profile()
    if device == "cpu":
        return probes.cpu_profile()
    if device.startswith("cuda"):
        index = int(device.split(":", 1)[1]) if ":" in device else 0
        for profile in probes.cuda_profiles():
            if profile.index == index:
                return profile
        raise MpadviseError(f"device {device!r} is not available; CUDA devices here: {len(probes.cuda_profiles())}")
    raise MpadviseError(f"device {device!r} is not allowed; expected 'cpu', 'cuda' or 'cuda:N'")
