"""fp8-torchao: torchao's float8 training (Float8Linear swap, dynamic scaling).

On CUDA (compute capability >= 8.9) the swapped linears run FP8 matmuls and the rest of the
forward runs under bf16 autocast. On a CPU torchao emulates the FP8 casts: the numerics are
FP8's, the speed is not. torchao is imported here only, and only when this mode is used.
"""

from __future__ import annotations

import contextlib
from typing import Any

from probes._errors import MpadviseError

from ._base import PrecisionMode

# FP8 GEMMs need both matrix dimensions divisible by 16 (cuBLASLt's FP8 layout rule, which
# torchao's Float8Linear inherits); other linears stay in high precision.
FP8_DIM_MULTIPLE = 16


def fp8_shape_ok(in_features: int, out_features: int) -> bool:
    """Whether a Linear of this shape can run its matmuls in FP8."""
    return in_features % FP8_DIM_MULTIPLE == 0 and out_features % FP8_DIM_MULTIPLE == 0


def import_torchao_float8() -> Any:
    """Import torchao.float8, with a clear error when it is missing."""
    try:
        import torchao.float8 as float8
    except ImportError as exc:
        raise MpadviseError(
            f"fp8-torchao needs torchao, which cannot be imported ({exc}); "
            'install it with: pip install "mpadvise[torchao]"'
        ) from None
    return float8


class Fp8Torchao(PrecisionMode):
    """Swap eligible ``nn.Linear`` layers for torchao ``Float8Linear``; report the others."""

    name = "fp8-torchao"

    def __init__(self, policy, device) -> None:
        super().__init__(policy, device)
        self.recipe = (policy.fp8.recipe if policy.fp8 and policy.fp8.recipe else "tensorwise")
        self.kept_high_precision: list[str] = []
        self.converted: list[str] = []

    @property
    def compute_dtype(self):
        import torch

        return torch.float8_e4m3fn

    def convert_module(self, module):
        import torch

        float8 = import_torchao_float8()
        config = float8.Float8LinearConfig.from_recipe_name(self.recipe)

        def eligible(mod: torch.nn.Module, fqn: str) -> bool:
            if not isinstance(mod, torch.nn.Linear):
                return False
            if fp8_shape_ok(mod.in_features, mod.out_features):
                self.converted.append(fqn)
                return True
            self.kept_high_precision.append(f"{fqn} ({mod.in_features}->{mod.out_features})")
            return False

        module = float8.convert_to_float8_training(module, module_filter_fn=eligible, config=config)
        if self.kept_high_precision:
            self.notes.append(
                "fp8-torchao: kept in high precision (dimensions not divisible by "
                f"{FP8_DIM_MULTIPLE}): {', '.join(self.kept_high_precision)}"
            )
        if not self.converted:
            self.notes.append("fp8-torchao: no Linear layer could run in FP8; this trains like fp32")
        if self.device.type == "cpu":
            self.notes.append("fp8-torchao: emulated on CPU (FP8 numerics, no speedup)")
        return module

    def forward_context(self) -> contextlib.AbstractContextManager[Any]:
        import torch

        # Float8Linear casts its input to the *GPU* autocast dtype, so autocast is only used on
        # CUDA, where bf16 runs the non-FP8 parts of the forward.
        if self.device.type == "cuda":
            return torch.autocast(device_type="cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def state_dict(self) -> dict[str, Any]:
        # Dynamic (per-step) scaling keeps no state between steps; the recipe is recorded so a
        # resume can check it matches.
        return {"fp8_recipe": self.recipe}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("fp8_recipe")
        if saved is not None and saved != self.recipe:
            raise MpadviseError(
                f"checkpoint was trained with fp8 recipe {saved!r}, this policy uses {self.recipe!r}; "
                "resume with the same policy"
            )
