"""fp16-true: model, optimizer state and inputs all in fp16 (pure fp16, no loss scaling).

It goes non-finite two ways: values beyond 65504 overflow, and Adam's ``m / (sqrt(v) + eps)``
runs in fp16, where an ``eps`` up to 2**-25 (Adam's 1e-8) is 0, so wherever
``(1 - beta2) * grad**2`` underflows the update divides by 0. ``eps >= 1e-4`` fixes that."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._half import TrueHalfMode

if TYPE_CHECKING:
    import torch

# Round to nearest: fp16's smallest subnormal is 2**-24, and anything up to half of it (2**-25,
# a tie that rounds to the even 0) becomes 0.
FP16_ROUNDS_TO_ZERO = 2.0**-25

_OVERFLOW_ADVICE = "fp16 overflows without loss scaling; use fp16-mixed (GradScaler) or bf16-mixed"
_EPS_ADVICE = ("set the optimizer's eps >= 1e-4, or use bf16-true (whose range holds 1e-8) or "
               "fp16-mixed (fp32 optimizer state)")


def eps_zero_in_fp16(eps: Any) -> bool:
    return isinstance(eps, (int, float)) and not isinstance(eps, bool) and abs(eps) <= FP16_ROUNDS_TO_ZERO


class Fp16True(TrueHalfMode):
    """Pure fp16: overflows without loss scaling, loses small updates, and zeroes a small eps."""

    name = "fp16-true"
    dtype_family = "fp16"
    safety_rank = 70
    cuda_caveat = ("pure fp16 weights overflow and lose small updates without loss scaling of the "
                   "weights themselves")
    _eps_checked = False  # set on the instance at its first step

    @classmethod
    def advice(cls, kind: str, *, optimizer_eps: float | None = None) -> str:
        # For a divergence, the cause that fits the optimizer's eps; both when it is unknown.
        if kind != "diverged":
            return "use fp16-mixed (GradScaler, fp32 master weights) or bf16-mixed"
        if optimizer_eps is None:
            return (f"{_OVERFLOW_ADVICE}; or, if the optimizer's eps is at or below 3e-8 (Adam's "
                    f"default 1e-8), it is 0 in fp16, where Adam divides by it: {_EPS_ADVICE}")
        if eps_zero_in_fp16(optimizer_eps):
            return f"the optimizer's eps={optimizer_eps:g} is 0 in fp16, where Adam divides by it; {_EPS_ADVICE}"
        return _OVERFLOW_ADVICE

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> bool:
        if not self._eps_checked:
            self._eps_checked = True
            # A fused Adam computes in fp32 inside its kernel, where 1e-8 is not 0.
            eps = next((group.get("eps") for group in getattr(optimizer, "param_groups", ())
                        if not group.get("fused") and eps_zero_in_fp16(group.get("eps"))), None)
            if eps is not None:
                self.notes.append(f"{self.name}: the optimizer's eps={eps:g} is 0 in fp16, where "
                                  "its state lives: Adam's update m / (sqrt(v) + eps) divides by 0 "
                                  "wherever (1 - beta2) * grad**2 underflows (inf, or 0/0 = NaN "
                                  "on a zero gradient); set eps >= 1e-4, or use bf16-true or "
                                  "fp16-mixed")
        return super().optimizer_step(optimizer)
