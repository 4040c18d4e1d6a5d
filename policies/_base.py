"""The interface every precision mode implements: what it is, where it runs, and its hooks,
which default to fp32 behaviour. Adding a mode means writing one class and registering it."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from probes import ArchCapability, HardwareProfile, matmul_switches

from ._device import ModeSupport, arch

if TYPE_CHECKING:
    import torch

    from ._config import Policy


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
        options = policy.fp8
        return options.recipe if options is not None and options.recipe else self.fp8_default_recipe


class PrecisionMode:
    """Base class of the modes; one object lives for one ``AppliedPolicy`` and may keep state.

    A registered class sets ``name``, ``dtype_family`` (the dtype of most matmuls, as the
    matmul benchmark names it: the search's prior), a unique ``safety_rank``, ``loss_scaling``,
    ``fp8_recipes``, and says where it runs (``support``, or ``cuda_support`` and ``cpu_support``).
    """

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
