"""Shared by the "-true" modes: the whole model, its optimizer state and its inputs in one dtype."""

from __future__ import annotations

from ._base import PrecisionMode


class TrueHalfMode(PrecisionMode):
    """Cast the model's floating parameters and buffers, and floating inputs, to one dtype.

    No autocast and no master weights: updates smaller than half the dtype's spacing at the
    weight's magnitude are lost (the stall the stability check looks for).
    """

    dtype_name = "bfloat16"

    @property
    def compute_dtype(self):
        import torch

        return getattr(torch, self.dtype_name)

    def convert_module(self, module):
        # Module.to(dtype) only touches floating tensors and keeps Parameter identity, so an
        # optimizer built before the cast still trains these parameters.
        return module.to(dtype=self.compute_dtype)

    def convert_input(self, tensor):
        return tensor.to(self.compute_dtype) if tensor.is_floating_point() else tensor
