"""Loss levels, and the limits that the fp32 reference's own run-to-run spread sets on a gap.

Pure functions over loss curves: no torch, no files, no clocks. The fp32 reference runs a second
time with the same seed and data, its initial parameters perturbed once by about one bf16
rounding: it differs from fp32 only numerically, as a candidate does. How far it drifts is how
much this workload amplifies a perturbation of precision's size, and a candidate's gap from fp32
(its progress and its final loss level) is judged against a multiple of it, never against less
than the fixed thresholds. The rule and its measured figures are in docs/stability.md,
"Calibration to the workload".
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


def smooth(losses: Sequence[float], window: int) -> tuple[float, ...]:
    """Trailing moving median of a loss curve, leaving out non-finite values.

    Args:
        losses: one loss per step.
        window: how many steps each median covers (the step itself and the ones before it).

    Returns:
        One value per step: the median of the finite losses among the last ``window`` steps,
        NaN where there are none.
    """
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"smooth.window must be an integer >= 1, got {window!r}")
    return tuple(median_finite(losses[max(0, i + 1 - window) : i + 1]) for i in range(len(losses)))


def levels(losses: Sequence[float], window: int) -> tuple[float, float]:
    """Smoothed start and end levels: medians of the finite losses of the first/last windows."""
    finite = [v for v in losses if math.isfinite(v)]
    return median_finite(finite[:window]), median_finite(finite[-window:])


def median_finite(values: Sequence[float]) -> float:
    """The median of the finite values, NaN when there are none."""
    finite = sorted(v for v in values if math.isfinite(v))
    if not finite:
        return math.nan
    mid = len(finite) // 2
    return finite[mid] if len(finite) % 2 else (finite[mid - 1] + finite[mid]) / 2.0


GEOMETRIC_FALL = 2.0
"""A smoothed loss that fell by this factor or more over the last quarter of a trial is still
falling geometrically: where it will level off (fp32 heading towards zero, a 16-bit mode stopping
at a floor) the window has not shown yet."""


SEEN_FALL = 2.0**-24
"""A loss that has fallen to this fraction of its start has shown every 16-bit format's floor:
a prediction rounded to fp16's 11 significant bits errs by 2^-12 of itself, a squared error by
about 2^-24, so a floor lies above this. Falling further changes no verdict."""


def still_falling(losses: Sequence[float], window: int) -> float | None:
    """The factor by which a positive loss fell over the last quarter of the steps, when that is
    at least ``GEOMETRIC_FALL`` and the loss is still above ``SEEN_FALL`` of its start; ``None``
    otherwise (levelling off, rising, not positive, or already far enough down).

    Levels are medians of ``window`` steps, the end level over the last window and the earlier
    one over the window that ended a quarter of the steps before.
    """
    finite = [v for v in losses if math.isfinite(v)]
    quarter = len(finite) // 4
    if quarter < 1 or len(finite) < 2 * window:
        return None
    end = median_finite(finite[-window:])
    if end <= median_finite(finite[:window]) * SEEN_FALL:
        return None
    before = median_finite(finite[max(0, len(finite) - quarter - window) : len(finite) - quarter])
    if not (end > 0 and before > 0):
        return None
    factor = before / end
    return factor if factor >= GEOMETRIC_FALL else None


def final_gap(candidate_end: float, reference_end: float, reference_drop: float) -> float:
    """How far a smoothed final loss ends above fp32's, as a fraction.

    Relative to fp32's own final loss whenever that is positive, so that a loss heading towards
    zero is compared where it ends: 0.5 against fp32's 0.1 is 400% higher, however far both
    fell. A final loss at or below zero has no scale of its own; there the gap is taken relative
    to the larger of its size and how far fp32's loss fell.
    """
    if reference_end > 0:
        return (candidate_end - reference_end) / reference_end
    return (candidate_end - reference_end) / max(abs(reference_end), reference_drop, 1e-12)


@dataclass(frozen=True)
class Spread:
    """How far the perturbed fp32 replicate drifted from the fp32 reference.

    Attributes:
        reference_start: fp32's smoothed start level.
        reference_end: fp32's smoothed final loss.
        replicate_start: the replicate's smoothed start level.
        replicate_end: the replicate's smoothed final loss.
    """

    reference_start: float
    reference_end: float
    replicate_start: float
    replicate_end: float

    @property
    def end_gap(self) -> float:
        """The distance between the two final losses, in loss units."""
        return abs(self.replicate_end - self.reference_end)

    @property
    def fall_gap(self) -> float:
        """The distance between the two falls, each from its own start, in loss units."""
        return abs((self.replicate_start - self.replicate_end) - (self.reference_start - self.reference_end))

    def final_spread(self, reference_drop: float) -> float:
        """The replicate's final gap from fp32, measured as a candidate's is, as a fraction
        (either direction: a replicate ending below fp32 is as far from it)."""
        return abs(final_gap(self.replicate_end, self.reference_end, reference_drop))

    def progress_spread(self, reference_drop: float) -> float:
        """How far the replicate's fall, from its own start, differs from fp32's, as a fraction
        of fp32's fall: the shortfall in progress that one rounding causes on this workload."""
        return self.fall_gap / reference_drop if reference_drop > 0 else math.inf


def measure_spread(
    reference: Sequence[float], replicate: Sequence[float], window: int
) -> Spread | None:
    """The spread between the fp32 reference and its replicate, over the same compared steps.

    Args:
        reference: fp32's losses over the compared steps.
        replicate: the replicate's losses, at least as many steps.
        window: the smoothing window, in steps.

    Returns:
        The spread, or ``None`` when the replicate is shorter than the compared steps or not
        finite on every one of them (fp32 that diverges under a seed measures no spread): then
        the fixed thresholds apply alone.
    """
    replicate = replicate[: len(reference)]
    if len(replicate) < len(reference) or not all(math.isfinite(v) for v in replicate):
        return None
    reference_start, reference_end = levels(reference, window)
    replicate_start, replicate_end = levels(replicate, window)
    if not math.isfinite(reference_end):
        return None
    return Spread(reference_start, reference_end, replicate_start, replicate_end)


@dataclass(frozen=True)
class Limits:
    """The progress and final-gap limits of one comparison: fixed floors, widened to the spread.

    Attributes:
        min_progress_ratio: the fixed floor of the progress limit.
        max_final_gap: the fixed floor of the final-gap limit.
        multiplier: how many times fp32's spread a candidate's gap may reach.
        reference_drop: how far fp32's smoothed loss fell, in loss units.
        spread: the measured spread; ``None`` leaves the floors alone.
        final_gap_cap: the most the spread may widen the final-gap limit to: a candidate ending
            further above fp32 than this is never stable, however sensitive the workload.
    """

    min_progress_ratio: float
    max_final_gap: float
    multiplier: float
    reference_drop: float
    spread: Spread | None = None
    final_gap_cap: float = 1.0

    @property
    def fell_within_spread(self) -> bool:
        """fp32's loss fell, but no further than the multiple of the replicate's difference in
        fall a gap may reach: whether a candidate kept pace cannot be told."""
        if self.spread is None:
            return False
        return 0 < self.reference_drop <= self.multiplier * self.spread.fall_gap

    @property
    def progress(self) -> float:
        """The least progress ratio a candidate needs."""
        if self.spread is None:
            return self.min_progress_ratio
        shortfall = self.multiplier * self.spread.progress_spread(self.reference_drop)
        return min(self.min_progress_ratio, 1.0 - shortfall)

    @property
    def final_gap(self) -> float:
        """The largest final gap a candidate may have: ``multiplier`` times the replicate's,
        never below the fixed floor, never above ``final_gap_cap`` (unless the floor is)."""
        if self.spread is None:
            return self.max_final_gap
        widened = min(self.multiplier * self.spread.final_spread(self.reference_drop), self.final_gap_cap)
        return max(self.max_final_gap, widened)

    @property
    def capped(self) -> bool:
        """Whether the replicate's spread asked for more than ``final_gap_cap``."""
        return (self.spread is not None
                and self.multiplier * self.spread.final_spread(self.reference_drop) > self.final_gap_cap)

    def metrics(self) -> dict[str, float]:
        """The spread as measured and the limits it set, for a verdict; empty without one.

        The progress spread is left out where fp32's loss did not fall (nothing to compare), and
        the progress limit where that fall is within the spread (progress is not judged).
        """
        if self.spread is None:
            return {}
        out = {"replicate_end": self.spread.replicate_end,
               "final_spread": self.spread.final_spread(self.reference_drop),
               "final_gap_limit": self.final_gap}
        if self.reference_drop > 0:
            out["progress_spread"] = self.spread.progress_spread(self.reference_drop)
            if not self.fell_within_spread:
                out["progress_limit"] = self.progress
        return out

    def describe(self, which: str, suffix: str = "") -> str:
        """``"limit 76%, set by fp32 perturbed by one rounding falling 12% short of it (2x)"``.

        Args:
            which: ``"progress"`` or ``"final"``.
            suffix: words after the limit, e.g. ``" higher"``.
        """
        if which == "progress":
            limit, floor = self.progress, self.min_progress_ratio
        else:
            limit, floor = self.final_gap, self.max_final_gap
        text = f"limit {_pct(limit)}{suffix}"
        if self.spread is None or limit == floor:
            return text
        times = f"{self.multiplier:g}x"
        if which == "progress":
            measured = self.spread.progress_spread(self.reference_drop)
            return f"{text}, set by fp32 perturbed by one rounding, whose fall differed by {_pct(measured)} ({times})"
        measured = self.spread.final_spread(self.reference_drop)
        if self.capped:
            return (f"{text}, the most allowed: fp32 perturbed by one rounding ended {_pct(measured)} apart, "
                    "so this workload's final loss is very sensitive")
        return f"{text}, set by fp32 perturbed by one rounding ending {_pct(measured)} apart ({times})"

    def flat_note(self, reference_curve: str) -> str:
        """The clause saying that fp32's fall is within its spread (``reference_curve`` names
        it, ``"fp32's 2.0 -> 1.95"``), so progress was not judged; empty otherwise."""
        if self.spread is None or not self.fell_within_spread:
            return ""
        return (
            f"{reference_curve} is a fall within {self.multiplier:g}x the "
            f"{self.spread.fall_gap:.4g} by which fp32 perturbed by one rounding fell differently, so "
            "progress cannot be compared and only the final loss is judged; "
        )


def _pct(fraction: float) -> str:
    return f"{fraction:.0%}" if abs(fraction) >= 0.1 else f"{fraction:.1%}"
