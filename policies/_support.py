"""Which precision modes a device supports and why, what a script gets when nothing was tuned,
and what differs here from where a tuned policy was measured (structured differences, formatted
only where a person reads them): pure functions of a HardwareProfile."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from probes import HardwareProfile, hardware_fingerprint, major_minor

from ._base import FLAG_NAMES, ModeSupport, arch, cpu_speed, gpu_text
from ._config import Policy
from ._fp8 import Fp8Mode
from ._registry import mode_class, mode_classes


def supported_modes(profile: HardwareProfile, policy: Policy | None = None) -> dict[str, ModeSupport]:
    """``{mode: ModeSupport}`` for every registered mode, in ``MODES`` order; with ``policy``,
    its FP8 mode's entry answers for its ``[fp8]`` recipe (a device may run one and not another)."""
    support = {cls.name: cls.support(profile) for cls in mode_classes()}
    cls = None if policy is None else mode_class(policy.mode)
    if cls is not None and issubclass(cls, Fp8Mode):
        support[cls.name] = cls.support(profile, policy)
    return support


def safe_default_mode(profile: HardwareProfile) -> tuple[str, str]:
    """``(mode, why)`` to use when nothing was measured. Never FP8 (it needs per-model
    validation) nor a ``-true`` mode (pure low-precision weights can stall)."""
    if profile.is_cuda:
        cap = arch(profile)
        where = gpu_text(profile, cap)
        if cap.bf16:
            return "bf16-mixed", (f"{where} has bf16 tensor cores; bf16 keeps fp32's exponent "
                                  "range, so no loss scaling is needed, and mixed precision keeps "
                                  "fp32 master weights")
        if cap.fp16_tensor_cores:
            return "fp16-mixed", (f"{where} has fp16 tensor cores but only emulated bf16; fp16 "
                                  "mixed precision with dynamic loss scaling matched fp32 accuracy "
                                  "on ImageNet networks (Micikevicius et al., 2018, Mixed "
                                  "Precision Training)")
        return "fp32", (f"{where} has no tensor cores, so low precision brings little speed for "
                        "the risk of fp16 overflow and underflow")
    cpu = f"this CPU ({profile.name})"
    if profile.has_flag("amx_bf16"):
        return "bf16-mixed", (f"{cpu} has AMX-BF16, so bf16 matmuls run on AMX tiles and beat fp32 "
                              "(bf16-mixed measured 1.7x over fp32 for an MLP on such a CPU); bf16 "
                              "keeps fp32's exponent range, so no loss scaling is needed")
    if profile.has_flag("avx512_bf16"):
        return "fp32", (f"{cpu} has AVX512-BF16 but no AMX: bf16 may or may not beat fp32, so fp32 "
                        "stays the default until a tune run measures it")
    return "fp32", (f"{cpu} has neither AMX-BF16 nor AVX512-BF16, so bf16 is emulated and usually "
                    "slower than fp32")


def safe_default(profile: HardwareProfile) -> Policy:
    return Policy(mode=safe_default_mode(profile)[0])


def capability_summary(profile: HardwareProfile) -> str:
    """One line on what the device accelerates (``"Hopper (9.0): fp16/bf16 tensor cores, TF32, FP8"``)."""
    if profile.is_cuda:
        cap = arch(profile)
        features = [("fp16/bf16 tensor cores" if cap.bf16
                      else "fp16 tensor cores (bf16 emulated)" if cap.fp16_tensor_cores
                      else "no tensor cores (fp16 on CUDA cores, bf16 emulated)")]
        extras = ((cap.tf32, "TF32"), (cap.fp8, "FP8"), (cap.mxfp8, "MXFP8"), (cap.nvfp4, "NVFP4"))
        features += [label for present, label in extras if present]
        return f"{cap.label}: {', '.join(features)}"
    cores = f", {profile.cores} cores" if profile.cores else ""
    isa = [name for flag, name in FLAG_NAMES.items() if profile.has_flag(flag)]
    bf16_speed = cpu_speed(profile, "bf16")[0]
    return f"CPU ({profile.name}{cores}): {', '.join(isa) or 'no AVX2'}; {bf16_speed}"


@dataclass(frozen=True)
class Difference:
    """One fact (``"device"``, ``"torch"``, ``"CUDA"``, an FP8 library) that changed between
    the tune and this machine; ``None`` for absent."""

    what: str
    tuned: str | None
    here: str | None

    def describe(self) -> str:
        """``"torch 2.5.1 -> 2.6.0"``."""
        return f"{self.what} {self.tuned or 'absent'} -> {self.here or 'absent'}"

    def to_dict(self) -> dict[str, str | None]:
        return asdict(self)


@dataclass(frozen=True)
class HardwareMismatch:
    """Why a tuned policy must not be applied on this hardware; ``differences`` is empty when
    only facts outside them (compute capability, memory, SM count) differ."""

    differences: tuple[Difference, ...]
    tuned_fingerprint: str

    def detail(self) -> str:
        """``"torch 2.5.1 -> 2.6.0; torchao absent -> 0.10.0"``."""
        return "; ".join(d.describe() for d in self.differences) or "compute capability, memory or other hardware details differ"

    def describe(self) -> str:
        """``"tuned on other hardware or versions (torch 2.5.1 -> 2.6.0)"``."""
        return f"tuned on other hardware or versions ({self.detail()})"

    def reason(self) -> str:
        """The sentence a log line continues with: ``"it was tuned on ..."``."""
        return f"it was {self.describe()}"


def hardware_mismatch(policy: Policy, profile: HardwareProfile) -> HardwareMismatch | None:
    """What differs between where ``policy`` was tuned and ``profile``; ``None`` when it may apply.

    The hardware fingerprint decides, so a driver upgrade or a patch release keeps a tuned
    policy; an FP8 policy also needs its FP8 library at the same version (its kernels change
    between releases). A policy without ``[tuned_on]`` was written by hand and applies anywhere."""
    tuned = policy.tuned_on
    if tuned is None or not tuned.hardware_fingerprint:
        return None
    cls, library = mode_class(policy.mode), None
    if issubclass(cls, Fp8Mode):
        tuned_library = dict(tuned.libraries).get(cls.library)
        here_library = profile.library_version(cls.library)
        if tuned_library != here_library:
            library = Difference(cls.library, tuned_library, here_library)
    # Recipe 1 too: a policy recorded before recipe 2 on this very machine still applies.
    if tuned.hardware_fingerprint in (hardware_fingerprint(profile), hardware_fingerprint(profile, version=1)):
        return None if library is None else HardwareMismatch((library,), tuned.hardware_fingerprint)
    differences = []
    if tuned.device and tuned.device != profile.name:
        differences.append(Difference("device", tuned.device, profile.name))
    for what, tuned_version, here_version in (("torch", tuned.torch, profile.torch_version),
                                              ("CUDA", tuned.cuda, profile.cuda_runtime)):
        # Only a new release line changes the fingerprint; a patch release is not named as a cause.
        if tuned_version and major_minor(tuned_version) != major_minor(here_version):
            differences.append(Difference(what, tuned_version, here_version))
    if library is not None:
        differences.append(library)
    return HardwareMismatch(tuple(differences), tuned.hardware_fingerprint)

