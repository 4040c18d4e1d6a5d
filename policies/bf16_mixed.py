"""bf16-mixed: fp32 weights and optimizer, forward under bf16 autocast. No loss scaling needed:
bf16 has fp32's exponent range."""

from __future__ import annotations

from ._half import AutocastMode


class Bf16Mixed(AutocastMode):
    name = "bf16-mixed"
    dtype_family = "bf16"
    safety_rank = 20
    cuda_caveat = "no loss scaling"

    @classmethod
    def advice(cls, kind: str, *, optimizer_eps: float | None = None) -> str:
        return ("bf16-mixed keeps fp32 weights, so an operation computed in bf16 is to blame; use "
                "tf32 or fp32, or keep that operation in fp32")
