"""fp16-mixed: fp16 autocast plus loss scaling (dynamic GradScaler, or a static scale)."""

from __future__ import annotations

from typing import Any

from ._half import AutocastMode

_ADVICE = {
    "diverged": "activations overflow fp16 even with loss scaling; use bf16-mixed where the "
    "hardware has bf16, or keep the overflowing layers in fp32",
    "climbed": "use bf16-mixed where the hardware has bf16, or keep the sensitive layers in fp32",
    "scale_collapse": "use bf16-mixed where the hardware has bf16 (fp32's exponent range, no "
    "loss scaling needed)",
    "skips": "gradients overflow fp16 even at small scales; use bf16-mixed where the hardware "
    "has bf16, or a longer growth_interval if the scale keeps growing into overflow",
    "underflow": "the loss scale is too small; raise the initial scale or use a static loss "
    "scale, or use bf16-mixed where the hardware has bf16",
    "stalled": "use bf16-mixed where the hardware has bf16, or a larger loss scale if small "
    "gradients flush to zero",
}


class Fp16Mixed(AutocastMode):
    """fp16 autocast with a GradScaler from ``[loss_scale]``; a static scale stays fixed but
    overflowing steps are still skipped, as Apex's static scaler did."""

    name = "fp16-mixed"
    dtype_family = "fp16"
    safety_rank = 30
    loss_scaling = True
    cuda_caveat = "uses dynamic loss scaling"
    # CPU autocast takes float16 and GradScaler("cpu") exists in every torch this package
    # supports (>= 2.4); checked by running both on torch 2.13.
    cpu_detail = "CPU autocast with GradScaler"
    _unscaled = False  # gradients unscaled since the last step

    @classmethod
    def advice(cls, kind: str, *, optimizer_eps: float | None = None) -> str:
        return _ADVICE.get(kind, "use bf16-mixed where the hardware has bf16")

    def __init__(self, policy, device) -> None:
        super().__init__(policy, device)
        import torch

        ls = policy.loss_scale
        self.scaler = None
        if ls is not None and ls.kind != "none":
            self.scaler = torch.amp.GradScaler(device.type, init_scale=ls.init_scale, growth_factor=ls.growth_factor,
                                               backoff_factor=ls.backoff_factor, growth_interval=ls.growth_interval)
        self.static_scale = float(ls.init_scale) if ls is not None and ls.kind == "static" else None

    def backward(self, loss) -> None:
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()

    def unscale(self, optimizer) -> None:
        if self.scaler is not None and not self._unscaled:
            self.scaler.unscale_(optimizer)
            self._unscaled = True

    def optimizer_step(self, optimizer) -> bool:
        if self.scaler is None:
            return super().optimizer_step(optimizer)
        # Unscaling here (not inside scaler.step) lets us read the overflow flag that decides
        # whether GradScaler silently skips this step.
        self.unscale(optimizer)
        found_inf = sum(v.item() for v in self.scaler._found_inf_per_device(optimizer).values())
        self.scaler.step(optimizer)
        self.scaler.update(new_scale=self.static_scale)  # None: GradScaler's dynamic update
        self._unscaled = False
        return found_inf == 0

    def loss_scale(self) -> float | None:
        return None if self.scaler is None else float(self.scaler.get_scale())

    def state_dict(self) -> dict[str, Any]:
        return {} if self.scaler is None else {"scaler": self.scaler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler is not None and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])
