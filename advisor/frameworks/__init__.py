"""Framework scripts: Lightning (Trainer, Fabric), the Hugging Face Trainer, Accelerate, and the
plain PyTorch loop (``PlainTorch``), each one adapter class in a registry from which every list of
frameworks (detection, ``--framework``, traits, the trial child's dispatch, export targets) is
derived. Adapters translate a mode's facts, never its name, so a mode registered later works too.
"""

from __future__ import annotations

from typing import Any

from ._accelerate import AccelerateAdapter, accelerate_settings
from ._adapter import FrameworkAdapter, FrameworkTraits
from ._detect import LOOP_API, detect_framework, detect_script_framework
from ._export import Export, Exporter
from ._lightning import LightningTrainer, lightning_precision
from ._plan import (
    RUN_POLICY_ENV,
    RUN_SOURCE_ENV,
    ScriptPlan,
    check_plan_modes,
    plan_for,
    space_limits,
)
from ._registry import (
    check_expressible,
    check_framework,
    check_target,
    export_policy,
    export_targets,
    framework_class,
    framework_classes,
    framework_names,
    refusal,
    register_export_target,
    register_framework,
    traits,
)
from ._torch import PlainTorch, PrecisionFlag, flag_advice, precision_flag
from ._torch_export import TorchExporter, policy_diff, script_for
from ._transformers import HuggingFaceTrainer, transformers_precision

__all__ = [
    # The registry, and the lists read from it (by __getattr__ below).
    "EXPORT_TARGETS", "FRAMEWORKS",  # noqa: F822
    "check_expressible", "check_framework", "check_target", "export_policy", "export_targets",
    "framework_class", "framework_classes", "framework_names", "refusal", "register_export_target",
    "register_framework", "traits",
    # How a script's trials run: its framework, read from its imports, and the plan.
    "LOOP_API", "RUN_POLICY_ENV", "RUN_SOURCE_ENV", "ScriptPlan", "check_plan_modes", "detect_framework",
    "detect_script_framework", "plan_for", "space_limits",
    # The adapters and exporters, and what they decide for a policy.
    "AccelerateAdapter", "Export", "Exporter", "FrameworkAdapter", "FrameworkTraits", "HuggingFaceTrainer",
    "LightningTrainer", "PlainTorch", "PrecisionFlag", "TorchExporter", "accelerate_settings",
    "flag_advice", "lightning_precision", "policy_diff", "precision_flag", "script_for",
    "transformers_precision",
]


def __getattr__(name: str) -> Any:
    # Read from the registry on every lookup rather than copied once, so that a framework,
    # export target or mode registered later is never missing from them.
    if name == "FRAMEWORKS":
        return framework_names()
    if name == "EXPORT_TARGETS":
        return export_targets()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
