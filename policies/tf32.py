"""tf32: fp32 weights and activations, matmuls and convolutions on TF32 tensor cores (Ampere+)."""

from __future__ import annotations

import contextlib
from typing import Any

from ._base import PrecisionMode
from ._switches import matmul_switches


class Tf32(PrecisionMode):
    """TF32: sets the matmul precision switch while active and restores it on exit."""

    name = "tf32"

    def process_switches(self) -> contextlib.AbstractContextManager[Any]:
        return matmul_switches(tf32=True, cuda=self.device.type == "cuda")
