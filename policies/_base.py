"""The one small interface every precision mode implements; all hooks default to fp32 behaviour."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import torch

    from ._config import Policy


class PrecisionMode:
    """Base class of the modes: each hook does what fp32 training does; a mode overrides the rest.

    A mode object lives for one ``AppliedPolicy`` and may keep state (a GradScaler). Hooks:
    ``process_switches`` (process-wide flags, restored on exit), ``convert_module``,
    ``convert_input``, ``forward_context``, ``backward``, ``unscale``, ``optimizer_step``,
    ``state_dict``/``load_state_dict``.

    Args:
        policy: the validated policy.
        device: the torch device training runs on.
    """

    name: ClassVar[str] = "fp32"

    def __init__(self, policy: Policy, device: torch.device) -> None:
        self.policy = policy
        self.device = device
        self.notes: list[str] = []
        """Things a user should know about the conversion (layers kept in high precision...)."""

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
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""
