"""How a script is run for trials: through the loop API, or through its framework's adapter."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from advisor.frameworks._boot import launch_argv
from advisor.frameworks._detect import LOOP_API, detect_framework
from advisor.frameworks._traits import check_framework, traits
from advisor.tune._space import SpaceLimits
from probes import MpadviseError

_NAMES = {"lightning": "Lightning's Trainer", "fabric": "Lightning Fabric",
          "transformers": "the Hugging Face Trainer", "accelerate": "Accelerate"}


@dataclass(frozen=True)
class ScriptPlan:
    """How trials of one script run.

    Attributes:
        framework: the framework that trains, or ``None`` for the loop API (``load_policy()``).
        detected: whether the framework was read from the script (not forced by a flag).
        launch: what goes between the interpreter and the script.
        limits: what the framework can apply, which bounds the search space.
    """

    framework: str | None
    detected: bool = False
    launch: tuple[str, ...] = ()
    limits: SpaceLimits | None = None

    @property
    def label(self) -> str:
        """``"Lightning's Trainer"``; ``"the loop API"`` for a script that calls load_policy()."""
        return "the loop API" if self.framework is None else _NAMES[self.framework]


def space_limits(framework: str) -> SpaceLimits:
    """The search space limits of a framework: only what it can apply."""
    t = traits(framework)
    return SpaceLimits(modes=t.modes, micro_batch=t.sets_micro_batch, loss_scale_kinds=t.loss_scale_kinds,
                       loss_scale_settings=t.loss_scale_settings, why=_NAMES[framework])


def plan_for(script: Path, framework: str | None = None) -> ScriptPlan:
    """How to run ``script``: ``framework`` when given (``--framework``), else what its
    imports say; a script that imports advisor, or no known framework, runs as it is.

    Raises:
        UsageError: an unknown framework name.
    """
    if framework is None:
        try:
            source = script.read_bytes()
        except OSError as exc:
            raise MpadviseError(f"cannot read script {script}: {exc.strerror or exc}") from None
        found = detect_framework(source)
        if found is None or found == LOOP_API:
            return ScriptPlan(None)
        framework, detected = found, True
    else:
        framework, detected = check_framework(framework), False
    return ScriptPlan(framework, detected, tuple(launch_argv(framework)), space_limits(framework))


def check_plan_modes(plan: ScriptPlan, modes: list[str]) -> list[str]:
    """The requested modes, each one the plan's framework can apply.

    Raises:
        MpadviseError: a mode the framework cannot apply, with those it can.
    """
    if plan.framework is None:
        return modes
    allowed = traits(plan.framework).modes
    for mode in modes:
        if mode not in allowed:
            raise MpadviseError(f"{plan.label} cannot apply mode {mode}; it can apply {', '.join(allowed)}")
    return modes
