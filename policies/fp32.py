"""fp32: the reference. On CUDA it also turns TF32 off, which cuDNN otherwise uses by default."""

from __future__ import annotations

from probes import HardwareProfile

from ._base import ModeFacts, ModeSupport, PrecisionMode


class Fp32(PrecisionMode):
    name = "fp32"
    dtype_family = "fp32"
    safety_rank = 0

    @classmethod
    def facts(cls) -> ModeFacts:
        return ModeFacts(tf32=False)

    @classmethod
    def support(cls, profile: HardwareProfile) -> ModeSupport:
        return ModeSupport(cls.name, True, f"{cls.name}: runs everywhere; the reference for every mode")
