"""A short, stable digest of the hardware facts that change which precision policy wins."""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from probes._profile import HardwareProfile

__all__ = ["FINGERPRINT_VERSION", "fingerprint_fields", "hardware_fingerprint"]

# Bumped when the recipe below changes, so that old cache keys miss instead of colliding.
FINGERPRINT_VERSION = 1

_GIB = 1024**3


def fingerprint_fields(profile: HardwareProfile) -> dict[str, Any]:
    """The profile fields that key cached results, in canonical form.

    Included: what changes the answer (device kind and name, compute capability, memory
    rounded to GiB so two cards of one SKU match, SM count, driver, CUDA runtime, torch and
    FP8 library versions, and for a CPU its ISA flags and usable cores). Excluded: what
    differs between identical cards or from moment to moment (UUID, index, free memory,
    clocks).
    """
    memory_gib = None if profile.memory_total is None else round(profile.memory_total / _GIB)
    fields: dict[str, Any] = {
        "v": FINGERPRINT_VERSION,
        "kind": profile.kind,
        "name": profile.name,
        "compute_capability": (
            None if profile.compute_capability is None else list(profile.compute_capability)
        ),
        "memory_gib": memory_gib,
        "sm_count": profile.sm_count,
        "driver_version": profile.driver_version,
        "cuda_runtime": profile.cuda_runtime,
        "torch_version": profile.torch_version,
        "libraries": {name: version for name, version in sorted(profile.libraries)},
    }
    if profile.kind == "cpu":
        fields["cpu_flags"] = sorted(profile.cpu_flags)
        fields["cores"] = profile.cores
    return fields


def hardware_fingerprint(profile: HardwareProfile) -> str:
    """First 16 hex digits of the SHA-256 of the canonical JSON of ``fingerprint_fields``.

    Args:
        profile: any hardware profile.

    Returns:
        A 16-character lowercase hex string, stable across processes, machines and Python
        versions (canonical JSON: sorted keys, no whitespace).
    """
    canonical = json.dumps(
        fingerprint_fields(profile), sort_keys=True, separators=(",", ":"), ensure_ascii=True
    )
    return hashlib.sha256(canonical.encode("ascii")).hexdigest()[:16]
