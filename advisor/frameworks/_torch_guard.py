"""The guard over a plain script's optimizer steps under ``mpadvise run``.

A plain loop never calls ``load_policy()``, so no runtime object watches its steps. The plain
adapter's step boundaries (``Steps``) feed this guard instead: the summed loss of each
optimizer step, the scale its GradScaler ended it with, and whether the step was skipped. Its
signals and limits are the runtime guard's own (``Guard``). The adapter set the script's
precision when the script started and cannot take it back in place, so a trip under
``fallback`` is a ``restart needed`` event, as for a framework that cannot change precision:
one line says so, and the event goes into the cache, where the next ``mpadvise run`` (and the
next ``load_policy()``) finds it and applies the safer mode.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from advisor._log import get_logger
from advisor.runtime import (
    Guard,
    GuardEvent,
    GuardLimits,
    guard_fallback,
    guard_setting,
)
from advisor.tune import StabilityThresholds
from policies import Policy


class RunGuard:
    """Watches the plain script's optimizer steps; warns once and records the event.

    Args:
        policy: the policy the run applies.
        setting: ``"warn"`` or ``"fallback"``.
    """

    def __init__(self, policy: Policy, setting: str) -> None:
        self.policy = policy
        self.guard = Guard(setting, GuardLimits.from_thresholds(StabilityThresholds()))
        self.optimizer_steps = 0

    def step(self, loss: Any, scale: float | None, skipped: bool) -> None:
        """One optimizer step's facts: its loss (a tensor), the scale after it, a skip."""
        self.optimizer_steps += 1
        if self.guard.tripped:
            return
        value = float(loss)  # the loss value's one sync
        tripped = self.guard.observe(self.optimizer_steps, loss=value, applied=not skipped, loss_scale=scale)
        if tripped is not None:
            self._trip(*tripped)

    def _trip(self, signal: str, onset: int, detail: str) -> None:
        import probes
        from advisor.cache import record_guard_event

        profile = probes.profile_for(None)
        target = guard_fallback(self.policy, profile)
        action = "restart needed" if target is not None else "warned"
        event = GuardEvent(signal, onset, self.optimizer_steps, self.policy.mode,
                           None if target is None else target.mode, action, detail)
        self.guard.record(event)
        get_logger().warning(event.line())
        # The script's cache entry keeps it: by now the script runs, and argv[0] is the script.
        script = Path(sys.argv[0]).resolve() if sys.argv and sys.argv[0] else None
        record_guard_event(event.to_dict(), profile=profile, workload_fp=None, script=script)


def run_guard(policy: Policy) -> RunGuard | None:
    """The guard ``MPADVISE_GUARD`` asks for over this run (``mpadvise run`` sets it), or ``None``."""
    setting = guard_setting(None)
    return None if setting == "off" else RunGuard(policy, setting)
