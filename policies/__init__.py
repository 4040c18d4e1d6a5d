"""How each precision mode is applied: the Policy and its config file, one class per mode, the
registry, and which modes a device supports."""

from __future__ import annotations

from ._base import ModeFacts, ModeSupport, PrecisionMode
from ._config import Policy, check_config_target, load_config
from ._fp8 import Fp8Mode
from ._half import AutocastMode, TrueHalfMode
from ._policy_parts import SCHEMA, Fp8Options, LossScale, PolicyError, TunedOn
from ._registry import (
    MODE_ALIASES,
    canonical_mode,
    create_mode,
    default_reduce_dtype,
    mode_class,
    mode_classes,
    mode_dtypes,
    mode_facts,
    mode_names,
    reduce_dtype_choices,
    register_mode,
    safety_order,
    safety_rank,
    unregister_mode,
)
from ._support import (
    Difference,
    HardwareMismatch,
    capability_summary,
    hardware_mismatch,
    safe_default,
    safe_default_mode,
    supported_modes,
)
from .fp8_te import Fp8Te
from .fp8_torchao import Fp8Torchao

TE_RECIPES: tuple[str, ...] = Fp8Te.fp8_recipes
TORCHAO_RECIPES: tuple[str, ...] = Fp8Torchao.fp8_recipes

__all__ = [
    "MODES",  # noqa: F822 - provided by __getattr__ below, from the registry
    "MODE_ALIASES", "SCHEMA", "TE_RECIPES", "TORCHAO_RECIPES", "AutocastMode", "Difference",
    "Fp8Mode", "Fp8Options", "HardwareMismatch", "LossScale", "ModeFacts", "ModeSupport",
    "Policy", "PolicyError", "PrecisionMode", "TrueHalfMode", "TunedOn", "canonical_mode",
    "capability_summary", "check_config_target", "create_mode", "default_reduce_dtype",
    "hardware_mismatch", "load_config", "mode_class", "mode_classes", "mode_dtypes",
    "mode_facts", "mode_names", "reduce_dtype_choices", "register_mode", "safe_default",
    "safe_default_mode", "safety_order", "safety_rank", "supported_modes", "unregister_mode",
]


def __getattr__(name: str) -> tuple[str, ...]:
    # MODES is derived from the registry on every lookup rather than copied once, so a mode
    # registered later is never missing from it.
    if name == "MODES":
        return mode_names()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
