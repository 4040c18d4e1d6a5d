"""What this machine can do, as plain data: ``mpadvise probe``'s and ``GET /hardware``'s report."""

from __future__ import annotations

from typing import Any

import probes
from policies import capability_summary, safe_default_mode, supported_modes


def probe_report(*, bench: bool = False) -> dict[str, Any]:
    """Every device's profile, fingerprint, supported modes and safe default (and, with
    ``bench``, its matmul benchmark), as plain data."""
    devices = []
    for profile in probes.detect():
        mode, why = safe_default_mode(profile)
        entry: dict[str, Any] = {
            "profile": profile.to_dict(),
            "fingerprint": probes.hardware_fingerprint(profile),
            "capability": capability_summary(profile),
            "peak_tflops": probes.peak_tflops(profile) if profile.is_cuda else {},
            "modes": {
                name: {"supported": s.supported, "emulated": s.emulated, "reason": s.reason}
                for name, s in supported_modes(profile).items()
            },
            "safe_default": {"mode": mode, "reason": why},
        }
        if bench:
            entry["bench"] = [row.to_dict() for row in probes.matmul_benchmark(profile)]
        devices.append(entry)
    return {"primary": probes.hardware_fingerprint(probes.primary_profile()), "devices": devices}
