"""The "-true" family: the whole model, its optimizer state and its inputs in one half dtype."""

from __future__ import annotations

from ._base import ModeFacts
from ._half import HalfPrecisionMode


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
