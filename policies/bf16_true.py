"""bf16-true: model, optimizer state and inputs all in bf16 (pure bf16)."""

from __future__ import annotations

from ._true import TrueHalfMode


class Bf16True(TrueHalfMode):
    name = "bf16-true"
    dtype_name = "bfloat16"
