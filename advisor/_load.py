"""load_policy(): find the policy for this script and hardware, and apply it."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import probes
from advisor import _paths
from advisor._log import get_logger
from advisor.cache._recommend import lookup
from advisor.runtime._applied import AppliedPolicy
from advisor.tune._child import applied_for_trial, spec_from_env
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

POLICY_ENV = "MPADVISE_POLICY"
"""Environment variable naming a config file to use."""


@dataclass(frozen=True)
class Resolution:
    """Which policy applies, and why (the one line ``load_policy`` logs)."""

    policy: Policy
    source: str
    mismatch: HardwareMismatch | None = None
    from_cache: bool = False
    """Whether ``policy`` is a cached answer."""
    match_workload: bool = False
    """Whether ``policy`` is a tune's answer (a cached one, or the config file a tune wrote beside
    the script), which applies only to the whole workload it was tuned on."""

    @property
    def fallback_reason(self) -> str | None:
        """Why a tuned policy was not applied (``"it was tuned on ..."``), for people."""
        return None if self.mismatch is None else self.mismatch.reason()


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

    The workload is not known yet, so a tune's answer is marked ``match_workload`` and
    ``AppliedPolicy.setup()`` applies it only to the whole workload it was tuned on (model,
    optimizer and its settings, global batch, script content and arguments): a cached answer,
    and the config file beside the script when it carries a workload fingerprint, which
    ``mpadvise tune`` always writes there. A config file beside the script without one was
    written by a person and is applied as written. A config file the user names (``source`` or
    ``MPADVISE_POLICY``) is checked against the model's structure only: naming it is the
    user's decision to apply it to this run, such as a policy tuned on a short run of the same
    model applied to the long run with other arguments.
    """
    candidate: tuple[Policy, str] | None = None
    from_cache = match_workload = False
    if source is not None:
        if isinstance(source, Policy):
            return Resolution(_check_supported(source, profile, "the Policy passed to load_policy"), "the Policy passed to load_policy()")
        if isinstance(source, (str, os.PathLike)):
            candidate = (load_config(source), f"config file {source}")
        else:
            raise MpadviseError(
                f"load_policy(source): expected a config file path or an advisor.Policy, got {type(source).__name__}"
            )
    elif environ.get(POLICY_ENV):
        path = environ[POLICY_ENV]
        candidate = (load_config(path), f"{POLICY_ENV}={path}")
    elif script is not None and _paths.config_path_for(script).is_file():
        path = _paths.config_path_for(script)
        candidate = (load_config(path), f"config file {path}")
        match_workload = written_by_a_tune(candidate[0])
    elif cached is not None:
        candidate = cached(profile, script)
        from_cache = match_workload = candidate is not None
    if candidate is None:
        return Resolution(safe_default(profile), f"safe default for {profile.name}")
    policy, label = candidate
    mismatch = hardware_mismatch(policy, profile)
    if mismatch is None:
        return Resolution(
            _check_supported(policy, profile, label), label, from_cache=from_cache, match_workload=match_workload
        )
    default = safe_default(profile)
    get_logger().warning(
        f"not applying the policy from {label}: {mismatch.reason()}; using the safe default "
        f"{default.mode} for {profile.name}; run `mpadvise tune` again on this machine"
    )
    return Resolution(default, f"safe default for {profile.name}", mismatch=mismatch)


def written_by_a_tune(policy: Policy) -> bool:
    """Whether ``policy`` is a tune's answer: its ``[tuned_on]`` names the workload it was measured on."""
    return policy.tuned_on is not None and bool(policy.tuned_on.workload_fingerprint)


def _check_supported(policy: Policy, profile: HardwareProfile, label: str) -> Policy:
    # Judged for the policy itself, so that an FP8 recipe this device lacks is refused here.
    support = supported_modes(profile, policy)
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

    spec = spec_from_env()
    if spec is not None:
        # Under `mpadvise tune`/`trial` the injected candidate wins over everything else.
        profile = probes.profile_for(spec.device or device)
        applied = applied_for_trial(spec, profile=profile, device=spec.device or device)
        get_logger().info(f"trial {spec.label or applied.policy.describe()} on {applied.device}")
        return applied
    profile = probes.profile_for(device)
    resolution = resolve_policy(source, profile=profile, script=_paths.current_script(), cached=lookup)
    applied = AppliedPolicy(
        resolution.policy, profile=profile, source=resolution.source, device=device, match_workload=resolution.match_workload
    )
    get_logger().info(f"policy {resolution.policy.describe()} on {applied.device} (from {resolution.source})")
    return applied
