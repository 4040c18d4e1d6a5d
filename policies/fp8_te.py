"""fp8-te: NVIDIA Transformer Engine. Linear and LayerNorm layers are swapped for TE's modules
where the shapes allow, and the forward runs under ``te.autocast(recipe=...)`` inside bf16
autocast, which runs what TE's modules do not (attention, activations, the loss).

Transformer Engine is imported here only, and only when this mode is used. It needs CUDA.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from probes._errors import MpadviseError

from ._device import TE_INSTALL
from ._fp8 import Fp8Mode, retie, tied_parameters


def import_transformer_engine() -> tuple[Any, Any]:
    """Return ``(transformer_engine.pytorch, transformer_engine.common.recipe)``."""
    try:
        import transformer_engine.pytorch as te
        from transformer_engine.common import recipe
    except ImportError as exc:
        raise MpadviseError(
            f"fp8-te needs Transformer Engine, which cannot be imported ({exc}); "
            f"install it with: {TE_INSTALL}"
        ) from None
    return te, recipe


def build_recipe(recipe_mod: Any, options: Any) -> Any:
    """The TE recipe object for the Policy's ``[fp8]`` options (``delayed`` by default)."""
    name = options.recipe if options and options.recipe else Fp8Te.default_recipe
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
    raise MpadviseError(
        f"fp8.recipe: {name!r} is not a Transformer Engine recipe; expected "
        f"{', '.join(Fp8Te.fp8_recipes)}"
    )


class Fp8Te(Fp8Mode):
    """Swap ``nn.Linear``/``nn.LayerNorm`` for Transformer Engine modules; FP8 under te.autocast."""

    name = "fp8-te"
    safety_rank = 50
    fp8_recipes = ("delayed", "current", "mxfp8", "block")
    default_recipe = "delayed"
    library = "transformer_engine"
    library_display = "transformer-engine"
    install = TE_INSTALL
    nothing_converted = "no Linear/LayerNorm could be swapped; this trains like fp32"

    def __init__(self, policy, device) -> None:
        super().__init__(policy, device)
        if device.type != "cuda":
            raise MpadviseError(f"fp8-te needs a CUDA device; this policy runs on {device.type}")
        self.te, recipe_mod = import_transformer_engine()
        self.recipe = build_recipe(recipe_mod, policy.fp8)

    @property
    def swapped(self) -> list[str]:
        """The layers replaced by Transformer Engine modules (``converted``, in TE's words)."""
        return self.converted

    def convert_module(self, module):
        ties = tied_parameters(module)
        module = self._swap(module, prefix="", done={})
        retie(module, ties)
        self.note_conversion()
        return module

    def _swap(self, module, prefix: str, done: dict[int, Any]):
        # A module registered in two places is swapped once, so both places keep sharing it.
        if id(module) in done:
            return done[id(module)]
        replacement = self._replacement(module, prefix or "<root>")
        if replacement is None:
            # Not named_children(), which skips the second place of a module registered twice.
            for name, child in list(module._modules.items()):
                if child is None:
                    continue
                fqn = f"{prefix}.{name}" if prefix else name
                new_child = self._swap(child, fqn, done)
                if new_child is not child:
                    setattr(module, name, new_child)
        done[id(module)] = replacement if replacement is not None else module
        return done[id(module)]

    def _replacement(self, module, fqn: str):
        import torch

        te = self.te
        if type(module) is torch.nn.Linear:
            if not self.fp8_eligible(fqn, module.in_features, module.out_features):
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
        self.converted.append(fqn)
        return new

    def forward_context(self) -> contextlib.AbstractContextManager[Any]:
        return self._bf16_and_fp8_autocast()

    @contextlib.contextmanager
    def _bf16_and_fp8_autocast(self) -> Iterator[None]:
        import torch

        # TE's autocast makes only TE's own modules compute in FP8; everything else would run
        # in fp32 and make this mode look slower than fp8-torchao, which has bf16 autocast.
        # bf16 autocast outside, TE's inside: the nesting of TE's own tests and examples.
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16), self._te_autocast():
            yield

    def _te_autocast(self) -> contextlib.AbstractContextManager[Any]:
        te = self.te
        if hasattr(te, "autocast"):
            return te.autocast(enabled=True, recipe=self.recipe)
        # Transformer Engine before 2.x spells it fp8_autocast(fp8_recipe=...).
        return te.fp8_autocast(enabled=True, fp8_recipe=self.recipe)

    def recipe_record(self) -> str:
        # Checkpoints record the TE recipe's class name (``DelayedScaling``), as they always have.
        return type(self.recipe).__name__
