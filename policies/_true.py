"""The "-true" family: the whole model, its optimizer state and its inputs in one half dtype."""

from __future__ import annotations

from ._base import ModeFacts
from ._half import HalfPrecisionMode


class TrueHalfMode(HalfPrecisionMode):
    """Cast the model's floating parameters and buffers, and floating inputs, to one dtype.

    No autocast and no master weights: updates smaller than half the dtype's spacing at the
    weight's magnitude are lost (the stall the stability check looks for).
    """

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
