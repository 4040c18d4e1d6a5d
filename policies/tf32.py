"""tf32: fp32 weights and activations, matmuls and convolutions on TF32 tensor cores (Ampere+)."""

from __future__ import annotations

from probes import ArchCapability, HardwareProfile

from ._base import ModeFacts, ModeSupport, PrecisionMode, cc_text, gpu_text


class Tf32(PrecisionMode):
    name = "tf32"
    dtype_family = "tf32"
    safety_rank = 10

    @classmethod
    def facts(cls) -> ModeFacts:
        return ModeFacts(tf32=True)

    @classmethod
    def advice(cls, kind: str, *, optimizer_eps: float | None = None) -> str:
        return "use fp32"

    @classmethod
    def cuda_support(cls, profile: HardwareProfile, cap: ArchCapability) -> ModeSupport:
        if cap.tf32:
            return ModeSupport(cls.name, True, f"{cls.name}: fp32 matmuls run on TF32 tensor cores ({gpu_text(profile, cap)})")
        return ModeSupport(cls.name, False, f"{cls.name}: needs compute capability >= 8.0 (Ampere or newer); "
                                            f"this is {cc_text(cap)} ({profile.name})")

    @classmethod
    def cpu_support(cls, profile: HardwareProfile) -> ModeSupport:
        return ModeSupport(cls.name, False,
                           f"{cls.name}: needs an NVIDIA GPU with compute capability >= 8.0; this is a CPU ({profile.name})")
