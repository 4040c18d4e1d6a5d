"""Which precision modes a device supports, and why not: pure functions of a HardwareProfile.

These answers decide what the search may run (unsupported modes never run) and what a
script gets when nothing was tuned (``safe_default_mode``). They are judgements on plain
data, so they are unit-tested against recorded and fake profiles without any device.
"""

from __future__ import annotations

from probes import HardwareProfile

from ._config import Policy
from ._device import FLAG_NAMES, ModeSupport, arch, cpu_bf16_speed
from ._fp8 import Fp8Mode
from ._registry import mode_class, mode_classes

__all__ = [
    "ModeSupport",
    "capability_summary",
    "safe_default",
    "safe_default_mode",
    "supported_modes",
]


def supported_modes(profile: HardwareProfile, policy: Policy | None = None) -> dict[str, ModeSupport]:
    """Support and reason for every registered mode, in ``MODES`` order.

    Each mode class answers for itself (``PrecisionMode.support``).

    Args:
        profile: a CUDA or CPU profile. FP8 library versions come from
            ``profile.libraries``, so the answer is reproducible from a stored profile.
        policy: a policy about to run. Its mode's entry then answers for this policy: for an
            FP8 mode, for its ``[fp8]`` recipe (``Fp8Mode.support(profile, policy)``), since a
            device may run one recipe and not another. The other entries are unchanged.

    Returns:
        ``{mode: ModeSupport}`` for every mode.

    Raises:
        MpadviseError: a CUDA profile without a compute capability.
    """
    if profile.is_cuda:
        arch(profile)  # one clear error for a profile without a compute capability
    support = {cls.name: cls.support(profile) for cls in mode_classes()}
    if policy is not None:
        cls = mode_class(policy.mode)
        if issubclass(cls, Fp8Mode):
            support[policy.mode] = cls.support(profile, policy)
    return support


def safe_default_mode(profile: HardwareProfile) -> tuple[str, str]:
    """The mode to use when nothing was measured, and why, from the hardware's evidence.

    Never FP8 (needs per-model validation and a large enough model to pay off) and never a
    ``-true`` mode (pure low-precision weights can stall: updates smaller than the weight's
    resolution are lost).

    Args:
        profile: a CUDA or CPU profile.

    Returns:
        ``(mode, reasoning)``.
    """
    if profile.is_cuda:
        cap = arch(profile)
        where = f"{cap.label}, {profile.name}"
        if cap.bf16:
            return (
                "bf16-mixed",
                f"{where} has bf16 tensor cores; bf16 keeps fp32's exponent range, so no loss "
                f"scaling is needed, and mixed precision keeps fp32 master weights",
            )
        if cap.fp16_tensor_cores:
            return (
                "fp16-mixed",
                f"{where} has fp16 tensor cores but only emulated bf16; fp16 mixed precision "
                f"with dynamic loss scaling matched fp32 accuracy on ImageNet networks "
                f"(Micikevicius et al., 2018, Mixed Precision Training)",
            )
        return (
            "fp32",
            f"{where} has no tensor cores, so low precision brings little speed for the "
            f"risk of fp16 overflow and underflow",
        )
    if profile.has_flag("amx_bf16"):
        return (
            "bf16-mixed",
            f"this CPU ({profile.name}) has AMX-BF16, so bf16 matmuls run on AMX tiles and "
            f"beat fp32 (bf16-mixed measured 1.7x over fp32 for an MLP on such a CPU); bf16 "
            f"keeps fp32's exponent range, so no loss scaling is needed",
        )
    if profile.has_flag("avx512_bf16"):
        return (
            "fp32",
            f"this CPU ({profile.name}) has AVX512-BF16 but no AMX: bf16 may or may not beat "
            f"fp32, so fp32 stays the default until a tune run measures it",
        )
    return (
        "fp32",
        f"this CPU ({profile.name}) has neither AMX-BF16 nor AVX512-BF16, so bf16 is "
        f"emulated and usually slower than fp32",
    )


def safe_default(profile: HardwareProfile) -> Policy:
    """The policy used when nothing was tuned for this hardware: ``safe_default_mode``'s mode."""
    mode, _why = safe_default_mode(profile)
    return Policy(mode=mode)


def capability_summary(profile: HardwareProfile) -> str:
    """One line on what the device's hardware accelerates.

    Examples: ``"Hopper (9.0): fp16/bf16 tensor cores, TF32, FP8"``,
    ``"CPU (AMD EPYC, 2 cores): AVX2; bf16 emulated, usually slower than fp32"``.
    """
    if profile.is_cuda:
        cap = arch(profile)
        if cap.bf16:
            features = ["fp16/bf16 tensor cores"]
        elif cap.fp16_tensor_cores:
            features = ["fp16 tensor cores (bf16 emulated)"]
        else:
            features = ["no tensor cores (fp16 on CUDA cores, bf16 emulated)"]
        features += [
            label
            for present, label in (
                (cap.tf32, "TF32"),
                (cap.fp8, "FP8"),
                (cap.mxfp8, "MXFP8"),
                (cap.nvfp4, "NVFP4"),
            )
            if present
        ]
        return f"{cap.label}: {', '.join(features)}"
    cores = f", {profile.cores} cores" if profile.cores else ""
    isa = [name for flag, name in FLAG_NAMES.items() if profile.has_flag(flag)]
    return f"CPU ({profile.name}{cores}): {', '.join(isa) or 'no AVX2'}; {cpu_bf16_speed(profile)}"
