"""What this machine can do: hardware profiles, capability tables, fingerprints, the matmul
roofline and the TF32 switches. Importing it does not import torch (``--help`` stays fast)."""

from __future__ import annotations

from probes._bench import BenchRow, matmul_benchmark
from probes._capability import (
    FP8_RECIPE_RULES,
    ArchCapability,
    Fp8RecipeRule,
    capability_for,
    fp8_recipe_rule,
    fp8_recipe_since,
    fp8_recipe_unmet,
    peak_tflops,
    release,
    torch_build_covers,
)
from probes._cpu import cpu_profile, parse_cpuinfo
from probes._errors import MpadviseError, UnsupportedHere, UsageError
from probes._files import check_writable, read_trusted_text, write_file_atomic
from probes._fingerprint import hardware_fingerprint, major_minor
from probes._libraries import (
    first_installed,
    fp8_library_versions,
    gpu_driver_present,
    torch_release,
)
from probes._nvml import cuda_profiles, gpu_busy
from probes._profile import HardwareProfile
from probes._switches import matmul_switches

__all__ = [
    "FP8_RECIPE_RULES", "ArchCapability", "BenchRow", "Fp8RecipeRule", "HardwareProfile",
    "MpadviseError", "UnsupportedHere", "UsageError", "capability_for", "cpu_profile",
    "cuda_profiles", "detect", "first_installed", "fp8_library_versions", "fp8_recipe_rule",
    "fp8_recipe_since", "fp8_recipe_unmet", "gpu_busy", "gpu_driver_present", "hardware_fingerprint",
    "major_minor", "matmul_benchmark", "matmul_switches", "parse_cpuinfo", "peak_tflops",
    "primary_profile", "profile_for", "check_writable", "read_trusted_text", "release",
    "torch_build_covers", "torch_release", "write_file_atomic",
]


def detect() -> list[HardwareProfile]:
    """Every visible CUDA device, in torch's order, then the host CPU; never raises."""
    return [*cuda_profiles(), cpu_profile()]


def primary_profile() -> HardwareProfile:
    """The device training runs on: CUDA's current device where it is usable, else the CPU."""
    profiles = cuda_profiles()  # [] at once where no GPU driver is: torch is not imported
    if not profiles:
        return cpu_profile()
    import torch

    try:
        current = torch.cuda.current_device() if torch.cuda.is_available() else None
    except Exception:
        current = None  # a broken driver raises here instead of reporting False: train on the CPU
    found = [profile for profile in profiles if profile.index == current]
    return found[0] if current is not None and found else cpu_profile()


def profile_for(device: str | None) -> HardwareProfile:
    """The profile of ``None`` (the primary device), ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.

    Raises:
        UsageError: a CUDA device that is not present, or a name of another form.
    """
    if device is None:
        return primary_profile()
    if device == "cpu":
        return cpu_profile()
    index_text = device[len("cuda:"):] if device.startswith("cuda:") else "0" if device == "cuda" else None
    if index_text is None or not index_text.isdigit():
        raise UsageError(f"device {device!r} is not allowed; expected 'cpu', 'cuda' or 'cuda:N'")
    profiles = cuda_profiles()
    for profile in profiles:
        if profile.index == int(index_text):
            return profile
    here = ", ".join(f"cuda:{profile.index}" for profile in profiles)
    raise UsageError(f"device {device!r} is not available: "
                     + (f"the CUDA devices here are {here}" if profiles else "no CUDA device here; use --device cpu"))
