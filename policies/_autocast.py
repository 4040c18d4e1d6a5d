"""The autocast (mixed) family: fp32 weights and optimizer, the forward under ``torch.autocast``."""

from __future__ import annotations

import contextlib
from typing import Any

from ._base import ModeFacts
from ._half import HalfPrecisionMode


class AutocastMode(HalfPrecisionMode):
    """The forward runs under ``torch.autocast`` of the mode's half dtype; weights stay fp32."""

    @classmethod
    def facts(cls) -> ModeFacts:
        return ModeFacts(autocast=cls.dtype_family, loss_scaling=cls.loss_scaling)

    def forward_context(self) -> contextlib.AbstractContextManager[Any]:
        import torch

        # torch.autocast restores the previous autocast state on exit, also after an exception.
        return torch.autocast(device_type=self.device.type, dtype=self.compute_dtype)
