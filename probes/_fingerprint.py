"""A short, stable digest of the hardware facts that change which precision policy wins.

Recipe 2 keys on the device model (name, memory to the GiB, SM count: a MIG slice is not the
whole GPU), compute capability, the CUDA and torch release lines, and a CPU's precision flags
and cores. It leaves out what a routine upgrade changes without changing the answer: the
driver, patch releases and the FP8 library versions (``policies.hardware_mismatch`` compares
those for FP8 policies alone). Recipe 1 also covered all of those; it stays so that a policy
or cache recorded under it is still recognised."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from probes._capability import release
from probes._profile import HardwareProfile

# Bumped when the recipe below changes, so that old cache keys miss instead of colliding.
FINGERPRINT_VERSION = 2


def major_minor(version: str | None) -> str | None:
    """``"2.5.1+cu124"`` -> ``"2.5"``; text that does not start with ``major.minor`` unchanged."""
    pair = release(version)
    return version if pair is None else f"{pair[0]}.{pair[1]}"


def hardware_fingerprint(profile: HardwareProfile, *, version: int = FINGERPRINT_VERSION) -> str:
    """First 16 hex digits of the SHA-256, as canonical JSON, of the profile fields that key
    cached results under recipe ``version``. Never one card's identifiers or momentary facts
    (UUID, index, free memory, clocks): two cards of one SKU give one answer."""
    capability, memory = profile.compute_capability, profile.memory_total
    fields: dict[str, Any] = {
        "v": version,
        "kind": profile.kind,
        "name": profile.name,
        "compute_capability": None if capability is None else list(capability),
        "memory_gib": None if memory is None else round(memory / 1024**3),
        "sm_count": profile.sm_count,
    }
    if version == 1:
        fields.update(driver_version=profile.driver_version, cuda_runtime=profile.cuda_runtime,
                      torch_version=profile.torch_version, libraries=dict(sorted(profile.libraries)))
    elif version == 2:
        fields.update(cuda=major_minor(profile.cuda_runtime), torch=major_minor(profile.torch_version))
    else:
        raise ValueError(f"hardware fingerprint recipe {version!r} is unknown; expected 1 or {FINGERPRINT_VERSION}")
    if profile.kind == "cpu":
        fields.update(cpu_flags=sorted(profile.cpu_flags), cores=profile.cores)
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canonical.encode("ascii")).hexdigest()[:16]
