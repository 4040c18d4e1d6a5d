"""fp16-true: model, optimizer state and inputs all in fp16 (pure fp16, no loss scaling)."""

from __future__ import annotations

from ._true import TrueHalfMode


class Fp16True(TrueHalfMode):
    """Pure fp16: overflows without loss scaling, and loses small updates."""

    name = "fp16-true"
    dtype_family = "fp16"
    safety_rank = 70
    cuda_caveat = (
        "pure fp16 weights overflow and lose small updates without loss scaling of the weights "
        "themselves"
    )

    @classmethod
    def advice(cls, kind: str) -> str:
        if kind == "diverged":
            return "fp16 overflows without loss scaling; use fp16-mixed (GradScaler) or bf16-mixed"
        return "use fp16-mixed (GradScaler, fp32 master weights) or bf16-mixed"
