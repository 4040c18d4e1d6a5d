"""How each precision mode is applied: the Policy config, one module per mode, and the registry.

Public surface: ``Policy`` (with ``LossScale``, ``Fp8Options``, ``TunedOn``), ``load_config``,
``MODES``, the mode interface ``PrecisionMode`` and ``create_mode``, and the hardware support
decisions ``supported_modes`` / ``safe_default_mode``.
"""

from __future__ import annotations

from ._base import PrecisionMode
from ._config import (
    MODES,
    SCHEMA,
    TE_RECIPES,
    TORCHAO_RECIPES,
    Fp8Options,
    LossScale,
    Policy,
    PolicyError,
    TunedOn,
    load_config,
)
from ._provenance import Difference, HardwareMismatch, hardware_mismatch
from ._registry import create_mode, mode_class
from ._support import (
    ModeSupport,
    capability_summary,
    safe_default,
    safe_default_mode,
    supported_modes,
)

__all__ = [
    "MODES",
    "SCHEMA",
    "TE_RECIPES",
    "TORCHAO_RECIPES",
    "Difference",
    "Fp8Options",
    "HardwareMismatch",
    "LossScale",
    "ModeSupport",
    "Policy",
    "PolicyError",
    "PrecisionMode",
    "TunedOn",
    "capability_summary",
    "create_mode",
    "hardware_mismatch",
    "load_config",
    "mode_class",
    "safe_default",
    "safe_default_mode",
    "supported_modes",
]
