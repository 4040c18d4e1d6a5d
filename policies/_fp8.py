"""The FP8 family's shared part: which layers may run in FP8, the record of converted and
kept layers, tied parameters across a swap, and the recipe check on resume."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from probes import MpadviseError

from ._fp8_support import Fp8Support

if TYPE_CHECKING:
    import torch

    from ._config import Policy

# nn.MultiheadAttention hands out_proj.weight and .bias to F.multi_head_attention_forward (or
# the fused kernel) and never calls out_proj.forward: a swapped layer there would count as
# FP8 and run none, so neither library's swap is made there.
MHA_OUT_PROJ = "nn.MultiheadAttention passes its weight to its attention kernel and never calls its forward"


# eq=False: equality of the Parameter field would compare tensors element by element.
@dataclass(frozen=True, eq=False)
class TiedParameter:
    """One Parameter that several modules hold (an output head tied to its embedding), with
    ``(module path, attribute)`` of every holder."""

    parameter: torch.nn.Parameter
    holders: tuple[tuple[str, str], ...]

    def describe(self) -> str:
        """``embed.weight = lm_head.weight``."""
        return " = ".join(f"{path}.{attr}" if path else attr for path, attr in self.holders)


def tied_parameters(module: torch.nn.Module) -> list[TiedParameter]:
    holders: dict[int, list[tuple[str, str]]] = {}
    parameters: dict[int, torch.nn.Parameter] = {}
    for path, submodule in module.named_modules(remove_duplicate=False):
        for attr, parameter in submodule.named_parameters(recurse=False, remove_duplicate=False):
            holders.setdefault(id(parameter), []).append((path, attr))
            parameters[id(parameter)] = parameter
    return [TiedParameter(parameters[key], tuple(places)) for key, places in holders.items() if len(places) > 1]


def retie(module: torch.nn.Module, ties: list[TiedParameter]) -> None:
    """Make each tie one Parameter again after a conversion that gave its holders their own
    (the other holder would miss the updates, the optimizer the new one). The Parameter the
    conversion made is kept, since the library's module may rely on what it attached to it."""
    import torch

    for tie in ties:
        held = []
        for path, attr in tie.holders:
            owner = _submodule_or_none(module, path)
            if owner is not None and isinstance(getattr(owner, attr, None), torch.nn.Parameter):
                held.append((owner, attr, getattr(owner, attr)))
        kept = next((p for _, _, p in held if p is not tie.parameter), tie.parameter)
        if kept.shape != tie.parameter.shape:
            raise MpadviseError(
                f"the conversion changed the shape of the tied parameter {tie.describe()} "
                f"({tuple(tie.parameter.shape)} -> {tuple(kept.shape)}), so its holders cannot "
                "share it; untie them before setup(), or use bf16-mixed"
            )
        for owner, attr, parameter in held:
            if parameter is not kept:
                setattr(owner, attr, kept)


def _submodule_or_none(module: torch.nn.Module, path: str) -> torch.nn.Module | None:
    try:
        return module.get_submodule(path)
    except AttributeError:
        return None  # the conversion removed this holder


class Fp8Mode(Fp8Support):
    """Shared by the FP8 modes: eligible layers run their matmuls in FP8, the rest stay as they are.

    ``kept_high_precision`` holds the layers left out, with their shapes, by why
    (``{"dimensions not divisible by 16": ["head (32->3)"]}``).
    """

    dtype_family = "fp8"
    nothing_converted: ClassVar[str] = "no layer could run in FP8; this trains like fp32"

    def __init__(self, policy: Policy, device: torch.device) -> None:
        super().__init__(policy, device)
        self.recipe_name = self.policy_recipe(policy)
        self.rule = self.recipe_rule(self.recipe_name)
        self.converted: list[str] = []
        self.kept_high_precision: dict[str, list[str]] = {}
        self._bypassed: dict[int, str] = {}

    @classmethod
    def advice(cls, kind: str, *, optimizer_eps: float | None = None) -> str:
        return (
            "FP8 matmuls (e4m3 keeps 3 mantissa bits) are too coarse for this model; use "
            "bf16-mixed, or keep the sensitive layers (first, last, small ones) out of FP8"
        )

    def find_bypassed(self, module: torch.nn.Module) -> None:
        """Before a conversion: the Linears whose owner uses their weight and never calls them."""
        import torch

        self._bypassed = {
            id(owner.out_proj): MHA_OUT_PROJ for owner in module.modules()
            if isinstance(owner, torch.nn.MultiheadAttention) and isinstance(owner.out_proj, torch.nn.Linear)
        }

    def forward_bypassed(self, fqn: str, linear: torch.nn.Linear) -> bool:
        """Whether ``linear``'s owner never calls its forward (recorded if so); without
        ``find_bypassed`` (Accelerate calls the layer filter alone), MultiheadAttention's out_proj
        is known by its class, which only it uses."""
        import torch

        why = self._bypassed.get(id(linear))
        mha_class = getattr(torch.nn.modules.linear, "NonDynamicallyQuantizableLinear", None)
        if why is None and mha_class is not None and type(linear) is mha_class:
            why = MHA_OUT_PROJ
        if why is None:
            return False
        self._keep(why, fqn, linear.in_features, linear.out_features)
        return True

    def fp8_eligible(self, fqn: str, in_features: int, out_features: int) -> bool:
        # FP8 GEMMs need both dimensions divisible by 16 (cuBLASLt's layout rule, which torchao's
        # Float8Linear inherits), MXFP8 by 32, its scaling block: the recipe rule's dim_multiple.
        multiple = self.rule.dim_multiple
        if in_features % multiple == 0 and out_features % multiple == 0:
            return True
        self._keep(f"dimensions not divisible by {multiple}", fqn, in_features, out_features)
        return False

    def _keep(self, why: str, fqn: str, in_features: int, out_features: int) -> None:
        self.kept_high_precision.setdefault(why, []).append(f"{fqn} ({in_features}->{out_features})")

    def note_conversion(self) -> None:
        for why, layers in self.kept_high_precision.items():
            self.notes.append(f"{self.name}: kept in high precision ({why}): {', '.join(layers)}")
        if not self.converted:
            self.notes.append(f"{self.name}: {self.nothing_converted}")

    def recipe_record(self) -> str:
        return self.recipe_name

    def state_dict(self) -> dict[str, Any]:
        # torchao's dynamic scaling keeps no state between steps, and Transformer Engine's amax
        # histories travel in its modules' extra state (model.state_dict()); the recipe is
        # recorded so that a resume can check it matches.
        return {"fp8_recipe": self.recipe_record()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("fp8_recipe")
        if saved is not None and saved != self.recipe_record():
            raise MpadviseError(
                f"checkpoint was trained with {self.name} recipe {saved!r}, this policy uses "
                f"{self.recipe_record()!r}; resume with the same policy"
            )
