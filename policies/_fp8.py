"""The FP8 family's shared part: where FP8 and each recipe run (``probes``' FP8 recipe rules),
which layers may run in FP8 and which were kept, tied parameters across a swap, and the recipe
check on resume."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from probes import (
    FP8_RECIPE_RULES,
    ArchCapability,
    Fp8RecipeRule,
    HardwareProfile,
    MpadviseError,
    fp8_recipe_rule,
    fp8_recipe_unmet,
    release,
    torch_build_covers,
)

from ._base import ModeFacts, ModeSupport, PrecisionMode, arch, cc_text

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
            with contextlib.suppress(AttributeError):  # the conversion removed this holder
                owner = module.get_submodule(path)
                if isinstance(getattr(owner, attr, None), torch.nn.Parameter):
                    held.append((owner, attr, getattr(owner, attr)))
        kept = next((p for _, _, p in held if p is not tie.parameter), tie.parameter)
        if kept.shape != tie.parameter.shape:
            raise MpadviseError(f"the conversion changed the shape of the tied parameter "
                                f"{tie.describe()} ({tuple(tie.parameter.shape)} -> "
                                f"{tuple(kept.shape)}), so its holders cannot share it; untie "
                                "them before setup(), or use bf16-mixed")
        for owner, attr, parameter in held:
            if parameter is not kept:
                setattr(owner, attr, kept)


class Fp8Support(PrecisionMode):
    """Whether an FP8 mode, and each of its recipes, runs on a device, and why not; from the
    facts a subclass declares (recipes, library, its name for people and its install command)."""

    default_recipe: ClassVar[str]
    library: ClassVar[str]
    library_display: ClassVar[str]
    install: ClassVar[str]
    recipe_titles: ClassVar[dict[str, str]] = {}

    @classmethod
    def facts(cls) -> ModeFacts:
        return ModeFacts(fp8_library=cls.library, fp8_default_recipe=cls.default_recipe)

    @classmethod
    def policy_recipe(cls, policy: Policy) -> str:
        return cls.facts().fp8_recipe(policy) or cls.default_recipe

    @classmethod
    def recipe_rule(cls, recipe: str) -> Fp8RecipeRule:
        return fp8_recipe_rule(cls.library, recipe) if cls._has_rule(recipe) else Fp8RecipeRule(cls.library, recipe)

    @classmethod
    def _has_rule(cls, recipe: str) -> bool:
        # A mode registered from outside may offer recipes that probes has no rule for.
        return any(rule.library == cls.library and rule.recipe == recipe for rule in FP8_RECIPE_RULES)

    @classmethod
    def support(cls, profile: HardwareProfile, policy: Policy | None = None) -> ModeSupport:
        """Whether this mode runs on ``profile``'s device, and why; with ``policy``, for its recipe."""
        whole = super().support(profile)
        if policy is None or not whole.supported or not profile.is_cuda:
            return whole  # on a CPU torchao emulates every recipe alike
        recipe, cap = cls.policy_recipe(policy), arch(profile)
        unmet = cls._recipe_unmet(profile, cap, recipe)
        if unmet is None:
            version = profile.library_version(cls.library)
            return ModeSupport(cls.name, True,
                               f"{cls.name}: recipe {recipe!r} runs on {cap.label} with {cls.library_display} {version}")
        here = [r for r in cls.fp8_recipes if cls._recipe_unmet(profile, cap, r) is None]
        return ModeSupport(cls.name, False, f"{cls.name}: recipe {recipe!r} on {profile.name} {unmet}; set [fp8] "
                                            f"recipe to one that runs here: {', '.join(here) or 'none'}")

    @classmethod
    def cuda_support(cls, profile: HardwareProfile, cap: ArchCapability) -> ModeSupport:
        problem = fp8_device_problem(profile, cap)
        if problem is not None:
            return ModeSupport(cls.name, False, f"{cls.name}: {problem}")
        version = profile.library_version(cls.library)
        if version is None:
            return cls._not_installed()
        unmet = {recipe: cls._recipe_unmet(profile, cap, recipe) for recipe in cls.fp8_recipes}
        here = [f"{r} ({cls.recipe_titles[r]})" if r in cls.recipe_titles else r
                for r, why in unmet.items() if not why]
        missing = [f"{r} {why}" for r, why in unmet.items() if why]
        reason = (f"{cls.name}: FP8 tensor cores ({cap.label}) with {cls.library_display} "
                  f"{version}; recipes here: {', '.join(here) or 'none'}")
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
    def _recipe_unmet(cls, profile: HardwareProfile, cap: ArchCapability, recipe: str) -> str | None:
        if not cls._has_rule(recipe):
            return None  # a recipe without a rule needs what FP8 as a whole needs
        return fp8_recipe_unmet(cls.library, recipe, compute_capability=cap.compute_capability,
                                cuda_runtime=profile.cuda_runtime, library_version=profile.library_version(cls.library),
                                library_display=cls.library_display)


def fp8_device_problem(profile: HardwareProfile, cap: ArchCapability) -> str | None:
    if not cap.fp8:
        return f"compute capability {cc_text(cap)} < 8.9 ({profile.name})"
    if torch_build_covers(cap.compute_capability, profile.cuda_arch_list) is False:
        major, minor = cap.compute_capability
        hint = " (pytorch.org's wheels for CUDA 12.9 and newer list sm_100 and sm_120)" if major >= 10 else ""
        return (f"torch {profile.torch_version} was built for {' '.join(profile.cuda_arch_list)}, "
                f"with no kernels for compute capability {cc_text(cap)} ({profile.name}); install "
                f"a torch build whose torch.cuda.get_arch_list() lists sm_{major}{minor}{hint}")
    cuda = release(profile.cuda_runtime)
    if cap.fp8_min_cuda is not None and cuda is not None and cuda < cap.fp8_min_cuda:
        floor = "{}.{}".format(*cap.fp8_min_cuda)
        return (f"FP8 on {cap.label} needs CUDA {floor} or newer, and torch "
                f"{profile.torch_version} was built with CUDA {profile.cuda_runtime} "
                f"({profile.name}); install a torch build for CUDA {floor} or newer")
    return None


class Fp8Mode(Fp8Support):
    """Shared by the FP8 modes: eligible layers run their matmuls in FP8, the rest stay as they are.

    ``kept_high_precision`` holds the layers left out, with their shapes, by why
    (``{"dimensions not divisible by 16": ["head (32->3)"]}``). A subclass swaps the layers in
    ``swap_layers``, asking ``forward_bypassed`` and ``fp8_eligible`` of each Linear."""

    dtype_family = "fp8"
    nothing_converted: ClassVar[str] = "no Linear layer could run in FP8; this trains like fp32"

    def __init__(self, policy: Policy, device: torch.device) -> None:
        super().__init__(policy, device)
        self.recipe_name = self.policy_recipe(policy)
        self.rule = self.recipe_rule(self.recipe_name)
        self.converted: list[str] = []
        self.kept_high_precision: dict[str, list[str]] = {}
        self._bypassed: set[int] = set()

    @classmethod
    def advice(cls, kind: str, *, optimizer_eps: float | None = None) -> str:
        return ("FP8 matmuls (e4m3 keeps 3 mantissa bits) are too coarse for this model; use "
                "bf16-mixed, or keep the sensitive layers (first, last, small ones) out of FP8")

    def swap_layers(self, module: torch.nn.Module) -> torch.nn.Module:
        """The module with its eligible layers in FP8: each FP8 library's mode defines it."""
        raise NotImplementedError(f"{type(self).__qualname__} does not say how it swaps layers; "
                                  "define swap_layers(module)")

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        import torch

        ties = tied_parameters(module)
        # The Linears whose owner uses their weight and never calls them.
        self._bypassed = {id(owner.out_proj) for owner in module.modules()
                          if isinstance(owner, torch.nn.MultiheadAttention)
                          and isinstance(owner.out_proj, torch.nn.Linear)}
        module = self.swap_layers(module)
        retie(module, ties)
        self.note_conversion()
        return module

    def forward_bypassed(self, fqn: str, linear: torch.nn.Linear) -> bool:
        """Whether ``linear``'s owner never calls its forward (recorded if so); outside
        ``convert_module`` (Accelerate calls the layer filter alone), MultiheadAttention's
        out_proj is known by its class, which only it uses."""
        import torch

        mha_class = getattr(torch.nn.modules.linear, "NonDynamicallyQuantizableLinear", None)
        is_mha_out_proj = mha_class is not None and type(linear) is mha_class
        if id(linear) not in self._bypassed and not is_mha_out_proj:
            return False
        self._keep(MHA_OUT_PROJ, fqn, linear.in_features, linear.out_features)
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
            raise MpadviseError(f"checkpoint was trained with {self.name} recipe {saved!r}, this "
                                f"policy uses {self.recipe_record()!r}; resume with the same "
                                "policy")
