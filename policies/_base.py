"""The interface every precision mode implements: what it is, where it runs (in the words the
modes' support reasons share), and its hooks, which default to fp32 behaviour. Adding a mode
means writing one class and registering it."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from probes import ArchCapability, HardwareProfile, MpadviseError, capability_for, matmul_switches

if TYPE_CHECKING:
    import torch

    from ._config import Policy


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
        raise MpadviseError(f"HardwareProfile.compute_capability is None for CUDA device "
                            f"{profile.name!r}; re-run `mpadvise probe` to record it")
    return capability_for(profile.compute_capability)


def cc_text(cap: ArchCapability) -> str:
    return "{}.{}".format(*cap.compute_capability)


def gpu_text(profile: HardwareProfile, cap: ArchCapability) -> str:
    return f"{cap.label}, {profile.name}"


# What a CPU's flags make of each half dtype's speed: the first flag present decides.
_CPU_SPEED = {
    "bf16": ((("amx_bf16", "AMX-BF16: bf16 matmuls run on AMX tiles, usually faster than fp32"),
              ("avx512_bf16",
               "AVX512-BF16 without AMX: native bf16 dot products, may or may not beat fp32")),
             "no AMX-BF16/AVX512-BF16: bf16 runs but is usually slower than fp32 here"),
    "fp16": ((("amx_fp16", "AMX-FP16: fp16 matmuls run on AMX tiles"),
              ("avx512_fp16", "AVX512-FP16: native fp16 arithmetic, may or may not beat fp32")),
             "no AVX512-FP16/AMX-FP16: fp16 runs but is usually much slower than fp32 here"),
}


def cpu_speed(profile: HardwareProfile, dtype_family: str) -> tuple[str, bool]:
    """What this CPU does with ``dtype_family`` (``"bf16"``/``"fp16"``), and whether natively."""
    native, without = _CPU_SPEED[dtype_family]
    return next(((text, True) for flag, text in native if profile.has_flag(flag)), (without, False))


WHERE_IT_RUNS = "define support(profile), or cuda_support(profile, cap) and cpu_support(profile)"


@dataclass(frozen=True)
class ModeFacts:
    """What a mode does to training, in the terms a framework's settings use, so adapters and
    exporters never ask for a mode by name. ``autocast``/``weights`` are dtype families;
    ``tf32`` ``None`` leaves the process's setting alone."""

    autocast: str | None = None
    weights: str = "fp32"
    tf32: bool | None = None
    loss_scaling: bool = False
    fp8_library: str | None = None
    fp8_default_recipe: str | None = None

    def fp8_recipe(self, policy: Policy) -> str | None:
        if self.fp8_library is None:
            return None
        return (policy.fp8 and policy.fp8.recipe) or self.fp8_default_recipe


class PrecisionMode:
    """Base class of the modes; one object lives for one ``AppliedPolicy`` and may keep state.

    A registered class sets ``name``, ``dtype_family`` (the dtype of most matmuls, as the matmul
    benchmark names it: the search's prior), a unique ``safety_rank``, ``loss_scaling`` and
    ``fp8_recipes``, and where it runs: ``support``, or ``cuda_support`` and ``cpu_support``."""

    name: ClassVar[str]
    dtype_family: ClassVar[str]
    # Lower rank = safer; within the speed noise the search prefers the safer policy. Full
    # precision, then mixed (fp32 master weights; bf16 needs no loss scaling), then FP8 (3 mantissa
    # bits; torchao's dynamic scaling before TE's delayed, whose amax history can go stale), then
    # pure low precision, which loses small updates. Spaced by ten so a new mode can slot in.
    safety_rank: ClassVar[int]
    loss_scaling: ClassVar[bool] = False
    fp8_recipes: ClassVar[tuple[str, ...]] = ()

    def __init__(self, policy: Policy, device: torch.device) -> None:
        self.policy = policy
        self.device = device
        self.notes: list[str] = []  # what a user should know about the conversion

    @classmethod
    def facts(cls) -> ModeFacts:
        return ModeFacts(loss_scaling=cls.loss_scaling)

    @classmethod
    def label(cls) -> str:
        """The mode as named in stability reasons (``"bf16-true (pure bf16)"``)."""
        return cls.name

    @classmethod
    def advice(cls, kind: str, *, optimizer_eps: float | None = None) -> str:
        """What to try instead after a stability verdict ``kind`` (or ``"climbed"``: a finite loss
        that rose), as one clause; ``optimizer_eps`` is the optimizer's smallest, if known."""
        return "use fp32 or bf16-mixed"

    @classmethod
    def support(cls, profile: HardwareProfile) -> ModeSupport:
        if profile.is_cuda:
            return cls.cuda_support(profile, arch(profile))
        return cls.cpu_support(profile)

    @classmethod
    def cuda_support(cls, profile: HardwareProfile, cap: ArchCapability) -> ModeSupport:
        raise NotImplementedError(f"{cls.__qualname__} does not say where it runs; {WHERE_IT_RUNS}")

    @classmethod
    def cpu_support(cls, profile: HardwareProfile) -> ModeSupport:
        raise NotImplementedError(f"{cls.__qualname__} does not say where it runs; {WHERE_IT_RUNS}")

    @property
    def compute_dtype(self) -> torch.dtype | None:
        return None

    def process_switches(self) -> contextlib.AbstractContextManager[Any]:
        """The process-wide switches the mode's facts ask for (TF32 on or off) inside the block."""
        tf32 = self.facts().tf32
        if tf32 is None:
            return contextlib.nullcontext()
        return matmul_switches(tf32=tf32, cuda=self.device.type == "cuda")

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        return module

    def convert_input(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def forward_context(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Bring gradients to their true values before clipping or inspection."""

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Step the optimizer; whether the step was really taken."""
        optimizer.step()
        return True

    def loss_scale(self) -> float | None:
        return None

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass
