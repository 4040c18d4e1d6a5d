"""Where the FP8 modes run: FP8 tensor cores, a torch build and CUDA for the GPU, the library,
and for a policy's recipe what that recipe needs (``probes``' FP8 recipe rules)."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from probes import (
    FP8_RECIPE_RULES,
    Fp8RecipeRule,
    fp8_recipe_rule,
    fp8_recipe_unmet,
    release,
    torch_build_covers,
)

from ._base import ModeFacts, PrecisionMode
from ._device import ModeSupport, arch, cc_text

if TYPE_CHECKING:
    from probes import ArchCapability, HardwareProfile

    from ._config import Policy


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
        options = policy.fp8
        return options.recipe if options is not None and options.recipe else cls.default_recipe

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
            # On a CPU torchao emulates every recipe alike.
            return whole
        return cls.recipe_support(profile, cls.policy_recipe(policy))

    @classmethod
    def recipe_support(cls, profile: HardwareProfile, recipe: str) -> ModeSupport:
        cap = arch(profile)
        version = profile.library_version(cls.library)
        unmet = cls._recipe_unmet(profile, cap, recipe)
        if unmet is None:
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
