"""``mpadvise policy``: which policy ``load_policy()`` would apply for a script, and why."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import probes
from advisor._load import resolve_policy
from advisor.cache._recommend import lookup
from policies import hardware_mismatch, load_config, safe_default, supported_modes
from probes import MpadviseError, hardware_fingerprint


def explain_policy(target: Path | None, *, device: str | None) -> dict[str, Any]:
    """Resolve like ``load_policy()`` does for ``target`` (a script or a config file).

    A config file is validated and checked against this hardware; a script resolves through
    ``MPADVISE_POLICY``, the config file beside it, the cache and the safe default.

    Raises:
        MpadviseError: a missing or invalid config file, or a mode this hardware lacks.
    """
    profile = probes.profile_for(device)
    if target is not None and not target.exists():
        raise MpadviseError(f"{target} does not exist")
    if target is not None and target.suffix == ".toml":
        policy = load_config(target)
        mismatch = hardware_mismatch(policy, profile)
        support = supported_modes(profile, policy)[policy.mode]
        if mismatch is None and not support.supported:
            raise MpadviseError(f"mode {policy.mode!r} from {target} cannot run on {profile.name}: {support.reason}")
        applied = policy if mismatch is None else safe_default(profile)
        source = f"config file {target}"
    else:
        script = target.resolve() if target is not None else None
        resolution = resolve_policy(None, profile=profile, script=script, environ=os.environ, cached=lookup)
        applied, source, mismatch = resolution.policy, resolution.source, resolution.mismatch
    return {
        "hardware": {"name": profile.name, "fingerprint": hardware_fingerprint(profile)},
        "source": source,
        "policy": applied.to_dict(),
        "describe": applied.describe(),
        "not_applied_because": None if mismatch is None else mismatch.reason(),
        "differences": [] if mismatch is None else [d.to_dict() for d in mismatch.differences],
    }
