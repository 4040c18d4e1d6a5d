"""``mpadvise policy``: which policy ``load_policy()`` would apply for a script, and why."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import probes
from advisor._load import resolve_policy
from advisor.cache import lookup
from policies import load_config
from probes import MpadviseError, UsageError, hardware_fingerprint


def explain_policy(target: Path | None, *, device: str | None) -> dict[str, Any]:
    """Resolve as ``load_policy()`` does for ``target``: a config file as ``load_policy(path)``
    takes it, a script through ``MPADVISE_POLICY``, the config beside it, the cache, the default."""
    profile = probes.profile_for(device)
    if target is not None and not target.exists():
        raise UsageError(f"{target} does not exist")
    if target is not None and target.suffix == ".toml":
        try:
            load_config(target)  # a file that does not load is a bad argument, as to export and run
        except MpadviseError as exc:
            raise UsageError(str(exc)) from None
        resolution = resolve_policy(target, profile=profile, script=None, environ=os.environ)
    else:
        script = target.resolve() if target is not None else None
        resolution = resolve_policy(None, profile=profile, script=script, environ=os.environ, cached=lookup)
    mismatch = resolution.mismatch
    return {
        "hardware": {"name": profile.name, "fingerprint": hardware_fingerprint(profile)},
        "source": resolution.source,
        "kind": resolution.kind.value,
        "policy": resolution.policy.to_dict(),
        "describe": resolution.policy.describe(),
        "not_applied_because": None if mismatch is None else mismatch.reason(),
        "differences": [] if mismatch is None else [d.to_dict() for d in mismatch.differences],
    }
