"""The FP8 family: which layers may run in FP8, what was converted, where FP8 runs at all.

Transformer Engine (``fp8-te``) and torchao (``fp8-torchao``) differ in how they swap layers
and scale, and share the rest: the layer filter, the record of converted and kept layers and
the notes about them, the recipe check on resume, and the support rule: FP8 tensor cores, a
torch build with kernels for the GPU, a new enough CUDA, the library installed, and for a
policy's recipe what that recipe needs (``probes``' FP8 recipe rules).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from probes import (
    FP8_RECIPE_RULES,
    Fp8RecipeRule,
    MpadviseError,
    fp8_recipe_rule,
    fp8_recipe_unmet,
    release,
    torch_build_covers,
)

from ._base import ModeFacts, PrecisionMode
from ._device import ModeSupport, arch, cc_text

if TYPE_CHECKING:
    import torch

    from probes import ArchCapability, HardwareProfile

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


class Fp8Mode(PrecisionMode):
    """Shared by the FP8 modes: eligible layers run their matmuls in FP8, the rest stay as they are.

    Subclasses set ``fp8_recipes`` and ``default_recipe``, the library that provides FP8
    (``library`` as ``probes`` records its version, ``library_display`` for people,
    ``install`` the command that installs it), ``nothing_converted``, the note when no
    layer could run in FP8, and optionally ``recipe_titles``, what a recipe is called in the
    support reason.

    Attributes:
        recipe_name: the ``[fp8]`` recipe of the policy, or the mode's default.
        rule: what that recipe needs (feature and token multiples among it).
        converted: the layers that run in FP8 (qualified names).
        kept_high_precision: the layers left in high precision, with their shapes, by why
            (``{"dimensions not divisible by 16": ["head (32->3)"]}``).
    """

    dtype_family = "fp8"
    default_recipe: ClassVar[str]
    library: ClassVar[str]
    library_display: ClassVar[str]
    install: ClassVar[str]
    nothing_converted: ClassVar[str] = "no layer could run in FP8; this trains like fp32"
    recipe_titles: ClassVar[dict[str, str]] = {}

    @classmethod
    def facts(cls) -> ModeFacts:
        return ModeFacts(fp8_library=cls.library, fp8_default_recipe=cls.default_recipe)

    def __init__(self, policy: Policy, device: torch.device) -> None:
        super().__init__(policy, device)
        self.recipe_name = self.policy_recipe(policy)
        self.rule = self.recipe_rule(self.recipe_name)
        self.converted: list[str] = []
        self.kept_high_precision: dict[str, list[str]] = {}
        self._bypassed: dict[int, str] = {}

    @classmethod
    def policy_recipe(cls, policy: Policy) -> str:
        """The recipe ``policy`` runs: its ``[fp8]`` recipe, or the mode's default."""
        options = policy.fp8
        return options.recipe if options is not None and options.recipe else cls.default_recipe

    @classmethod
    def recipe_rule(cls, recipe: str) -> Fp8RecipeRule:
        """What ``recipe`` needs; plain FP8's needs for a recipe the rule table does not list."""
        return fp8_recipe_rule(cls.library, recipe) if cls._has_rule(recipe) else Fp8RecipeRule(cls.library, recipe)

    @classmethod
    def _has_rule(cls, recipe: str) -> bool:
        # A mode registered from outside may offer recipes that probes has no rule for.
        return any(rule.library == cls.library and rule.recipe == recipe for rule in FP8_RECIPE_RULES)

    @classmethod
    def advice(cls, kind: str, *, optimizer_eps: float | None = None) -> str:
        return (
            "FP8 matmuls (e4m3 keeps 3 mantissa bits) are too coarse for this model; use "
            "bf16-mixed, or keep the sensitive layers (first, last, small ones) out of FP8"
        )

    # ---- where it runs ---------------------------------------------------------------------------

    @classmethod
    def support(cls, profile: HardwareProfile, policy: Policy | None = None) -> ModeSupport:
        """Whether this mode runs on ``profile``'s device, and why; with ``policy``, its recipe.

        Args:
            profile: a CUDA or CPU profile.
            policy: a policy of this mode: the answer is then for its ``[fp8]`` recipe (the
                default recipe without one). ``None`` answers for the mode as a whole.

        Raises:
            MpadviseError: a CUDA profile without a compute capability.
        """
        whole = super().support(profile)
        if policy is None or not whole.supported or not profile.is_cuda:
            # On a CPU torchao emulates every recipe alike.
            return whole
        return cls.recipe_support(profile, cls.policy_recipe(policy))

    @classmethod
    def recipe_support(cls, profile: HardwareProfile, recipe: str) -> ModeSupport:
        """Whether ``recipe`` runs on a CUDA device where the mode as a whole runs, and why not."""
        cap = arch(profile)
        version = profile.library_version(cls.library)
        unmet = cls._recipe_unmet(profile, cap, recipe)
        if unmet is None:
            return ModeSupport(
                cls.name, True, f"{cls.name}: recipe {recipe!r} runs on {cap.label} with {cls.library_display} {version}"
            )
        here = [r for r in cls.fp8_recipes if cls._recipe_unmet(profile, cap, r) is None]
        return ModeSupport(
            cls.name,
            False,
            f"{cls.name}: recipe {recipe!r} on {profile.name} {unmet}; set [fp8] recipe to one "
            f"that runs here: {', '.join(here) or 'none'}",
        )

    @classmethod
    def cuda_support(cls, profile: HardwareProfile, cap: ArchCapability) -> ModeSupport:
        problem = cls._device_problem(profile, cap)
        if problem is not None:
            return ModeSupport(cls.name, False, f"{cls.name}: {problem}")
        version = profile.library_version(cls.library)
        if version is None:
            return cls._not_installed()
        here, missing = [], []
        for recipe in cls.fp8_recipes:
            unmet = cls._recipe_unmet(profile, cap, recipe)
            title = f" ({cls.recipe_titles[recipe]})" if recipe in cls.recipe_titles else ""
            if unmet is None:
                here.append(f"{recipe}{title}")
            else:
                missing.append(f"{recipe} {unmet}")
        reason = (
            f"{cls.name}: FP8 tensor cores ({cap.label}) with {cls.library_display} {version}; "
            f"recipes here: {', '.join(here) or 'none'}"
        )
        if missing:
            reason += f"; not here: {'; '.join(missing)}"
        runs = cls._recipe_unmet(profile, cap, cls.default_recipe) is None
        return ModeSupport(cls.name, runs, reason)

    @classmethod
    def cpu_support(cls, profile: HardwareProfile) -> ModeSupport:
        return ModeSupport(cls.name, False, f"{cls.name}: needs CUDA; this is a CPU")

    @classmethod
    def _not_installed(cls) -> ModeSupport:
        return ModeSupport(cls.name, False, f"{cls.name}: {cls.library_display} is not installed ({cls.install})")

    @classmethod
    def _device_problem(cls, profile: HardwareProfile, cap: ArchCapability) -> str | None:
        """Why no FP8 recipe of any library runs on this device with this torch build, or ``None``."""
        if not cap.fp8:
            return f"compute capability {cc_text(cap)} < 8.9 ({profile.name})"
        if torch_build_covers(cap.compute_capability, profile.cuda_arch_list) is False:
            major, minor = cap.compute_capability
            hint = " (pytorch.org's wheels for CUDA 12.9 and newer list sm_100 and sm_120)" if major >= 10 else ""
            return (
                f"torch {profile.torch_version} was built for {' '.join(profile.cuda_arch_list)}, with no "
                f"kernels for compute capability {cc_text(cap)} ({profile.name}); install a torch "
                f"build whose torch.cuda.get_arch_list() lists sm_{major}{minor}{hint}"
            )
        cuda = release(profile.cuda_runtime)
        if cap.fp8_min_cuda is not None and cuda is not None and cuda < cap.fp8_min_cuda:
            floor = "{}.{}".format(*cap.fp8_min_cuda)
            return (
                f"FP8 on {cap.label} needs CUDA {floor} or newer, and torch {profile.torch_version} "
                f"was built with CUDA {profile.cuda_runtime} ({profile.name}); install a torch "
                f"build for CUDA {floor} or newer"
            )
        return None

    @classmethod
    def _recipe_unmet(cls, profile: HardwareProfile, cap: ArchCapability, recipe: str) -> str | None:
        if not cls._has_rule(recipe):
            return None  # a recipe without a rule needs what FP8 as a whole needs
        return fp8_recipe_unmet(
            cls.library,
            recipe,
            compute_capability=cap.compute_capability,
            cuda_runtime=profile.cuda_runtime,
            library_version=profile.library_version(cls.library),
            library_display=cls.library_display,
        )

    # ---- conversion ------------------------------------------------------------------------------

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
