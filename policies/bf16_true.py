"""bf16-true: model, optimizer state and inputs all in bf16 (pure bf16)."""

from __future__ import annotations

from ._half import TrueHalfMode


class Bf16True(TrueHalfMode):
    name = "bf16-true"
    dtype_family = "bf16"
    safety_rank = 60
    cuda_caveat = "pure bf16 weights can stall when the learning rate is small"

    @classmethod
    def advice(cls, kind: str, *, optimizer_eps: float | None = None) -> str:
        if kind == "stalled":
            return ("updates smaller than bf16's precision (8 significant bits, about 0.4% of a "
                    "weight) are lost; use bf16-mixed, which keeps fp32 master weights")
        return "use bf16-mixed, which keeps fp32 master weights and optimizer state"
