"""bf16-mixed: fp32 weights and optimizer, forward under bf16 autocast. No loss scaling needed:
bf16 has fp32's exponent range."""

from __future__ import annotations

import contextlib
from typing import Any

from ._base import PrecisionMode


class AutocastMode(PrecisionMode):
    """Shared by the autocast modes: the forward runs under ``torch.autocast`` of one dtype."""

    dtype_name = "bfloat16"

    @property
    def compute_dtype(self):
        import torch

        return getattr(torch, self.dtype_name)

    def forward_context(self) -> contextlib.AbstractContextManager[Any]:
        import torch

        # torch.autocast restores the previous autocast state on exit, also after an exception.
        return torch.autocast(device_type=self.device.type, dtype=self.compute_dtype)


class Bf16Mixed(AutocastMode):
    """bf16 autocast over fp32 master weights."""

    name = "bf16-mixed"
    dtype_name = "bfloat16"
