"""A short, stable digest of the hardware facts that change which precision policy wins.

Recipe 2 (the current one) keys on what decides the answer:

* the device model: kind, name, memory size to the GiB (a 40 GB and an 80 GB A100 fit
  different micro-batches) and SM count (a MIG slice is not the whole GPU);
* its compute capability, which decides the tensor-core dtypes;
* the major.minor versions of CUDA and torch: a new release line brings other kernels,
  autocast op lists and defaults, so speed and numerics may change;
* for a CPU, its precision ISA flags and usable cores.

It leaves out what a routine upgrade changes without changing the answer: the NVIDIA driver
(torch wheels bring their own CUDA libraries; the driver only has to be new enough), torch and
CUDA patch releases (bug fixes), and the FP8 library versions. Those libraries matter only to
an FP8 answer, so ``policies.hardware_mismatch`` compares them for FP8 policies alone, from
the policy's ``[tuned_on]`` record.

Recipe 1 also covered the driver, the full torch and CUDA versions and every FP8 library
version, so any of those upgrades threw away every cached answer. It is kept so that a policy
recorded under it can still be recognised, and a cache keyed by it migrated.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from probes._profile import HardwareProfile

__all__ = ["FINGERPRINT_VERSION", "fingerprint_fields", "hardware_fingerprint", "major_minor"]

# Bumped when the recipe below changes, so that old cache keys miss instead of colliding.
FINGERPRINT_VERSION = 2

_GIB = 1024**3
_MAJOR_MINOR = re.compile(r"(\d+)\.(\d+)")


def major_minor(version: str | None) -> str | None:
    """``"2.5.1+cu124"`` -> ``"2.5"``, ``"2.6.0a0+git1"`` -> ``"2.6"``: the release line of a version.

    Args:
        version: a version string, or ``None``.

    Returns:
        The leading ``major.minor`` numbers; the text unchanged when it does not start with
        them; ``None`` for ``None``.
    """
    if version is None:
        return None
    match = _MAJOR_MINOR.match(version)
    return f"{match[1]}.{match[2]}" if match else version


def fingerprint_fields(profile: HardwareProfile, *, version: int = FINGERPRINT_VERSION) -> dict[str, Any]:
    """The profile fields that key cached results, in canonical form.

    Args:
        profile: any hardware profile.
        version: the recipe; the current one unless a stored key of an older one is checked.

    Returns:
        A JSON-ready dict. Identifiers of one card and momentary facts (UUID, index, free
        memory, clocks) are never included: two cards of one SKU give one answer.

    Raises:
        ValueError: ``version`` is not a recipe this code knows.
    """
    memory_gib = None if profile.memory_total is None else round(profile.memory_total / _GIB)
    capability = None if profile.compute_capability is None else list(profile.compute_capability)
    if version == 1:
        fields: dict[str, Any] = {
            "v": 1,
            "kind": profile.kind,
            "name": profile.name,
            "compute_capability": capability,
            "memory_gib": memory_gib,
            "sm_count": profile.sm_count,
            "driver_version": profile.driver_version,
            "cuda_runtime": profile.cuda_runtime,
            "torch_version": profile.torch_version,
            "libraries": {name: value for name, value in sorted(profile.libraries)},
        }
    elif version == 2:
        fields = {
            "v": 2,
            "kind": profile.kind,
            "name": profile.name,
            "compute_capability": capability,
            "memory_gib": memory_gib,
            "sm_count": profile.sm_count,
            "cuda": major_minor(profile.cuda_runtime),
            "torch": major_minor(profile.torch_version),
        }
    else:
        raise ValueError(f"hardware fingerprint recipe {version!r} is unknown; expected 1 or {FINGERPRINT_VERSION}")
    if profile.kind == "cpu":
        fields["cpu_flags"] = sorted(profile.cpu_flags)
        fields["cores"] = profile.cores
    return fields


def hardware_fingerprint(profile: HardwareProfile, *, version: int = FINGERPRINT_VERSION) -> str:
    """First 16 hex digits of the SHA-256 of the canonical JSON of ``fingerprint_fields``.

    Args:
        profile: any hardware profile.
        version: the recipe (see :func:`fingerprint_fields`).

    Returns:
        A 16-character lowercase hex string, stable across processes, machines and Python
        versions (canonical JSON: sorted keys, no whitespace).
    """
    canonical = json.dumps(
        fingerprint_fields(profile, version=version), sort_keys=True, separators=(",", ":"), ensure_ascii=True
    )
    return hashlib.sha256(canonical.encode("ascii")).hexdigest()[:16]
