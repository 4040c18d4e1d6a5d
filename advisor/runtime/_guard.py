"""The guard (docs/reference.md, "The guard"): watches a long run's optimizer steps for what a
short trial cannot see, with the stability verdicts' own limits. Its slow signals are the loss's
trend in windows of steps (behind fp32's curve, or climbing above its best window, on quartiles
so that a noisy loss or one heading to zero trips nothing) and, since a flat loss cannot be told
from convergence, updates lost to rounding in the pure 16-bit modes (a stall). The decisions
are pure functions of the values fed in."""

from __future__ import annotations

import math
import os
import statistics
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from probes import MpadviseError

GUARD_ENV = "MPADVISE_GUARD"  # turns the guard on: warn, fallback or off
GUARD_SETTINGS = ("off", "warn", "fallback")  # from nothing to the most

NON_FINITE = "non-finite loss"
SKIP_RATE = "skip rate"
SCALE_COLLAPSE = "loss-scale collapse"
BEHIND = "behind fp32"
CLIMB = "loss climb"
STALL = "stall"


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
    # Non-finite losses in a row that trip even where the scaler skipped each (one is its job).
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
    """What the guard saw: the signal, the optimizer steps (from 1) where it began and tripped,
    the mode in force, the safer mode moved to or that would be (``None``: none runs here), the
    ``action`` (``"warned"``, ``"fell back"``, ``"restart needed"``), and the figures for people."""

    signal: str
    step: int
    tripped_at: int
    policy: str
    fallback: str | None
    action: str
    detail: str = ""

    def to_dict(self) -> dict[str, Any]:
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
    """The guard's state over a run: fed each optimizer step, it says when a signal trips
    (``tripped`` until ``rearm``: a warning is said once).

    Args:
        setting: ``"warn"`` or ``"fallback"`` (``"off"`` makes a guard that never trips).
        limits: when the signals trip.
        reference: fp32's loss per optimizer step, where the tune recorded it.
        trend: whether the loss's trend and lost updates are watched: only where a safer mode
            exists, since a climb that fp32 would show too is the schedule's, not the precision's.
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
        """Take optimizer step ``step``'s facts (counted from 1): its last micro-batch's loss,
        whether it was applied (not skipped by the scaler), the loss scale after it (``None``
        without a scaler, or not read on an applied step, which cannot lower it), and the
        fraction of updates ``probe`` found lost, where it looked. Returns ``(signal, onset
        step, detail)`` the first time a signal trips, else ``None``."""
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
        self.events.append(event)  # it goes into state_dict

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


def quartiles(values: Sequence[float]) -> tuple[float, float]:
    """The first and third quartiles of ``values`` (at least two)."""
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], q[2]


def above(low: float, high: float, margin: float) -> bool:
    """Whether a first quartile ``low`` lies above a third quartile ``high`` by over ``margin``."""
    return low > high + margin * abs(high)


class LossTrend:
    """Windows of ``window`` applied steps' finite losses, checked against ``reference`` (fp32's
    loss per optimizer step in the tune, where recorded) by ``gap_margin``, and against the best
    window so far by ``climb_margin``, which must hold ``windows`` windows in a row."""

    def __init__(self, window: int, windows: int, climb_margin: float, gap_margin: float,
                 reference: Sequence[float] = ()) -> None:
        self.window, self.windows = window, windows
        self.climb_margin, self.gap_margin = climb_margin, gap_margin
        self.reference = [float(v) for v in reference]
        self.losses: list[float] = []
        self.start = 0  # the optimizer step of the current window's first loss
        self.best: tuple[float, float] | None = None  # the best window's quartiles
        self.climbs = self.climb_since = 0  # windows in a row that climbed, from this step

    def add(self, step: int, loss: float) -> tuple[str, int, str] | None:
        """One applied step's finite loss; the signal that holds now, if any."""
        if not self.losses:
            self.start = step
        self.losses.append(loss)
        if len(self.losses) < self.window:
            return None
        low, high = quartiles(self.losses)
        start, self.losses = self.start, []
        found = self._behind(start, step, low) or self._climb(start, low)
        if self.best is None or high < self.best[1]:
            self.best = (low, high)
        return found

    def _behind(self, start: int, end: int, low: float) -> tuple[str, int, str] | None:
        if end > len(self.reference) or end + self.window <= len(self.reference):
            return None  # not the last whole window the run shares with fp32's curve
        shared = self.reference[start - 1:end]
        if not all(math.isfinite(v) for v in shared):
            return None
        ref_high = quartiles(shared)[1]
        if not above(low, ref_high, self.gap_margin):
            return None
        return (BEHIND, start, f"the loss's lower quartile {low:.4g} over steps {start}-{end}, above fp32's upper "
                f"quartile {ref_high:.4g} in the tune by more than {self.gap_margin:.0%}")

    def _climb(self, start: int, low: float) -> tuple[str, int, str] | None:
        if self.best is None:
            return None
        if not above(low, self.best[1], self.climb_margin):
            self.climbs = 0
            return None
        if self.climbs == 0:
            self.climb_since = start
        self.climbs += 1
        if self.climbs < self.windows:
            return None
        return (CLIMB, self.climb_since, f"the loss's lower quartile {low:.4g}, above the best window's upper "
                f"quartile {self.best[1]:.4g} by more than {self.climb_margin:.0%}, {self.windows} windows "
                f"of {self.window} steps in a row")

    def state_dict(self) -> dict[str, Any]:
        # "runs" and "since" keep the checkpoint format of a climb counter keyed by signal.
        return {"losses": list(self.losses), "start": self.start, "best": self.best,
                "runs": {CLIMB: self.climbs}, "since": {CLIMB: self.climb_since}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.losses = [float(v) for v in state.get("losses", ())]
        self.start = int(state.get("start", 0))
        best = state.get("best")
        self.best = None if best is None else (float(best[0]), float(best[1]))
        self.climbs = int(state.get("runs", {}).get(CLIMB, self.climbs))
        self.climb_since = int(state.get("since", {}).get(CLIMB, self.climb_since))


class UpdateProbe:
    """Every ``every`` optimizer steps, the fraction of sampled 16-bit parameter elements (at
    most ``sample`` from each) that had a gradient and did not change in the step."""

    def __init__(self, every: int, sample: int = 1024) -> None:
        self.every, self.sample = every, sample
        self._before: list[tuple[Any, Any, Any]] | None = None

    def before(self, step: int, params: Iterable[Any]) -> None:
        """Keep a sample of each 16-bit parameter with a gradient, and which elements have one."""
        import torch

        self._before = None
        if step % self.every:
            return
        taken = []
        for p in params:
            if p.grad is not None and p.dtype in (torch.bfloat16, torch.float16):
                values = p.detach().reshape(-1)[:self.sample].clone()
                taken.append((p, values, p.grad.detach().reshape(-1)[:self.sample] != 0))
        self._before = taken or None

    def lost(self) -> float | None:
        """After the step: the fraction of sampled updates lost, or ``None`` where none was probed."""
        if self._before is None:
            return None
        changed = eligible = 0
        for p, before, wanted in self._before:
            moved = p.detach().reshape(-1)[:before.numel()] != before
            changed += (moved & wanted).sum()
            eligible += wanted.sum()
        self._before = None
        total = int(eligible)  # the probe's one sync, every ``every`` steps
        return None if total == 0 else 1.0 - int(changed) / total
