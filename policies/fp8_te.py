"""fp8-te: NVIDIA Transformer Engine. Linear and LayerNorm layers are swapped for TE's modules
where the shapes allow, and the forward runs under ``te.autocast(recipe=...)``.

Transformer Engine is imported here only, and only when this mode is used. It needs CUDA.
"""

from __future__ import annotations

from typing import Any

from probes._errors import MpadviseError

from ._base import PrecisionMode
from .fp8_torchao import fp8_shape_ok


def import_transformer_engine() -> tuple[Any, Any]:
    """Return ``(transformer_engine.pytorch, transformer_engine.common.recipe)``."""
    try:
        import transformer_engine.pytorch as te
        from transformer_engine.common import recipe
    except ImportError as exc:
        raise MpadviseError(
            f"fp8-te needs Transformer Engine, which cannot be imported ({exc}); "
            'install it with: pip install "mpadvise[fp8]"'
        ) from None
    return te, recipe


def build_recipe(recipe_mod: Any, options: Any) -> Any:
    """The TE recipe object for the Policy's ``[fp8]`` options (``delayed`` by default)."""
    name = (options.recipe if options and options.recipe else "delayed")
    fmt_name = options.fp8_format if options else "hybrid"
    fmt = getattr(recipe_mod.Format, fmt_name.upper())
    if name == "delayed":
        return recipe_mod.DelayedScaling(
            fp8_format=fmt,
            amax_history_len=options.amax_history_len if options else 1024,
            margin=options.margin if options else 0,
        )
    if name == "current":
        return recipe_mod.Float8CurrentScaling(fp8_format=fmt)
    if name == "mxfp8":
        return recipe_mod.MXFP8BlockScaling()
    if name == "block":
        return recipe_mod.Float8BlockScaling()
    raise MpadviseError(f"fp8.recipe: {name!r} is not a Transformer Engine recipe; expected delayed, current, mxfp8 or block")


class Fp8Te(PrecisionMode):
    """Swap ``nn.Linear``/``nn.LayerNorm`` for Transformer Engine modules; FP8 under te.autocast."""

    name = "fp8-te"

    def __init__(self, policy, device) -> None:
        super().__init__(policy, device)
        if device.type != "cuda":
            raise MpadviseError(f"fp8-te needs a CUDA device; this policy runs on {device.type}")
        self.te, recipe_mod = import_transformer_engine()
        self.recipe = build_recipe(recipe_mod, policy.fp8)
        self.swapped: list[str] = []
        self.kept_high_precision: list[str] = []

    def convert_module(self, module):
        module = self._swap(module, prefix="")
        if self.kept_high_precision:
            self.notes.append(
                "fp8-te: kept in high precision (dimensions not divisible by 16): "
                + ", ".join(self.kept_high_precision)
            )
        if not self.swapped:
            self.notes.append("fp8-te: no Linear/LayerNorm could be swapped; this trains like fp32")
        return module

    def _swap(self, module, prefix: str):
        replacement = self._replacement(module, prefix or "<root>")
        if replacement is not None:
            return replacement
        for name, child in list(module.named_children()):
            fqn = f"{prefix}.{name}" if prefix else name
            new_child = self._swap(child, fqn)
            if new_child is not child:
                setattr(module, name, new_child)
        return module

    def _replacement(self, module, fqn: str):
        import torch

        te = self.te
        if type(module) is torch.nn.Linear:
            if not fp8_shape_ok(module.in_features, module.out_features):
                self.kept_high_precision.append(f"{fqn} ({module.in_features}->{module.out_features})")
                return None
            new = te.Linear(
                module.in_features,
                module.out_features,
                bias=module.bias is not None,
                params_dtype=module.weight.dtype,
                device=self.device,
            )
        elif type(module) is torch.nn.LayerNorm and module.elementwise_affine and len(module.normalized_shape) == 1:
            new = te.LayerNorm(
                module.normalized_shape[0],
                eps=module.eps,
                params_dtype=module.weight.dtype,
                device=self.device,
            )
        else:
            return None
        # Copy the trained values so the swap is invisible to the optimisation.
        with torch.no_grad():
            new.weight.copy_(module.weight)
            if getattr(module, "bias", None) is not None:
                new.bias.copy_(module.bias)
        self.swapped.append(fqn)
        return new

    def forward_context(self):
        te = self.te
        if hasattr(te, "autocast"):
            return te.autocast(enabled=True, recipe=self.recipe)
        # Transformer Engine before 2.x spells it fp8_autocast(fp8_recipe=...).
        return te.fp8_autocast(enabled=True, fp8_recipe=self.recipe)

    def state_dict(self) -> dict[str, Any]:
        # The amax histories and scales live in each TE module's extra state, so they travel
        # with model.state_dict(); here the recipe is recorded to check a resume uses the same.
        return {"fp8_recipe": type(self.recipe).__name__}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("fp8_recipe")
        if saved is not None and saved != type(self.recipe).__name__:
            raise MpadviseError(
                f"checkpoint was trained with Transformer Engine recipe {saved}, this policy uses "
                f"{type(self.recipe).__name__}; resume with the same policy"
            )
