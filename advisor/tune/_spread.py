"""Loss levels, and the limits that the fp32 reference's own run-to-run spread sets on a gap.

A replicate (fp32 with its initial parameters perturbed by about one bf16 rounding) drifts as far
as this workload amplifies a perturbation of precision's size; a candidate's gap is judged against
a multiple of that, never less than the fixed thresholds (docs/stability.md).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass


def smooth(losses: Sequence[float], window: int) -> tuple[float, ...]:
    """Trailing moving median over ``window`` steps of the finite losses (NaN where none)."""
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"smooth.window must be an integer >= 1, got {window!r}")
    return tuple(median_finite(losses[max(0, i + 1 - window) : i + 1]) for i in range(len(losses)))


def levels(losses: Sequence[float], window: int) -> tuple[float, float]:
    """Smoothed start and end levels: medians of the finite losses of the first/last windows."""
    finite = [v for v in losses if math.isfinite(v)]
    return median_finite(finite[:window]), median_finite(finite[-window:])


def median_finite(values: Sequence[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return statistics.median(finite) if finite else math.nan


# A smoothed loss that fell by this factor or more over the last quarter of a trial is still falling:
# where it will level off (fp32 towards zero, a 16-bit mode at a floor) the window has not shown.
GEOMETRIC_FALL = 2.0
# A loss fallen to this fraction of its start has shown every 16-bit format's floor (fp16's 11
# significant bits err by 2^-12, a squared error by about 2^-24).
SEEN_FALL = 2.0**-24


def still_falling(losses: Sequence[float], window: int) -> float | None:
    """The factor by which a positive loss fell over the last quarter of the steps (window
    medians), when at least ``GEOMETRIC_FALL`` and still above ``SEEN_FALL`` of its start; else ``None``."""
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
    """How far a smoothed final loss ends above fp32's, as a fraction of fp32's final loss
    (0.5 against 0.1 is 400% higher); at or below zero, of its size or fp32's fall if larger."""
    if reference_end > 0:
        return (candidate_end - reference_end) / reference_end
    return (candidate_end - reference_end) / max(abs(reference_end), reference_drop, 1e-12)


@dataclass(frozen=True)
class Spread:
    """How far the perturbed fp32 replicate drifted from the fp32 reference (smoothed levels)."""

    reference_start: float
    reference_end: float
    replicate_start: float
    replicate_end: float

    @property
    def fall_gap(self) -> float:
        return abs((self.replicate_start - self.replicate_end) - (self.reference_start - self.reference_end))

    def final_spread(self, reference_drop: float) -> float:
        """The replicate's final gap from fp32, as a candidate's is measured, either direction."""
        return abs(final_gap(self.replicate_end, self.reference_end, reference_drop))

    def progress_spread(self, reference_drop: float) -> float:
        """How far the replicate's fall differs from fp32's, as a fraction of fp32's fall."""
        return self.fall_gap / reference_drop if reference_drop > 0 else math.inf


def measure_spread(reference: Sequence[float], replicate: Sequence[float], window: int) -> Spread | None:
    """The spread between fp32 and its replicate over the compared steps; ``None`` when the
    replicate is shorter or not finite (the fixed thresholds then apply alone)."""
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
    """The progress and final-gap limits of one comparison: fixed floors, widened to the
    spread, the final gap never past ``final_gap_cap``."""

    min_progress_ratio: float
    max_final_gap: float
    multiplier: float
    reference_drop: float
    spread: Spread | None = None
    final_gap_cap: float = 1.0

    @property
    def fell_within_spread(self) -> bool:
        """fp32's loss fell no further than a gap may reach: whether a candidate kept pace
        cannot be told."""
        return self.spread is not None and 0 < self.reference_drop <= self.multiplier * self.spread.fall_gap

    @property
    def progress(self) -> float:
        if self.spread is None:
            return self.min_progress_ratio
        shortfall = self.multiplier * self.spread.progress_spread(self.reference_drop)
        return min(self.min_progress_ratio, 1.0 - shortfall)

    @property
    def final_gap(self) -> float:
        if self.spread is None:
            return self.max_final_gap
        widened = min(self.multiplier * self.spread.final_spread(self.reference_drop), self.final_gap_cap)
        return max(self.max_final_gap, widened)

    @property
    def capped(self) -> bool:
        return (self.spread is not None
                and self.multiplier * self.spread.final_spread(self.reference_drop) > self.final_gap_cap)

    def metrics(self) -> dict[str, float]:
        """The spread and the limits it set, for a verdict's metrics; empty without one."""
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
        """``"limit 76%, set by fp32 perturbed by one rounding ..."``; ``which`` is progress or final."""
        if which == "progress":
            limit, floor = self.progress, self.min_progress_ratio
        else:
            limit, floor = self.final_gap, self.max_final_gap
        text = f"limit {pct(limit)}{suffix}"
        if self.spread is None or limit == floor:
            return text
        times = f"{self.multiplier:g}x"
        if which == "progress":
            measured = self.spread.progress_spread(self.reference_drop)
            return f"{text}, set by fp32 perturbed by one rounding, whose fall differed by {pct(measured)} ({times})"
        measured = self.spread.final_spread(self.reference_drop)
        if self.capped:
            return (f"{text}, the most allowed: fp32 perturbed by one rounding ended {pct(measured)} apart, "
                    "so this workload's final loss is very sensitive")
        return f"{text}, set by fp32 perturbed by one rounding ending {pct(measured)} apart ({times})"

    def flat_note(self, reference_curve: str) -> str:
        """The clause saying fp32's fall is within its spread, so progress was not judged."""
        if self.spread is None or not self.fell_within_spread:
            return ""
        return (f"{reference_curve} is a fall within {self.multiplier:g}x the {self.spread.fall_gap:.4g} by which "
                "fp32 perturbed by one rounding fell differently, so progress cannot be compared and only the "
                "final loss is judged; ")


def pct(fraction: float) -> str:
    return f"{fraction:.0%}" if abs(fraction) >= 0.1 else f"{fraction:.1%}"
