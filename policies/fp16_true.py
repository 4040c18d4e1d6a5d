"""fp16-true: model, optimizer state and inputs all in fp16 (pure fp16, no loss scaling)."""

from __future__ import annotations

from ._true import TrueHalfMode


class Fp16True(TrueHalfMode):
    name = "fp16-true"
    dtype_name = "float16"
