"""fp8-torchao: torchao's float8 training (Float8Linear swap, dynamic scaling), the rest of
the forward under bf16 autocast on CUDA; emulated on a CPU. torchao is imported only when used."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

from probes import HardwareProfile, MpadviseError

from ._base import TORCHAO_INSTALL, ModeSupport
from ._fp8 import Fp8Mode


def import_torchao_float8() -> Any:
    try:
        import torchao.float8 as float8
    except ImportError as exc:
        raise MpadviseError(f"fp8-torchao needs torchao, which cannot be imported ({exc}); "
                            f"install it with: {TORCHAO_INSTALL}") from None
    return float8


class Fp8Torchao(Fp8Mode):
    """Swap eligible ``nn.Linear`` layers for torchao ``Float8Linear``; report the others."""

    name = "fp8-torchao"
    safety_rank = 40
    fp8_recipes = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
    default_recipe = "tensorwise"
    library = "torchao"
    library_display = "torchao"
    install = TORCHAO_INSTALL

    @classmethod
    def cpu_support(cls, profile: HardwareProfile) -> ModeSupport:
        if profile.library_version(cls.library) is None:
            return cls._not_installed()
        return ModeSupport(cls.name, True, f"{cls.name}: emulated on CPU (correct numerics, no speedup)", emulated=True)

    @property
    def compute_dtype(self):
        import torch

        return torch.float8_e4m3fn

    def linear_config(self) -> Any:
        config = import_torchao_float8().Float8LinearConfig.from_recipe_name(self.recipe_name)
        if self.rule.token_multiple > 1:
            # The weight gradient's matmul sums over the tokens, which torch._scaled_mm wants a
            # multiple of 16; zero rows add nothing to the sums (docs/capabilities.md).
            config = dataclasses.replace(config, pad_inner_dim=True)
        return config

    def module_filter(self, module: Any, fqn: str) -> bool:
        """torchao's ``module_filter_fn``; records the Linears it swaps."""
        import torch

        if (not isinstance(module, torch.nn.Linear) or self.forward_bypassed(fqn, module)
                or not self.fp8_eligible(fqn, module.in_features, module.out_features)):
            return False
        self.converted.append(fqn)
        return True

    def swap_layers(self, module):
        # Float8Linear reuses the Linear's Parameter, except where a config wraps the weight in a
        # new one (FSDP float8 all-gather): then convert_module makes the tie again.
        return import_torchao_float8().convert_to_float8_training(
            module, module_filter_fn=self.module_filter, config=self.linear_config())

    def convert_module(self, module):
        module = super().convert_module(module)
        if self.device.type == "cpu":
            self.notes.append(f"{self.name}: emulated on CPU (FP8 numerics, no speedup)")
        return module

    def revert_module(self, module: Any) -> int:
        """Put back an ``nn.Linear`` for each ``Float8Linear`` in ``module``, holding the very same
        Parameters (so the optimizer trains them on); the guard's fallback to bf16-mixed in place.
        Returns how many."""
        import torch

        import_torchao_float8()
        from torchao.float8.float8_linear import Float8Linear

        swapped = 0
        for parent in list(module.modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, Float8Linear):
                    linear = torch.nn.Linear(child.in_features, child.out_features, bias=child.bias is not None,
                                             device="meta")
                    linear.weight, linear.bias = child.weight, child.bias
                    setattr(parent, name, linear)
                    swapped += 1
        return swapped

    def forward_context(self) -> contextlib.AbstractContextManager[Any]:
        import torch

        # Float8Linear casts its input to the *GPU* autocast dtype, so autocast is only used on
        # CUDA, where bf16 runs the non-FP8 parts of the forward.
        if self.device.type == "cuda":
            return torch.autocast(device_type="cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()
