"""Shared by the 16-bit modes: where one runs depends on its half dtype only, so the support
rule lives here and each mode adds its own caveat."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from ._base import PrecisionMode
from ._device import ModeSupport, cc_text, cpu_bf16_speed, cpu_fp16_speed, cpu_has_native, gpu_text

if TYPE_CHECKING:
    import torch

    from probes import ArchCapability, HardwareProfile

# torch's name of each half dtype family.
_TORCH_DTYPES = {"fp16": "float16", "bf16": "bfloat16"}


class HalfPrecisionMode(PrecisionMode):
    """A mode whose matmuls run in fp16 or bf16; subclasses add a ``cuda_caveat`` (and may add
    a ``cpu_detail``) to the support reason."""

    cuda_caveat: ClassVar[str] = ""
    cpu_detail: ClassVar[str] = ""

    @property
    def compute_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, _TORCH_DTYPES[self.dtype_family])

    @classmethod
    def cuda_support(cls, profile: HardwareProfile, cap: ArchCapability) -> ModeSupport:
        where = gpu_text(profile, cap)
        if cls.dtype_family == "bf16":
            if not cap.bf16:
                emulated = (
                    f"bf16 is emulated on compute capability {cc_text(cap)} ({profile.name}); "
                    f"torch.cuda.is_bf16_supported() says yes but there are no bf16 tensor cores"
                )
                return ModeSupport(cls.name, False, f"{cls.name}: {emulated}", emulated=True)
            cores = f"bf16 tensor cores ({where})"
        elif cap.fp16_tensor_cores:
            cores = f"fp16 tensor cores ({where})"
        else:
            cores = (
                f"no tensor cores on {where}; fp16 runs on CUDA cores, at best 2x fp32 (P100) "
                f"and much slower on consumer Pascal"
            )
        return ModeSupport(cls.name, True, f"{cls.name}: {cores}; {cls.cuda_caveat}")

    @classmethod
    def cpu_support(cls, profile: HardwareProfile) -> ModeSupport:
        speed = cpu_bf16_speed(profile) if cls.dtype_family == "bf16" else cpu_fp16_speed(profile)
        detail = f"{cls.cpu_detail}; " if cls.cpu_detail else ""
        return ModeSupport(cls.name, True, f"{cls.name}: {detail}{speed}",
                           emulated=not cpu_has_native(profile, cls.dtype_family))
