"""The guard: watches a long run's optimizer steps for what a short trial cannot see (activations
outgrowing fp16 as the weights grow, a loss scale that keeps halving, a decayed learning rate
whose 16-bit updates round away): non-finite losses, the GradScaler's skip rate, a loss scale
below its floor, and the loss's trend (``_trend``). Its limits are the stability verdicts' own,
so a run that a trial would judge stable never trips them. On a trip, ``warn`` logs one line
once and ``fallback`` moves to ``guard_fallback``'s safer policy; the decision is a pure
function of the values fed in.
"""

from __future__ import annotations

import math
import os
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from advisor.runtime._trend import STALL, LossTrend, UpdateProbe
from probes import MpadviseError

GUARD_ENV = "MPADVISE_GUARD"  # turns the guard on: warn, fallback or off
GUARD_SETTINGS = ("off", "warn", "fallback")  # from nothing to the most

NON_FINITE = "non-finite loss"
SKIP_RATE = "skip rate"
SCALE_COLLAPSE = "loss-scale collapse"


def guard_setting(given: str | None, environ: Mapping[str, str] = os.environ) -> str:
    """The guard setting in force: ``given``, else ``MPADVISE_GUARD``, else ``"off"``; an
    MpadviseError naming where a value that is not one of ``GUARD_SETTINGS`` came from."""
    where, value = ("guard=", given) if given is not None else (f"{GUARD_ENV}=", environ.get(GUARD_ENV, ""))
    value = (value or "off").strip().lower()
    if value not in GUARD_SETTINGS:
        raise MpadviseError(f"{where}{value!r} is not a guard setting; expected one of {', '.join(GUARD_SETTINGS)}")
    return value


@dataclass(frozen=True)
class GuardLimits:
    """When a signal trips (the trend's margins are the verdicts' climb limit and final gap)."""

    window: int = 50  # optimizer steps over which the skip rate is counted
    calibration_steps: int = 16  # the first steps, whose skips are the scaler finding its scale
    # At least two skips per window are always allowed: a healthy scaler skips once per growth.
    max_skip_fraction: float = 0.05
    min_loss_scale: float = 1.0  # a loss scale below this is a collapse
    # This many non-finite losses in a row trip even where the scaler skipped each step (one
    # such step is the scaler doing its job).
    non_finite_run: int = 3
    loss_window: int = 25  # optimizer steps per window of the loss's trend
    trend_windows: int = 2  # windows (or probes) in a row a trend signal must hold
    climb_margin: float = 0.05
    gap_margin: float = 0.05
    probe_every: int = 25  # optimizer steps between two looks at updates lost to rounding
    max_lost_fraction: float = 0.5  # more sampled updates lost than this, in a probe, is a stall

    @classmethod
    def from_thresholds(cls, thresholds: Any) -> GuardLimits:
        """The limits the stability verdicts use (a tune's ``StabilityThresholds``)."""
        return cls(calibration_steps=thresholds.calibration_steps,
                   max_skip_fraction=thresholds.max_skip_fraction,
                   min_loss_scale=thresholds.min_loss_scale, climb_margin=thresholds.climb_margin,
                   gap_margin=thresholds.max_final_gap)

    @property
    def max_skips(self) -> int:
        """Skips a window may hold before it trips."""
        return max(2, math.floor(self.max_skip_fraction * self.window))


@dataclass(frozen=True)
class GuardEvent:
    """What the guard saw: the signal, the optimizer step (from 1) where it began and the one
    where it tripped, the mode in force, the safer mode moved to (or that would be; ``None``
    where none runs here), the ``action`` (``"warned"``, ``"fell back"``, or ``"restart
    needed"`` where a framework cannot change precision in place), and the figures, for people."""

    signal: str
    step: int
    tripped_at: int
    policy: str
    fallback: str | None
    action: str
    detail: str = ""

    def to_dict(self) -> dict[str, Any]:
        """Plain data for the cache and checkpoints."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> GuardEvent:
        """The inverse of ``to_dict``; unknown keys are refused, naming them."""
        unknown = set(data) - set(cls.__dataclass_fields__)
        if unknown:
            raise MpadviseError(f"guard event: unknown fields {', '.join(sorted(unknown))}")
        return cls(**data)

    def line(self) -> str:
        """The one line a person reads."""
        where = f"began at optimizer step {self.step}" + (
            f", tripped at {self.tripped_at}" if self.tripped_at != self.step else "")
        head = f"guard: {self.signal} under {self.policy} ({where}; {self.detail})"
        if self.action == "fell back":
            return f"{head}; the step was not applied and training goes on under {self.fallback}"
        safer = self.fallback or "a safer mode"
        if self.action == "restart needed":
            return (f"{head}; this script's precision cannot change in place: restart the run, and the next "
                    f"`mpadvise run` or load_policy() applies {safer}")
        return (f"{head}; rerun with --guard fallback (or MPADVISE_GUARD=fallback) to move to {safer} "
                f"in place, or tune for {safer}")


class Guard:
    """The guard's state over a run: fed each optimizer step, it says when a signal trips.

    Args:
        setting: ``"warn"`` or ``"fallback"`` (``"off"`` makes a guard that never trips).
        limits: when the signals trip.
        reference: fp32's loss per optimizer step, where the tune recorded it.
        trend: whether the loss's trend and lost updates are watched: only where a safer mode
            exists, since a climb that fp32 would show too is the schedule's, not the precision's.

    ``tripped``: whether a signal tripped since the last ``rearm`` (a warning is said once).
    """

    def __init__(self, setting: str, limits: GuardLimits | None = None, reference: Sequence[float] = (),
                 trend: bool = True) -> None:
        self.setting, self.active = setting, setting != "off"
        self.limits = limits or GuardLimits()
        self.reference, self.trend_on = tuple(reference), trend
        self.events: list[GuardEvent] = []
        self.rearm()

    def rearm(self) -> None:
        """Watch afresh (after a fallback, under the new policy)."""
        limits = self.limits
        self._skips: deque[int] = deque()  # optimizer steps the scaler skipped, within the window
        self._non_finite_since: int | None = None
        self._collapse_since: int | None = None
        self.tripped = False
        self.trend = LossTrend(limits.loss_window, limits.trend_windows, limits.climb_margin, limits.gap_margin,
                               self.reference)
        self.probe = UpdateProbe(limits.probe_every)
        self._stall: list[int] = []  # the probes in a row that lost too many updates

    def observe(self, step: int, *, loss: float, applied: bool, loss_scale: float | None,
                lost: float | None = None) -> tuple[str, int, str] | None:
        """Take one optimizer step's facts; the signal that trips now, if any.

        Args:
            step: the optimizer step, counted from 1.
            loss: the step's loss value (the last micro-batch's).
            applied: whether the optimizer step was applied (not skipped by the scaler).
            loss_scale: the scale after the step, or ``None`` without a scaler or where not read
                (a step the scaler applied: only a skip lowers it).
            lost: the fraction of updates ``probe`` found lost in this step, where it looked.

        Returns:
            ``(signal, onset step, detail)`` the first time a signal trips, else ``None``.
        """
        if not self.active or self.tripped:
            return None
        found = self._non_finite(step, loss, applied) or self._skip_rate(step, applied) or self._collapse(step, loss_scale)
        if found is None and self.trend_on and applied and math.isfinite(loss):
            found = self.trend.add(step, loss) or self._stalled(step, lost)
        if found is not None:
            self.tripped = True
        return found

    def _non_finite(self, step: int, loss: float, applied: bool) -> tuple[str, int, str] | None:
        if math.isfinite(loss):
            self._non_finite_since = None
            return None
        if self._non_finite_since is None:
            self._non_finite_since = step
        run = step - self._non_finite_since + 1
        if applied:
            return NON_FINITE, self._non_finite_since, f"loss {loss} on a step the optimizer applied"
        if run >= self.limits.non_finite_run:
            return NON_FINITE, self._non_finite_since, f"{run} non-finite losses in a row"
        return None

    def _skip_rate(self, step: int, applied: bool) -> tuple[str, int, str] | None:
        if applied or step <= self.limits.calibration_steps:
            return None
        self._skips.append(step)
        while self._skips and self._skips[0] <= step - self.limits.window:
            self._skips.popleft()
        if len(self._skips) > self.limits.max_skips:
            return (SKIP_RATE, self._skips[0],
                    f"{len(self._skips)} of the last {self.limits.window} optimizer steps skipped by the GradScaler")
        return None

    def _collapse(self, step: int, loss_scale: float | None) -> tuple[str, int, str] | None:
        if loss_scale is None:  # not read: an applied step, on which the scale cannot have fallen
            return None
        if loss_scale >= self.limits.min_loss_scale * 2:
            self._collapse_since = None
            return None
        # Onset: the first step of the fall that ends below the floor (the scale within a
        # halving of it), which is where the overflow began to win.
        if self._collapse_since is None:
            self._collapse_since = step
        if loss_scale < self.limits.min_loss_scale:
            return (SCALE_COLLAPSE, self._collapse_since,
                    f"loss scale {loss_scale:g}, below the floor {self.limits.min_loss_scale:g}")
        return None

    def _stalled(self, step: int, lost: float | None) -> tuple[str, int, str] | None:
        if lost is None:
            return None
        self._stall = [*self._stall, step] if lost > self.limits.max_lost_fraction else []
        if len(self._stall) < self.limits.trend_windows:
            return None
        return (STALL, self._stall[0], f"{lost:.0%} of sampled updates lost to rounding in step {step}, "
                f"{len(self._stall)} looks in a row {self.limits.probe_every} steps apart")

    def record(self, event: GuardEvent) -> None:
        """Keep ``event`` (it goes into ``state_dict``)."""
        self.events.append(event)

    def state_dict(self) -> dict[str, Any]:
        """The window and the events, for a checkpoint."""
        return {"setting": self.setting, "skips": list(self._skips), "tripped": self.tripped,
                "non_finite_since": self._non_finite_since, "collapse_since": self._collapse_since,
                "trend": self.trend.state_dict(), "stall": list(self._stall),
                "events": [event.to_dict() for event in self.events]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what ``state_dict`` returned; the setting stays this run's."""
        self._skips = deque(int(step) for step in state.get("skips", ()))
        self._non_finite_since = state.get("non_finite_since")
        self._collapse_since = state.get("collapse_since")
        self.tripped = bool(state.get("tripped", False))
        self.trend.load_state_dict(state.get("trend", {}))
        self._stall = [int(step) for step in state.get("stall", ())]
        self.events = [GuardEvent.from_dict(event) for event in state.get("events", ())]
