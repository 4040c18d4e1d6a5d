"""The FP8 family: which layers may run in FP8, what was converted, where FP8 runs at all.

Transformer Engine (``fp8-te``) and torchao (``fp8-torchao``) differ in how they swap layers
and scale, and share the rest: the layer filter, the record of converted and kept layers and
the notes about them, the recipe check on resume, and the support rule
(:mod:`policies._fp8_support`: FP8 tensor cores, a torch build with kernels for the GPU, a new
enough CUDA, the library installed, and for a policy's recipe what that recipe needs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from probes import MpadviseError

from ._fp8_support import Fp8Support

if TYPE_CHECKING:
    import torch

    from ._config import Policy

# FP8 GEMMs need both matrix dimensions divisible by 16 (cuBLASLt's FP8 layout rule, which
# torchao's Float8Linear inherits); MXFP8 needs 32, its scaling block. Other linears stay in
# high precision. Each recipe's multiple is its rule's dim_multiple (probes' FP8 recipe rules).
FP8_DIM_MULTIPLE = 16


def fp8_shape_ok(in_features: int, out_features: int, multiple: int = FP8_DIM_MULTIPLE) -> bool:
    """Whether a Linear of this shape can run its matmuls in FP8 (features multiples of ``multiple``)."""
    return in_features % multiple == 0 and out_features % multiple == 0


# nn.MultiheadAttention hands out_proj.weight and .bias to F.multi_head_attention_forward (or
# the fused kernel) and never calls out_proj.forward: a swapped layer there would count as
# FP8 and run none, so neither library's swap is made there.
MHA_OUT_PROJ = "nn.MultiheadAttention passes its weight to its attention kernel and never calls its forward"


def forward_bypassed_linears(module: torch.nn.Module) -> dict[int, str]:
    """The Linears in ``module`` whose owner uses their weight and never calls their forward.

    Returns:
        ``id(linear)`` -> why its forward never runs.
    """
    import torch

    return {
        id(owner.out_proj): MHA_OUT_PROJ
        for owner in module.modules()
        if isinstance(owner, torch.nn.MultiheadAttention) and isinstance(owner.out_proj, torch.nn.Linear)
    }


# eq=False: equality of the Parameter field would compare tensors element by element.
@dataclass(frozen=True, eq=False)
class TiedParameter:
    """One Parameter that several modules hold (an output head tied to its embedding).

    Attributes:
        parameter: the Parameter before the conversion.
        holders: ``(module path, attribute)`` of every place that holds it, ``""`` for the root.
    """

    parameter: torch.nn.Parameter
    holders: tuple[tuple[str, str], ...]

    def describe(self) -> str:
        """The holders as a person reads them (``embed.weight = lm_head.weight``)."""
        return " = ".join(f"{path}.{attr}" if path else attr for path, attr in self.holders)


def tied_parameters(module: torch.nn.Module) -> list[TiedParameter]:
    """The Parameters that ``module`` holds in more than one place, with every place."""
    holders: dict[int, list[tuple[str, str]]] = {}
    parameters: dict[int, torch.nn.Parameter] = {}
    for path, submodule in module.named_modules(remove_duplicate=False):
        for attr, parameter in submodule.named_parameters(recurse=False, remove_duplicate=False):
            holders.setdefault(id(parameter), []).append((path, attr))
            parameters[id(parameter)] = parameter
    return [TiedParameter(parameters[key], tuple(places)) for key, places in holders.items() if len(places) > 1]


def retie(module: torch.nn.Module, ties: list[TiedParameter]) -> None:
    """Make each tie one Parameter again after a conversion that gave its holders their own.

    A swapped layer gets a new Parameter (a copy), so the tie breaks: the other holder no
    longer sees the updates, and the optimizer, which matches parameters by name, loses the
    new one. The Parameter kept is one that the conversion made, where there is one, since
    the library's module may rely on what it attached to it; every holder then holds it.

    Raises:
        MpadviseError: the conversion changed the tied Parameter's shape, so one Parameter
            cannot serve every holder.
    """
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

    Where the mode runs is :class:`~policies._fp8_support.Fp8Support`'s (with the facts a
    subclass declares: its recipes, default recipe and library). Subclasses also set
    ``nothing_converted``, the note when no layer could run in FP8.

    Attributes:
        recipe_name: the ``[fp8]`` recipe of the policy, or the mode's default.
        rule: what that recipe needs (feature and token multiples among it).
        converted: the layers that run in FP8 (qualified names).
        kept_high_precision: the layers left in high precision, with their shapes, by why
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
        """Before a conversion: find the Linears in ``module`` whose forward never runs."""
        self._bypassed = forward_bypassed_linears(module)

    def forward_bypassed(self, fqn: str, linear: torch.nn.Linear) -> bool:
        """Whether ``linear``'s owner never calls its forward; records it in ``kept_high_precision`` if so.

        Knows the Linears ``find_bypassed`` found, and without it (Accelerate's conversion calls
        the layer filter alone) MultiheadAttention's out_proj by its class, which only it uses.
        """
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
        """Whether a Linear of this shape may run in FP8; records it in ``kept_high_precision`` if not."""
        if fp8_shape_ok(in_features, out_features, self.rule.dim_multiple):
            return True
        self._keep(f"dimensions not divisible by {self.rule.dim_multiple}", fqn, in_features, out_features)
        return False

    def _keep(self, why: str, fqn: str, in_features: int, out_features: int) -> None:
        self.kept_high_precision.setdefault(why, []).append(f"{fqn} ({in_features}->{out_features})")

    def note_conversion(self) -> None:
        """Tell the user which layers stayed in high precision and why, or that none run in FP8."""
        for why, layers in self.kept_high_precision.items():
            self.notes.append(f"{self.name}: kept in high precision ({why}): {', '.join(layers)}")
        if not self.converted:
            self.notes.append(f"{self.name}: {self.nothing_converted}")

    def recipe_record(self) -> str:
        """What a checkpoint records of the recipe, to check that a resume uses the same."""
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
