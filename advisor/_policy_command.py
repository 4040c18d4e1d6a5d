"""``mpadvise policy``: which policy ``load_policy()`` would apply for a script, and why."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from policies import load_config, supported_modes
from probes import MpadviseError, hardware_fingerprint


def explain_policy(target: Path | None, *, device: str | None) -> dict[str, Any]:
    """Resolve like ``load_policy()`` does for ``target`` (a script or a config file).

    A config file is validated and checked against this hardware; a script resolves through
    ``MPADVISE_POLICY``, the config file beside it, the cache and the safe default.

    Raises:
        MpadviseError: a missing or invalid config file, or a mode this hardware lacks.
    """
    from ._load import _profile_for, foreign_reason, resolve_policy, safe_default

    profile = _profile_for(device)
    if target is not None and not target.exists():
        raise MpadviseError(f"{target} does not exist")
    if target is not None and target.suffix == ".toml":
        policy = load_config(target)
        reason = foreign_reason(policy, profile)
        support = supported_modes(profile)[policy.mode]
        if reason is None and not support.supported:
            raise MpadviseError(f"mode {policy.mode!r} from {target} cannot run on {profile.name}: {support.reason}")
        applied = policy if reason is None else safe_default(profile)
        source = f"config file {target}"
        fallback = reason
    else:
        from ._recommend import lookup

        script = target.resolve() if target is not None else None
        resolution = resolve_policy(None, profile=profile, script=script, environ=os.environ, cached=lookup)
        applied, source, fallback = resolution.policy, resolution.source, resolution.fallback_reason
    return {
        "hardware": {"name": profile.name, "fingerprint": hardware_fingerprint(profile)},
        "source": source,
        "policy": applied.to_dict(),
        "describe": applied.describe(),
        "not_applied_because": fallback,
    }
