"""The 16-bit families, whose support rule depends on the half dtype alone: autocast (mixed),
with fp32 weights, and "-true", with the model, optimizer state and inputs in the half dtype."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, ClassVar

from probes import ArchCapability, HardwareProfile

from ._base import ModeFacts, ModeSupport, PrecisionMode, cc_text, cpu_speed, gpu_text

if TYPE_CHECKING:
    import torch


class HalfPrecisionMode(PrecisionMode):
    """A mode whose matmuls run in fp16 or bf16; subclasses add a ``cuda_caveat`` (and may add
    a ``cpu_detail``) to the support reason."""

    cuda_caveat: ClassVar[str] = ""
    cpu_detail: ClassVar[str] = ""

    @property
    def compute_dtype(self) -> torch.dtype:
        import torch

        return {"fp16": torch.float16, "bf16": torch.bfloat16}[self.dtype_family]

    @classmethod
    def cuda_support(cls, profile: HardwareProfile, cap: ArchCapability) -> ModeSupport:
        where = gpu_text(profile, cap)
        if cls.dtype_family == "bf16":
            if not cap.bf16:
                return ModeSupport(cls.name, False, f"{cls.name}: bf16 is emulated on compute "
                                   f"capability {cc_text(cap)} ({profile.name}); "
                                   "torch.cuda.is_bf16_supported() says yes but there are no bf16 "
                                   "tensor cores", emulated=True)
            cores = f"bf16 tensor cores ({where})"
        elif cap.fp16_tensor_cores:
            cores = f"fp16 tensor cores ({where})"
        else:
            cores = (f"no tensor cores on {where}; fp16 runs on CUDA cores, at best 2x fp32 (P100) "
                     f"and much slower on consumer Pascal")
        return ModeSupport(cls.name, True, f"{cls.name}: {cores}; {cls.cuda_caveat}")

    @classmethod
    def cpu_support(cls, profile: HardwareProfile) -> ModeSupport:
        speed, native = cpu_speed(profile, cls.dtype_family)
        detail = f"{cls.cpu_detail}; " if cls.cpu_detail else ""
        return ModeSupport(cls.name, True, f"{cls.name}: {detail}{speed}", emulated=not native)


class AutocastMode(HalfPrecisionMode):
    """The forward runs under ``torch.autocast`` of the mode's half dtype; weights stay fp32."""

    @classmethod
    def facts(cls) -> ModeFacts:
        return ModeFacts(autocast=cls.dtype_family, loss_scaling=cls.loss_scaling)

    def forward_context(self) -> contextlib.AbstractContextManager[Any]:
        import torch

        # torch.autocast restores the previous autocast state on exit, also after an exception.
        return torch.autocast(device_type=self.device.type, dtype=self.compute_dtype)


class TrueHalfMode(HalfPrecisionMode):
    """Parameters, buffers and floating inputs in one half dtype, no master weights: updates
    smaller than half the dtype's spacing at a weight are lost (the stall the check looks for)."""

    @classmethod
    def facts(cls) -> ModeFacts:
        return ModeFacts(weights=cls.dtype_family, loss_scaling=cls.loss_scaling)

    @classmethod
    def label(cls) -> str:
        # Reasons say "pure", since the missing master weights are what goes wrong.
        return f"{cls.name} (pure {cls.dtype_family})"

    def convert_module(self, module):
        # Module.to(dtype) only touches floating tensors and keeps Parameter identity, so an
        # optimizer built before the cast still trains these parameters.
        return module.to(dtype=self.compute_dtype)

    def convert_input(self, tensor):
        return tensor.to(self.compute_dtype) if tensor.is_floating_point() else tensor
