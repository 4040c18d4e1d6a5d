"""Framework scripts: Lightning (Trainer, Fabric), the Hugging Face Trainer and Accelerate.

Public surface: ``FRAMEWORKS``, ``detect_framework`` (which framework a script trains with,
read from its imports), ``traits``/``refusal`` (what each framework can express of a Policy,
which bounds the search space of its scripts), and the child-side entry point
``advisor.frameworks._boot``, which applies a policy through the framework's own settings
and records steps through its own hooks.

Arrows: this package uses ``tune`` (the trial recorder's parts) and ``runtime`` (workload
fingerprints); ``tune`` knows nothing of frameworks beyond a launch prefix and a name in the
trial spec.
"""

from __future__ import annotations

from ._detect import FRAMEWORKS, LOOP_API, detect_framework
from ._export import EXPORT_TARGETS, Export, export_policy
from ._plan import ScriptPlan, check_plan_modes, plan_for, space_limits
from ._traits import (
    ACCELERATE_PRECISION,
    LIGHTNING_PRECISION,
    TRANSFORMERS_PRECISION,
    FrameworkTraits,
    check_expressible,
    check_framework,
    refusal,
    traits,
)

__all__ = [
    "ACCELERATE_PRECISION",
    "EXPORT_TARGETS",
    "FRAMEWORKS",
    "LIGHTNING_PRECISION",
    "LOOP_API",
    "TRANSFORMERS_PRECISION",
    "Export",
    "FrameworkTraits",
    "ScriptPlan",
    "check_plan_modes",
    "check_expressible",
    "check_framework",
    "detect_framework",
    "export_policy",
    "plan_for",
    "refusal",
    "space_limits",
    "traits",
]
