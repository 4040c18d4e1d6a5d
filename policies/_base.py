"""The one small interface every precision mode implements: what it is, where it runs, its hooks.

A mode describes itself in class attributes (name, matmul dtype family, safety rank, the knobs
it tunes) and classmethods (label, advice after a failure, hardware support). The registry,
the config validation, the search space, the stability reasons and ``mpadvise probe`` all read
them, so adding a mode means writing one class and registering it. The hooks all default to
fp32 behaviour; a mode overrides only what differs.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from ._device import arch

if TYPE_CHECKING:
    import torch

    from probes import ArchCapability, HardwareProfile

    from ._config import Policy
    from ._device import ModeSupport


@dataclass(frozen=True)
class ModeFacts:
    """What a mode does to training, in the terms a framework's settings use.

    Framework adapters and exporters translate these facts into their own settings; none of
    them asks for a mode by name, so a new mode whose facts a framework can express is applied
    and exported with no change there.

    Attributes:
        autocast: the dtype family (``"bf16"``, ``"fp16"``) the forward runs under autocast
            in, or ``None`` for no autocast.
        weights: the dtype family of the parameters and optimizer state (``"fp32"``, or
            ``"bf16"``/``"fp16"`` for pure half training).
        tf32: ``True`` turns TF32 matmuls on, ``False`` turns them off (exact fp32), ``None``
            leaves the process's setting alone.
        loss_scaling: whether the backward is scaled (a GradScaler), so ``[loss_scale]`` applies.
        fp8_library: the library whose layers run matmuls in FP8 (``"transformer_engine"``,
            ``"torchao"``), or ``None``.
        fp8_default_recipe: the recipe run when the policy names none (FP8 modes only).
    """

    autocast: str | None = None
    weights: str = "fp32"
    tf32: bool | None = None
    loss_scaling: bool = False
    fp8_library: str | None = None
    fp8_default_recipe: str | None = None

    def fp8_recipe(self, policy: Policy) -> str | None:
        """The FP8 recipe ``policy`` runs: its ``[fp8]`` recipe, else this mode's default."""
        if self.fp8_library is None:
            return None
        options = policy.fp8
        return options.recipe if options is not None and options.recipe else self.fp8_default_recipe


class PrecisionMode:
    """Base class of the modes: each hook does what fp32 training does; a mode overrides the rest.

    A mode object lives for one ``AppliedPolicy`` and may keep state (a GradScaler). Hooks:
    ``process_switches`` (process-wide flags, restored on exit), ``convert_module``,
    ``convert_input``, ``forward_context``, ``backward``, ``unscale``, ``optimizer_step``,
    ``state_dict``/``load_state_dict``.

    What a registered mode class sets:
        name: the mode's name in config files and on the command line (``"bf16-mixed"``).
        dtype_family: the dtype most of its matmuls run in, as the matmul benchmark names it
            (``"fp32"``, ``"tf32"``, ``"fp16"``, ``"bf16"``, ``"fp8"``); the search's speed
            prior for a mode it has not measured yet.
        safety_rank: how safe the mode is numerically, lower is safer; unique per mode.
        loss_scaling: whether the mode takes a ``[loss_scale]`` table (and the search tries
            loss scales).
        fp8_recipes: the ``[fp8]`` recipes the mode accepts; empty when it takes no FP8 options.
        ``support(profile)``: whether it runs on a device, and why (or override
        ``cuda_support`` and ``cpu_support``, which ``support`` dispatches to).

    Args:
        policy: the validated policy.
        device: the torch device training runs on.
    """

    name: ClassVar[str]
    dtype_family: ClassVar[str]
    # Lower rank = safer. Within the speed noise band the search prefers the safer policy:
    # full precision first; then mixed modes, which keep fp32 master weights (bf16 before fp16,
    # since bf16 has fp32's exponent range and needs no loss scaling); then FP8, which also keeps
    # high-precision weights but computes matmuls with 3 mantissa bits (torchao's default dynamic
    # per-tensor scaling before Transformer Engine's delayed scaling, whose amax history can go
    # stale after a spike); then pure low-precision modes, which lose small updates
    # (bf16 before fp16: fp16 also overflows without a scaler). The built-in ranks are spaced by
    # ten so that a new mode can slot in between without renumbering the others.
    safety_rank: ClassVar[int]
    loss_scaling: ClassVar[bool] = False
    fp8_recipes: ClassVar[tuple[str, ...]] = ()

    def __init__(self, policy: Policy, device: torch.device) -> None:
        self.policy = policy
        self.device = device
        self.notes: list[str] = []
        """Things a user should know about the conversion (layers kept in high precision...)."""

    # ---- what the mode is ---------------------------------------------------------------------

    @classmethod
    def facts(cls) -> ModeFacts:
        """What this mode does, for the frameworks that apply and export it.

        The base says: fp32 weights, no autocast, TF32 left alone, no loss scaling. The
        families and modes override what differs.
        """
        return ModeFacts(loss_scaling=cls.loss_scaling)

    @classmethod
    def label(cls) -> str:
        """The mode as named in stability reasons (``"bf16-true (pure bf16)"``)."""
        return cls.name

    @classmethod
    def advice(cls, kind: str, *, optimizer_eps: float | None = None) -> str:
        """What to try instead after this mode failed a stability check.

        Args:
            kind: a verdict kind (``"diverged"``, ``"stalled"``, ``"skips"``, ...), or
                ``"climbed"`` for a finite loss that rose (a divergence that is not an overflow).
            optimizer_eps: the smallest ``eps`` of the trial's optimizer, ``None`` when
                unknown; a mode whose arithmetic can lose it says so (pure fp16).

        Returns:
            One clause in the user's terms, e.g. ``"use bf16-mixed, which keeps fp32 master
            weights and optimizer state"``.
        """
        return "use fp32 or bf16-mixed"

    @classmethod
    def support(cls, profile: HardwareProfile) -> ModeSupport:
        """Whether this mode can run on ``profile``'s device, and why (or why not).

        Raises:
            MpadviseError: a CUDA profile without a compute capability.
        """
        if profile.is_cuda:
            return cls.cuda_support(profile, arch(profile))
        return cls.cpu_support(profile)

    @classmethod
    def cuda_support(cls, profile: HardwareProfile, cap: ArchCapability) -> ModeSupport:
        """``support`` on a CUDA device whose capability table entry is ``cap``."""
        raise NotImplementedError(  # abstract: each mode says where it runs
            f"{cls.__qualname__} does not say where it runs; define support(profile), or "
            "cuda_support(profile, cap) and cpu_support(profile)"
        )

    @classmethod
    def cpu_support(cls, profile: HardwareProfile) -> ModeSupport:
        """``support`` on a CPU."""
        raise NotImplementedError(  # abstract: each mode says where it runs
            f"{cls.__qualname__} does not say where it runs; define support(profile), or "
            "cuda_support(profile, cap) and cpu_support(profile)"
        )

    # ---- hooks --------------------------------------------------------------------------------

    @property
    def compute_dtype(self) -> torch.dtype | None:
        """The dtype of most matmuls, or ``None`` for fp32."""
        return None

    def process_switches(self) -> contextlib.AbstractContextManager[Any]:
        """A context that sets process-wide switches and restores them exactly on exit."""
        return contextlib.nullcontext()

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """Return the module converted for this mode (already on ``device``)."""
        return module

    def convert_input(self, tensor: torch.Tensor) -> torch.Tensor:
        """Cast one input tensor (already on ``device``) for this mode."""
        return tensor

    def forward_context(self) -> contextlib.AbstractContextManager[Any]:
        """The context the forward pass runs in."""
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of an (accumulation-scaled) loss."""
        loss.backward()

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Bring gradients to their true values before clipping or inspection."""

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Step the optimizer; return whether the step was really taken."""
        optimizer.step()
        return True

    def loss_scale(self) -> float | None:
        """The current loss scale, or ``None`` where the mode does not scale."""
        return None

    def state_dict(self) -> dict[str, Any]:
        """Mode state a checkpoint must carry (a GradScaler's scale, an FP8 recipe)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""
