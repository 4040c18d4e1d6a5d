"""A candidate curve against the fp32 reference: the measurements the stability rules share."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property

from advisor.tune import _spread
from advisor.tune._curves import StabilityThresholds, TrialCurve
from policies import PrecisionMode, mode_class
from probes import MpadviseError

# Below this, a loss level is treated as zero when it divides (avoids dividing by 0.0).
TINY = 1e-12


@dataclass(frozen=True)
class ScalerStats:
    """What the loss scaler did after calibration."""

    calibration: int  # steps whose skips are calibration
    scales: list[float]  # every recorded loss scale
    skips: int  # skipped steps after calibration
    judged_steps: int  # steps after calibration
    skip_fraction: float
    underflow: list[float]  # per-step underflow fractions after calibration (all if none)


@dataclass(frozen=True)
class Levels:
    """Smoothed start and end levels of both curves, and how each moved."""

    c_start: float
    c_end: float
    r_start: float
    r_end: float
    r_drop: float  # how far the reference fell
    ref_drop_rel: float  # ... as a fraction of its start
    cand_rise_rel: float  # how far the candidate rose, as a fraction of its start


@dataclass
class CurveComparison:
    """A candidate curve against the reference. Each measurement is computed on first use and
    recorded in ``metrics`` then, so a verdict carries exactly the numbers computed up to its check."""

    candidate: TrialCurve
    reference: TrialCurve
    t: StabilityThresholds
    replicate: TrialCurve | None = None
    metrics: dict[str, float | int | bool] = field(default_factory=dict)

    @cached_property
    def name(self) -> str:
        """The mode as named in reasons: the mode class's label, or the name as given."""
        cls = _mode_class(self.candidate.mode)
        return self.candidate.mode if cls is None else cls.label()

    @property
    def ref_name(self) -> str:
        return self.reference.mode

    @cached_property
    def n(self) -> int:
        return min(len(self.candidate), len(self.reference))

    def advice(self, kind: str) -> str:
        """The mode class's advice after a failure ``kind`` (or ``"climbed"``); a mode that is not
        registered gets the generic advice."""
        cls = _mode_class(self.candidate.mode) or PrecisionMode
        return cls.advice(kind, optimizer_eps=self.candidate.optimizer_eps)

    @cached_property
    def window(self) -> int:
        n = self.n
        window = self.t.smoothing_window(n)
        self.metrics.update(steps=n, smoothing_window=window)
        return window

    @cached_property
    def scaler(self) -> ScalerStats:
        n, candidate = self.n, self.candidate
        cal = min(self.t.calibration_steps, n)
        scales = [s for s in candidate.loss_scale[:n] if s is not None]
        if scales:
            self.metrics["min_scale"] = min(scales)
        skips = sum(candidate.was_skipped(i) for i in range(cal, n))
        judged_steps = n - cal
        skip_fraction = skips / judged_steps if judged_steps else 0.0
        self.metrics["skips_after_calibration"] = skips
        self.metrics["skip_fraction"] = skip_fraction
        under_all = [u for u in candidate.underflow[:n] if u is not None]
        under = [u for u in candidate.underflow[cal:n] if u is not None] or under_all
        if under:
            self.metrics["mean_underflow"] = sum(under) / len(under)
            self.metrics["max_underflow"] = max(under)
        return ScalerStats(cal, scales, skips, judged_steps, skip_fraction, under)

    @cached_property
    def levels(self) -> Levels:
        n, window = self.n, self.window
        c_start, c_end = _spread.levels(self.candidate.losses[:n], window)
        r_start, r_end = _spread.levels(self.reference.losses[:n], window)
        r_drop = r_start - r_end
        ref_drop_rel = r_drop / max(abs(r_start), TINY)
        cand_rise_rel = (c_end - c_start) / max(abs(c_start), TINY)
        self.metrics.update(
            candidate_start=c_start, candidate_end=c_end, reference_start=r_start,
            reference_end=r_end, reference_drop=ref_drop_rel, candidate_rise=cand_rise_rel,
        )
        return Levels(c_start, c_end, r_start, r_end, r_drop, ref_drop_rel, cand_rise_rel)

    @cached_property
    def limits(self) -> _spread.Limits:
        """The progress and final-gap limits: the fixed ones, widened to the replicate's spread."""
        t, replicate = self.t, self.replicate if self.t.spread_multiplier > 0 else None
        spread = None if replicate is None else _spread.measure_spread(
            self.reference.losses[: self.n], replicate.losses, self.window)
        limits = _spread.Limits(t.min_progress_ratio, t.max_final_gap, t.spread_multiplier,
                                self.levels.r_drop, spread, t.max_spread_final_gap)
        self.metrics.update(limits.metrics())
        return limits

    @cached_property
    def reference_flat(self) -> bool:
        """fp32's loss did not fall, or fell within its own spread: no decrease to compare."""
        lv = self.levels
        flat = lv.r_drop <= 0 or lv.ref_drop_rel < self.t.min_reference_drop
        flat = flat or self.limits.fell_within_spread
        self.metrics["reference_flat"] = flat
        return flat

    @cached_property
    def final_gap(self) -> float:
        lv = self.levels
        gap = _spread.final_gap(lv.c_end, lv.r_end, lv.r_drop)
        self.metrics["final_gap"] = gap
        return gap


def _mode_class(mode: str) -> type[PrecisionMode] | None:
    try:
        return mode_class(mode)
    except MpadviseError:
        return None


def first_nonfinite(losses: Sequence[float], skipped: Callable[[int], bool]) -> int | None:
    """Index of the first non-finite loss on a step that was not skipped, or None."""
    for i, v in enumerate(losses):
        if not math.isfinite(v) and not skipped(i):
            return i
    return None


def nonfinite_tail(losses: Sequence[float], window: int) -> int | None:
    """Start of a trailing run of non-finite losses at least ``window`` long, or None."""
    start = len(losses)
    while start > 0 and not math.isfinite(losses[start - 1]):
        start -= 1
    return start if len(losses) - start >= window else None
