"""fp8-te: NVIDIA Transformer Engine. Linear layers are swapped for TE's ``Linear`` where the
shapes allow, and the forward runs under ``te.autocast(recipe=...)`` inside bf16 autocast, which
runs what TE's modules do not. Transformer Engine is imported only when this mode is used.

LayerNorms stay torch's: TE's ``LayerNorm`` returns a high-precision output, always has a bias
and computes in the autocast dtype, so a swap would change the model and numerics for no FP8.

Under torch.compile, TE (2.15 and newer) refuses the delayed recipe when its autocast is entered
inside the compiled region. There the default recipe gives way to ``current``; a policy that
names ``delayed`` gets an error saying which recipe to set at its first backward (raised while
Dynamo traces, it would become a graph break that runs the step uncompiled)."""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator
from typing import Any

from probes import MpadviseError, UnsupportedHere, fp8_recipe_since

from ._base import TE_INSTALL
from ._fp8 import Fp8Mode


def import_transformer_engine() -> tuple[Any, Any]:
    try:
        import transformer_engine.pytorch as te
        from transformer_engine.common import recipe
    except ImportError as exc:
        raise MpadviseError(f"fp8-te needs Transformer Engine, which cannot be imported ({exc}); "
                            f"install it with: {TE_INSTALL}") from None
    return te, recipe


# The TE recipe class of each recipe name (transformer_engine.common.recipe).
RECIPE_CLASSES = {"delayed": "DelayedScaling", "current": "Float8CurrentScaling", "mxfp8": "MXFP8BlockScaling",
                  "block": "Float8BlockScaling"}


def build_recipe(recipe_mod: Any, options: Any, name: str) -> Any:
    """The TE recipe object named ``name`` (one of ``fp8_recipes``) for the ``[fp8]`` options."""
    recipe_cls = getattr(recipe_mod, RECIPE_CLASSES[name], None)
    if recipe_cls is None:
        floor = fp8_recipe_since(Fp8Te.library, name)
        needs = f"transformer-engine {floor[0]}.{floor[1]} or newer" if floor else "a newer transformer-engine"
        raise MpadviseError(f"fp8.recipe: {name!r} needs {needs}, and the installed one has no "
                            f"{RECIPE_CLASSES[name]}; upgrade it ({TE_INSTALL}) or set "
                            "recipe = \"delayed\"")
    fmt = getattr(recipe_mod.Format, (options.fp8_format if options else "hybrid").upper())
    if name == "delayed":
        return recipe_cls(fp8_format=fmt, amax_history_len=options.amax_history_len if options else 1024,
                          margin=options.margin if options else 0)
    return recipe_cls(fp8_format=fmt) if name == "current" else recipe_cls()


class Fp8Te(Fp8Mode):
    """Swap ``nn.Linear`` for Transformer Engine's ``Linear``; FP8 under te.autocast."""

    name = "fp8-te"
    safety_rank = 50
    fp8_recipes = ("delayed", "current", "mxfp8", "block")
    default_recipe = "delayed"
    library = "transformer_engine"
    library_display = "transformer-engine"
    install = TE_INSTALL
    nothing_converted = "no Linear could be swapped; this trains like fp32"
    recipe_titles = {"mxfp8": "MXFP8 block scaling"}

    def __init__(self, policy, device) -> None:
        super().__init__(policy, device)
        if device.type != "cuda":
            raise MpadviseError(f"fp8-te needs a CUDA device; this policy runs on {device.type}")
        self.te, recipe_mod = import_transformer_engine()
        self.recipe = build_recipe(recipe_mod, policy.fp8, self.recipe_name)
        # Current scaling stands in for the delayed recipe under torch.compile; built here, since
        # TE refuses to build a recipe inside a compiled region. A TE older than 2.2 had neither
        # current scaling nor the refusal.
        self.compile_recipe = None
        if self.recipe_name == "delayed" and hasattr(recipe_mod, RECIPE_CLASSES["current"]):
            self.compile_recipe = build_recipe(recipe_mod, policy.fp8, "current")
        self.recipe_named = policy.fp8 is not None and policy.fp8.recipe is not None
        self.compile_refusal: str | None = None
        self.depth = 0  # open forward contexts: only inside one does TE run the swapped Linears in FP8

    def swap_layers(self, module, prefix: str = "", done: dict[int, Any] | None = None):
        # A module registered in two places is swapped once, so both places keep sharing it.
        done = {} if done is None else done
        if id(module) in done:
            return done[id(module)]
        replacement = self._replacement(module, prefix or "<root>")
        if replacement is None:
            # Not named_children(), which skips the second place of a module registered twice.
            for name, child in list(module._modules.items()):
                if child is None:
                    continue
                new_child = self.swap_layers(child, f"{prefix}.{name}" if prefix else name, done)
                if new_child is not child:
                    setattr(module, name, new_child)
        done[id(module)] = replacement if replacement is not None else module
        return done[id(module)]

    def _replacement(self, module, fqn: str):
        import torch

        if not isinstance(module, torch.nn.Linear) or self.forward_bypassed(fqn, module):
            return None
        # Exactly nn.Linear: a subclass may do more in its forward than TE's Linear does.
        if type(module) is not torch.nn.Linear or not self.fp8_eligible(fqn, module.in_features, module.out_features):
            return None
        new = self.te.Linear(module.in_features, module.out_features, bias=module.bias is not None,
                             params_dtype=module.weight.dtype, device=self.device)
        # Copy the trained values so the swap is invisible to the optimisation.
        with torch.no_grad():
            new.weight.copy_(module.weight)
            if module.bias is not None:
                new.bias.copy_(module.bias)
        new.register_forward_pre_hook(functools.partial(self._check_tokens, fqn))
        self.converted.append(fqn)
        return new

    def _check_tokens(self, fqn: str, module: Any, args: tuple[Any, ...]) -> None:
        """A swapped Linear's forward pre-hook: refuses, with the fix, a token count FP8 cannot
        run. TE asserts deep inside its Linear and cannot pad (padding the batch would change
        the loss); outside the forward context its Linear runs in high precision, any shape."""
        if not self.depth or not args or not hasattr(args[0], "shape"):
            return
        shape = tuple(args[0].shape)
        tokens, multiple = math.prod(shape[:-1]), self.rule.token_multiple
        if tokens % multiple:
            raise MpadviseError(f"fp8-te: layer {fqn} got an input of shape {shape}, {tokens} "
                                "tokens (the product of every dimension but the last), and "
                                f"Transformer Engine runs the {self.recipe_name} recipe only on a "
                                f"multiple of {multiple} tokens. A last batch smaller than the "
                                "others does this: pass drop_last=True to the DataLoader, or make "
                                f"batch size x sequence length a multiple of {multiple}")

    @contextlib.contextmanager
    def forward_context(self) -> Iterator[None]:
        import torch

        # Without bf16 autocast all but TE's modules would run in fp32 (fp8-torchao has it);
        # bf16 outside, TE's inside: the nesting of TE's own tests and examples.
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16), self._te_autocast():
            self.depth += 1
            try:
                yield
            finally:
                self.depth -= 1

    def _te_autocast(self) -> contextlib.AbstractContextManager[Any]:
        recipe = self._autocast_recipe()
        # Transformer Engine before 2.9 spells it fp8_autocast(fp8_recipe=...); 2.9 added
        # autocast(recipe=...) and keeps fp8_autocast as a deprecated alias.
        if hasattr(self.te, "autocast"):
            return self.te.autocast(enabled=True, recipe=recipe)
        return self.te.fp8_autocast(enabled=True, fp8_recipe=recipe)

    def _autocast_recipe(self) -> Any:
        import torch

        if self.compile_recipe is None or not torch.compiler.is_compiling():
            return self.recipe
        if self.recipe_named:
            # Raised by backward(), outside the compiled code (see the module's docstring).
            self.compile_refusal = ("fp8-te: [fp8] recipe = \"delayed\" cannot run under "
                                    "torch.compile: mp.autocast() is inside the compiled code, "
                                    "where Transformer Engine refuses DelayedScaling; set recipe = "
                                    "\"current\" (per-tensor scales computed every step), leave "
                                    "the recipe out (then current runs under torch.compile), or "
                                    "enter mp.autocast() outside the compiled function")
            return self.compile_recipe
        note = (f"{self.name}: mp.autocast() runs inside torch.compile, where Transformer Engine "
                "refuses the delayed recipe; the current recipe (per-tensor scales computed every "
                "step) runs instead")
        if note not in self.notes:
            self.notes.append(note)
        return self.compile_recipe

    def backward(self, loss) -> None:
        if self.compile_refusal is not None:
            raise UnsupportedHere(self.compile_refusal)
        super().backward(loss)

    def recipe_record(self) -> str:
        # Checkpoints record the TE recipe's class name (``DelayedScaling``), as they always have.
        return type(self.recipe).__name__
