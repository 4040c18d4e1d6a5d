"""The guard over a framework or plain script's optimizer steps under ``mpadvise run``.

Such a script never calls ``load_policy()``, so the plain adapter's step boundaries (``Steps``,
at torch's own seams, whichever framework drives the loop) feed the runtime guard (``Guard``)
instead. The script's precision was set when it started and cannot be taken back in place, so a
trip under ``fallback`` is a ``restart needed`` event: one line says so, and the event goes into
the cache, where the next ``mpadvise run`` (and ``load_policy()``) applies the safer mode.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Any

import probes
from advisor._log import get_logger
from advisor.frameworks._torch_hooks import Steps, wrap_backward
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
    """Watches a framework or plain script's optimizer steps; warns once and records the event.

    Args:
        policy: the policy the run applies.
        setting: ``"warn"`` or ``"fallback"``.
    """

    def __init__(self, policy: Policy, setting: str) -> None:
        self.policy = policy
        self.guard = Guard(setting, GuardLimits.from_thresholds(StabilityThresholds()),
                           trend=guard_fallback(policy, probes.profile_for(None)) is not None)
        self.optimizer_steps = 0

    def step(self, loss: Any, scale: float | None, skipped: bool) -> None:
        """One optimizer step's facts: its loss (a tensor), the scale after it, a skip."""
        self.optimizer_steps += 1
        if self.optimizer_steps == 1 and self.guard.trend_on:  # by now argv is the script's own
            self.guard.reference = _reference()
            self.guard.trend.reference = list(self.guard.reference)
        if self.guard.tripped:
            return
        value = float(loss)  # the loss value's one sync
        tripped = self.guard.observe(self.optimizer_steps, loss=value, applied=not skipped, loss_scale=scale)
        if tripped is not None:
            self._trip(*tripped)

    def _trip(self, signal: str, onset: int, detail: str) -> None:
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


def _reference() -> tuple[float, ...]:
    """fp32's loss per optimizer step in the newest tune of this script with these arguments
    (by now the script runs, and argv is its own), or nothing."""
    from advisor.cache import cached_answers

    args = tuple(sys.argv[1:])
    for answer in cached_answers(probes.profile_for(None), Path(sys.argv[0]).resolve()):
        if answer.args is None or answer.args == args:
            return answer.reference
    return ()


def run_guard(policy: Policy) -> RunGuard | None:
    """The guard ``MPADVISE_GUARD`` asks for over this run (``mpadvise run`` sets it), or ``None``."""
    setting = guard_setting(None)
    return None if setting == "off" else RunGuard(policy, setting)


def watch_run(policy: Policy) -> None:
    """Under ``mpadvise run``, feed a framework script's optimizer steps to the guard
    ``MPADVISE_GUARD`` asks for (the plain adapter's ``install`` wires its own)."""
    guard = run_guard(policy)
    if guard is None:
        return
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook

    steps = Steps(None, refuse=lambda reason: None, label=policy.mode)
    steps.watch = guard.step
    register_optimizer_step_post_hook(steps.optimizer_post)
    wrap_backward(torch.Tensor, steps)
    _watch_scaler(torch.amp.GradScaler, steps)


def _watch_scaler(cls: type, steps: Steps) -> None:
    """Wrap ``GradScaler.scale`` and ``step`` in place (every subclass's ``super()`` reaches them):
    the scaled loss maps back to its value, and the step ends with its scale and skip."""
    scale, step = cls.scale, cls.step
    cls.scale = lambda scaler, outputs: steps.scaled(scale(scaler, outputs), outputs)
    cls.step = lambda scaler, optimizer, *args, **kwargs: steps.scaler_step(
        scaler, optimizer, functools.partial(step, scaler, optimizer, *args, **kwargs))
