"""What this machine can do: hardware profiles, capability tables, fingerprints, matmul roofline,
and the process-wide TF32 switches set for a block and restored exactly (``matmul_switches``).

The public surface of the probes package: other packages import from here, never from a
``probes._module``. Importing it does not import torch (the CLI's ``--help`` must stay fast);
functions that need torch import it when called.
"""

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
from probes._libraries import first_installed, fp8_library_versions
from probes._nvml import cuda_profiles, gpu_busy
from probes._profile import HardwareProfile
from probes._switches import matmul_switches

__all__ = [
    "FP8_RECIPE_RULES",
    "ArchCapability",
    "BenchRow",
    "Fp8RecipeRule",
    "HardwareProfile",
    "MpadviseError",
    "UnsupportedHere",
    "UsageError",
    "capability_for",
    "cpu_profile",
    "cuda_profiles",
    "detect",
    "first_installed",
    "fp8_library_versions",
    "fp8_recipe_rule",
    "fp8_recipe_since",
    "fp8_recipe_unmet",
    "gpu_busy",
    "hardware_fingerprint",
    "major_minor",
    "matmul_benchmark",
    "matmul_switches",
    "parse_cpuinfo",
    "peak_tflops",
    "primary_profile",
    "profile_for",
    "check_writable",
    "read_trusted_text",
    "release",
    "torch_build_covers",
    "write_file_atomic",
]


def detect() -> list[HardwareProfile]:
    """Every visible CUDA device, in torch's order, then the host CPU.

    Never raises for a missing GPU, driver or NVML: those machines get just the CPU.
    """
    return [*cuda_profiles(), cpu_profile()]


def primary_profile() -> HardwareProfile:
    """The device training runs on: the current CUDA device when CUDA is usable, else the CPU.

    "Current" is ``torch.cuda.current_device()``, which is ``cuda:0`` unless the process (or
    a launcher such as torchrun through ``LOCAL_RANK``) selected another.
    """
    import torch

    try:
        available = torch.cuda.is_available()
        current = torch.cuda.current_device() if available else None
    except Exception:
        # A broken driver raises here instead of reporting False; train on the CPU.
        available, current = False, None
    if available:
        for profile in cuda_profiles():
            if profile.index == current:
                return profile
    return cpu_profile()


def profile_for(device: str | None) -> HardwareProfile:
    """The profile of the device a run names: ``None`` (the primary device), ``"cpu"``,
    ``"cuda"`` or ``"cuda:N"``.

    Raises:
        UsageError: (exit 2) a CUDA device that is not present, or a device name of another form.
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
