"""fp32: the reference. On CUDA it also turns TF32 off, which cuDNN otherwise uses by default."""

from __future__ import annotations

import contextlib
from typing import Any

from ._base import PrecisionMode
from ._switches import matmul_switches


class Fp32(PrecisionMode):
    """Full fp32: no autocast, and TF32 off for matmuls and convolutions so results are exact fp32."""

    name = "fp32"

    def process_switches(self) -> contextlib.AbstractContextManager[Any]:
        return matmul_switches(tf32=False, cuda=self.device.type == "cuda")
