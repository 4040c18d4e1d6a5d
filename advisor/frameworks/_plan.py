"""How a script is run for trials: through the loop API, or through its framework's adapter,
and the search-space limits of that framework (read from its adapter class's traits)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from advisor._entry import module_argv
from advisor.frameworks._detect import LOOP_API, detect_script_framework
from advisor.frameworks._registry import check_framework, framework_class
from advisor.tune import SpaceLimits
from probes import MpadviseError

# The child's entry point, named rather than imported, so that running it as ``__main__`` does
# not find it imported already.
MODULE = "advisor.frameworks._boot"
# Set by ``mpadvise run``: the config file to apply, and where it came from.
RUN_POLICY_ENV = "MPADVISE_RUN_POLICY"
RUN_SOURCE_ENV = "MPADVISE_RUN_SOURCE"


@dataclass(frozen=True)
class ScriptPlan:
    """How trials of one script run (``framework`` ``None``: the loop API)."""

    framework: str | None
    detected: bool = False
    launch: tuple[str, ...] = ()
    limits: SpaceLimits | None = None

    @property
    def label(self) -> str:
        """``"Lightning's Trainer"``, or ``"the loop API"``."""
        return "the loop API" if self.framework is None else framework_class(self.framework).label


def launch_argv(framework: str) -> list[str]:
    """What goes between the interpreter and the script to run it under the framework adapter."""
    return [*module_argv(MODULE), framework]


def space_limits(framework: str, *, device: str | None = None) -> SpaceLimits:
    """The search space limits of a framework on ``device``: only what it can apply there."""
    cls = framework_class(framework)
    t = cls.traits()
    modes = t.modes
    if device is not None and not device.startswith("cuda"):
        modes = tuple(m for m in modes if m not in t.needs_cuda)
    return SpaceLimits(modes=modes, micro_batch=t.sets_micro_batch, loss_scale_kinds=t.loss_scale_kinds,
                       loss_scale_settings=t.loss_scale_settings, why=cls.label)


def plan_for(script: Path, framework: str | None = None, *, device: str | None = None) -> ScriptPlan:
    """How to run ``script``: ``framework`` when given (``--framework``), else what its imports
    say; a script that imports advisor runs as it is. ``device`` bounds the space."""
    if framework is None:
        found = detect_script_framework(script)
        if found is None or found == LOOP_API:
            return ScriptPlan(None)
        framework, detected = found, True
    else:
        framework, detected = check_framework(framework), False
    return ScriptPlan(framework, detected, tuple(launch_argv(framework)), space_limits(framework, device=device))


def check_plan_modes(plan: ScriptPlan, modes: list[str]) -> list[str]:
    """The requested modes; an MpadviseError for one the plan's framework cannot apply."""
    if plan.framework is None or plan.limits is None or plan.limits.modes is None:
        return modes
    allowed = plan.limits.modes
    for mode in modes:
        if mode not in allowed:
            where = " here" if mode in framework_class(plan.framework).modes() else ""
            raise MpadviseError(f"{plan.label} cannot apply mode {mode}{where}; it can apply {', '.join(allowed)}")
    return modes
