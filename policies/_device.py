"""What a device offers each precision, in the words the modes' support reasons use."""

from __future__ import annotations

from dataclasses import dataclass

from probes import ArchCapability, HardwareProfile, MpadviseError, capability_for

TE_INSTALL = 'pip install "mpadvise[fp8]"'
TORCHAO_INSTALL = 'pip install "mpadvise[torchao]"'

# How the CPU flags are named in messages; amx_tile is implied by the AMX data types.
FLAG_NAMES = {"avx2": "AVX2", "avx512f": "AVX512F", "avx512_bf16": "AVX512-BF16", "amx_bf16": "AMX-BF16",
              "avx512_fp16": "AVX512-FP16", "amx_fp16": "AMX-FP16"}


@dataclass(frozen=True)
class ModeSupport:
    """Whether one mode can run on one device, with a reason that starts with its name;
    ``emulated``: done in a wider format behind the scenes, numerics right and speed not."""

    mode: str
    supported: bool
    reason: str
    emulated: bool = False


def arch(profile: HardwareProfile) -> ArchCapability:
    if profile.compute_capability is None:
        raise MpadviseError(
            f"HardwareProfile.compute_capability is None for CUDA device {profile.name!r}; "
            f"re-run `mpadvise probe` to record it"
        )
    return capability_for(profile.compute_capability)


def cc_text(cap: ArchCapability) -> str:
    major, minor = cap.compute_capability
    return f"{major}.{minor}"


def gpu_text(profile: HardwareProfile, cap: ArchCapability) -> str:
    return f"{cap.label}, {profile.name}"


# What a CPU's flags make of each half dtype's speed: the first flag present decides.
_CPU_SPEED = {
    "bf16": ((("amx_bf16", "AMX-BF16: bf16 matmuls run on AMX tiles, usually faster than fp32"),
              ("avx512_bf16", "AVX512-BF16 without AMX: native bf16 dot products, may or may not beat fp32")),
             "no AMX-BF16/AVX512-BF16: bf16 runs but is usually slower than fp32 here"),
    "fp16": ((("amx_fp16", "AMX-FP16: fp16 matmuls run on AMX tiles"),
              ("avx512_fp16", "AVX512-FP16: native fp16 arithmetic, may or may not beat fp32")),
             "no AVX512-FP16/AMX-FP16: fp16 runs but is usually much slower than fp32 here"),
}


def cpu_speed(profile: HardwareProfile, dtype_family: str) -> tuple[str, bool]:
    """What this CPU does with ``dtype_family`` (``"bf16"``/``"fp16"``), and whether natively."""
    native, without = _CPU_SPEED[dtype_family]
    return next(((text, True) for flag, text in native if profile.has_flag(flag)), (without, False))
