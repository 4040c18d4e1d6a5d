"""Which precision modes a device supports, and why not: pure functions of a HardwareProfile.

These answers decide what the search may run (unsupported modes never run) and what a
script gets when nothing was tuned (``safe_default_mode``). They are judgements on plain
data, so they are unit-tested against recorded and fake profiles without any device.
"""

from __future__ import annotations

from dataclasses import dataclass

from probes import ArchCapability, HardwareProfile, MpadviseError, capability_for

from ._config import MODES, Policy

__all__ = [
    "MODES",
    "ModeSupport",
    "capability_summary",
    "safe_default",
    "safe_default_mode",
    "supported_modes",
]

_TE_INSTALL = 'pip install "mpadvise[fp8]"'
_TORCHAO_INSTALL = 'pip install "mpadvise[torchao]"'

# How the CPU flags are named in messages; amx_tile is implied by the AMX data types.
_FLAG_NAMES = {
    "avx2": "AVX2",
    "avx512f": "AVX512F",
    "avx512_bf16": "AVX512-BF16",
    "amx_bf16": "AMX-BF16",
    "avx512_fp16": "AVX512-FP16",
    "amx_fp16": "AMX-FP16",
}


@dataclass(frozen=True)
class ModeSupport:
    """Whether one precision mode can run on one device.

    Attributes:
        mode: one of ``MODES``.
        supported: the mode may be applied and searched on this device.
        reason: one plain sentence starting with the mode name, e.g.
            ``"fp8-te: compute capability 8.0 < 8.9 (NVIDIA A100-SXM4-80GB)"``.
        emulated: the arithmetic is done in a wider format behind the scenes: numerics are
            right, speed is not (bf16 on a V100 or an AVX2-only CPU, FP8 on a CPU).
    """

    mode: str
    supported: bool
    reason: str
    emulated: bool = False


def supported_modes(profile: HardwareProfile) -> dict[str, ModeSupport]:
    """Support and reason for every mode in ``MODES``, in that order.

    Args:
        profile: a CUDA or CPU profile. FP8 library versions come from
            ``profile.libraries``, so the answer is reproducible from a stored profile.

    Returns:
        ``{mode: ModeSupport}`` for every mode.

    Raises:
        MpadviseError: a CUDA profile without a compute capability.
    """
    if profile.is_cuda:
        checks = _cuda_support(profile, _arch(profile))
    else:
        checks = _cpu_support(profile)
    return {support.mode: support for support in checks}


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
        cap = _arch(profile)
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
        cap = _arch(profile)
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
    isa = [name for flag, name in _FLAG_NAMES.items() if profile.has_flag(flag)]
    return f"CPU ({profile.name}{cores}): {', '.join(isa) or 'no AVX2'}; {_cpu_bf16_speed(profile)}"


def _arch(profile: HardwareProfile) -> ArchCapability:
    if profile.compute_capability is None:
        raise MpadviseError(
            f"HardwareProfile.compute_capability is None for CUDA device {profile.name!r}; "
            f"re-run `mpadvise probe` to record it"
        )
    return capability_for(profile.compute_capability)


def _cc_text(cap: ArchCapability) -> str:
    major, minor = cap.compute_capability
    return f"{major}.{minor}"


def _cuda_support(profile: HardwareProfile, cap: ArchCapability) -> list[ModeSupport]:
    cc = _cc_text(cap)
    where = f"{cap.label}, {profile.name}"
    checks = [ModeSupport("fp32", True, "fp32: runs everywhere; the reference for every mode")]

    if cap.tf32:
        checks.append(
            ModeSupport("tf32", True, f"tf32: fp32 matmuls run on TF32 tensor cores ({where})")
        )
    else:
        checks.append(
            ModeSupport(
                "tf32",
                False,
                f"tf32: needs compute capability >= 8.0 (Ampere or newer); this is {cc} "
                f"({profile.name})",
            )
        )

    if cap.fp16_tensor_cores:
        fp16_note = f"fp16 tensor cores ({where})"
    else:
        fp16_note = (
            f"no tensor cores on {where}; fp16 runs on CUDA cores, at best 2x fp32 (P100) "
            f"and much slower on consumer Pascal"
        )
    checks.append(
        ModeSupport("fp16-mixed", True, f"fp16-mixed: {fp16_note}; uses dynamic loss scaling")
    )

    if cap.bf16:
        bf16_mixed = ModeSupport(
            "bf16-mixed", True, f"bf16-mixed: bf16 tensor cores ({where}); no loss scaling"
        )
        bf16_true = ModeSupport(
            "bf16-true",
            True,
            f"bf16-true: bf16 tensor cores ({where}); pure bf16 weights can stall when the "
            f"learning rate is small",
        )
    else:
        emulated = (
            f"bf16 is emulated on compute capability {cc} ({profile.name}); "
            f"torch.cuda.is_bf16_supported() says yes but there are no bf16 tensor cores"
        )
        bf16_mixed = ModeSupport("bf16-mixed", False, f"bf16-mixed: {emulated}", emulated=True)
        bf16_true = ModeSupport("bf16-true", False, f"bf16-true: {emulated}", emulated=True)
    checks.append(bf16_mixed)
    checks.append(
        ModeSupport(
            "fp16-true",
            True,
            f"fp16-true: {fp16_note}; pure fp16 weights overflow and lose small updates "
            f"without loss scaling of the weights themselves",
        )
    )
    checks.append(bf16_true)

    checks.append(
        _cuda_fp8(profile, cap, "fp8-te", "transformer_engine", "transformer-engine", _TE_INSTALL)
    )
    checks.append(_cuda_fp8(profile, cap, "fp8-torchao", "torchao", "torchao", _TORCHAO_INSTALL))
    return checks


def _cuda_fp8(
    profile: HardwareProfile,
    cap: ArchCapability,
    mode: str,
    library: str,
    display: str,
    install: str,
) -> ModeSupport:
    if not cap.fp8:
        return ModeSupport(
            mode, False, f"{mode}: compute capability {_cc_text(cap)} < 8.9 ({profile.name})"
        )
    version = profile.library_version(library)
    if version is None:
        return ModeSupport(mode, False, f"{mode}: {display} is not installed ({install})")
    blocks = "; MXFP8 block scaling available" if cap.mxfp8 else ""
    return ModeSupport(
        mode, True, f"{mode}: FP8 tensor cores ({cap.label}) with {display} {version}{blocks}"
    )


def _cpu_bf16_speed(profile: HardwareProfile) -> str:
    if profile.has_flag("amx_bf16"):
        return "AMX-BF16: bf16 matmuls run on AMX tiles, usually faster than fp32"
    if profile.has_flag("avx512_bf16"):
        return "AVX512-BF16 without AMX: native bf16 dot products, may or may not beat fp32"
    return "no AMX-BF16/AVX512-BF16: bf16 runs but is usually slower than fp32 here"


def _cpu_fp16_speed(profile: HardwareProfile) -> str:
    if profile.has_flag("amx_fp16"):
        return "AMX-FP16: fp16 matmuls run on AMX tiles"
    if profile.has_flag("avx512_fp16"):
        return "AVX512-FP16: native fp16 arithmetic, may or may not beat fp32"
    return "no AVX512-FP16/AMX-FP16: fp16 runs but is usually much slower than fp32 here"


def _cpu_support(profile: HardwareProfile) -> list[ModeSupport]:
    cpu = f"this is a CPU ({profile.name})"
    native_bf16 = profile.has_flag("amx_bf16") or profile.has_flag("avx512_bf16")
    native_fp16 = profile.has_flag("amx_fp16") or profile.has_flag("avx512_fp16")
    bf16_speed = _cpu_bf16_speed(profile)
    # CPU autocast takes float16 and GradScaler("cpu") exists in every torch this package
    # supports (>= 2.4); checked by running both on torch 2.13.
    fp16_speed = _cpu_fp16_speed(profile)
    checks = [
        ModeSupport("fp32", True, "fp32: runs everywhere; the reference for every mode"),
        ModeSupport(
            "tf32", False, f"tf32: needs an NVIDIA GPU with compute capability >= 8.0; {cpu}"
        ),
        ModeSupport(
            "fp16-mixed",
            True,
            f"fp16-mixed: CPU autocast with GradScaler; {fp16_speed}",
            emulated=not native_fp16,
        ),
        ModeSupport("bf16-mixed", True, f"bf16-mixed: {bf16_speed}", emulated=not native_bf16),
        ModeSupport("fp16-true", True, f"fp16-true: {fp16_speed}", emulated=not native_fp16),
        ModeSupport("bf16-true", True, f"bf16-true: {bf16_speed}", emulated=not native_bf16),
        ModeSupport("fp8-te", False, "fp8-te: needs CUDA; this is a CPU"),
    ]
    if profile.library_version("torchao") is None:
        checks.append(
            ModeSupport(
                "fp8-torchao", False, f"fp8-torchao: torchao is not installed ({_TORCHAO_INSTALL})"
            )
        )
    else:
        checks.append(
            ModeSupport(
                "fp8-torchao",
                True,
                "fp8-torchao: emulated on CPU (correct numerics, no speedup)",
                emulated=True,
            )
        )
    return checks
