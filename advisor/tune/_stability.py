"""Stability verdicts: is a candidate's loss curve as good as the fp32 reference's?

Pure functions over recorded trial data: no torch, no files, no clocks. A trial records one
``TrialCurve`` per precision mode, all with the same seed and data order, so the candidate
and the fp32 reference can be compared step by step. ``judge`` turns the pair into a
``Verdict`` whose reason says, with numbers, what went wrong and what to do. Given fp32 run again
with its initial parameters perturbed by one rounding (the replicate), the limits widen to how
far that perturbation carried it on this workload (``_spread``).

The data types are in ``_curves``, the shared measurements in ``_comparison`` and the checks, in
order, in ``_verdict_rules``; ``basis`` shows what ``judge`` measured, for the trial's plot.
The defaults of ``StabilityThresholds`` and the evidence for them are in docs/stability.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from advisor.tune import _spread
from advisor.tune._comparison import TINY, CurveComparison, first_nonfinite
from advisor.tune._curves import VERDICT_KINDS as VERDICT_KINDS
from advisor.tune._curves import StabilityThresholds as StabilityThresholds
from advisor.tune._curves import TrialCurve as TrialCurve
from advisor.tune._curves import Verdict as Verdict
from advisor.tune._spread import smooth as smooth  # re-exported: part of this module's surface
from advisor.tune._verdict_rules import STABILITY_CHECKS, stable_verdict
from policies import safety_order
from policies import safety_rank as safety_rank  # re-exported: the search ranks ties with it


def __getattr__(name: str) -> tuple[str, ...]:
    # SAFETY_ORDER (the modes from safest to least safe) is derived from the registered mode
    # classes on every lookup, so a mode registered later is ranked too.
    if name == "SAFETY_ORDER":
        return safety_order()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def judge(
    candidate: TrialCurve,
    reference: TrialCurve,
    thresholds: StabilityThresholds | None = None,
    *,
    replicate: TrialCurve | None = None,
) -> Verdict:
    """Decide whether a candidate's trial curve is as stable as the fp32 reference's.

    Both curves come from the same seed and data order and are compared step by step over
    their common length. The checks of ``STABILITY_CHECKS`` run in order, and the first that
    fails gives the verdict: a non-finite reference (no verdict possible), a non-finite
    candidate loss on a step the optimizer applied (diverged), too few steps, a non-finite
    tail (diverged), loss-scale collapse, persistent skips, gradient underflow, a climbing loss
    (diverged), too little progress (stalled) and too large a final gap (stalled).
    Non-finite losses on steps the GradScaler skipped are the scaler doing its job: they count
    as skips, not divergence. With a replicate, the progress and final-gap limits widen to
    ``spread_multiplier`` times how far one rounding carried fp32, never below the fixed ones.

    Args:
        candidate: the curve of the precision mode under test.
        reference: the fp32 curve of the same trial.
        thresholds: the limits; the defaults when ``None``.
        replicate: fp32 again with its initial parameters perturbed by one rounding, at least
            as long as the compared steps; ``None`` (or one too short, or not finite) leaves the
            fixed limits.

    Returns:
        The verdict, with a reason in words and the numbers behind it.
    """
    comparison = _compare(candidate, reference, thresholds, replicate)
    for check in STABILITY_CHECKS:
        verdict = check(comparison)
        if verdict is not None:
            return verdict
    return stable_verdict(comparison)


def _compare(
    candidate: TrialCurve,
    reference: TrialCurve,
    thresholds: StabilityThresholds | None,
    replicate: TrialCurve | None,
) -> CurveComparison:
    """The comparison ``judge`` decides on and ``basis`` shows: one construction for both."""
    return CurveComparison(
        candidate, reference, StabilityThresholds() if thresholds is None else thresholds, replicate,
    )


@dataclass(frozen=True)
class Basis:
    """What ``judge`` measures on the way to a verdict, for showing it (``mpadvise trial --plot``).

    Read from the very comparison ``judge`` decides on, so a picture drawn from it shows the
    verdict's own levels and limits. Levels are medians over ``window`` steps (the smoothing of
    docs/stability.md); ``smoothed`` gives a whole curve smoothed the same way.

    Attributes:
        steps: the compared steps (the common length of the two curves).
        window: the smoothing window, in steps.
        candidate_start, candidate_end: the candidate's smoothed start and end levels.
        reference_start, reference_end: fp32's.
        progress_limit: the least fraction of fp32's fall the candidate had to make (the stall
            limit), widened by the replicate's spread where that applies.
        final_gap_limit: the most the candidate's final level may exceed fp32's, as ``judge``
            measures a gap (relative to fp32's final loss).
        climb_margin: how far above its own start the candidate's level may end (divergence).
        reference_flat: progress was not judged (fp32's loss did not fall beyond its noise).
        first_nonfinite_step: the first step (1-based) with a NaN or inf loss that the optimizer
            applied, as the divergence check finds it; ``None`` when there is none.
    """

    steps: int
    window: int
    candidate_start: float
    candidate_end: float
    reference_start: float
    reference_end: float
    progress_limit: float
    final_gap_limit: float
    climb_margin: float
    reference_flat: bool
    first_nonfinite_step: int | None

    def smoothed(self, losses: Sequence[float]) -> tuple[float, ...]:
        """``losses`` over the compared steps, smoothed with the verdict's window (``smooth``)."""
        return smooth(losses[: self.steps], self.window)

    @property
    def progress_level(self) -> float:
        """The smoothed end level the candidate had to reach to keep pace (the stall limit)."""
        return self.candidate_start - self.progress_limit * (self.reference_start - self.reference_end)

    @property
    def final_level(self) -> float:
        """The highest smoothed final level within the final-gap limit (above it, a loss floor or
        a lag). ``_spread.final_gap`` is linear in the candidate's level: its slope sets it."""
        r_end, r_drop = self.reference_end, self.reference_start - self.reference_end
        per_unit = _spread.final_gap(r_end + 1.0, r_end, r_drop)
        return r_end + self.final_gap_limit / per_unit

    @property
    def climb_level(self) -> float:
        """The smoothed end level above which a finite curve counts as diverging."""
        return self.candidate_start + self.climb_margin * max(abs(self.candidate_start), TINY)


def basis(
    candidate: TrialCurve,
    reference: TrialCurve,
    thresholds: StabilityThresholds | None = None,
    *,
    replicate: TrialCurve | None = None,
) -> Basis:
    """The levels and limits ``judge`` applies to these curves (same arguments), without a verdict.

    Returns:
        The ``Basis``; levels are NaN where a curve has no finite loss in a window.
    """
    c = _compare(candidate, reference, thresholds, replicate)
    lv, limits = c.levels, c.limits
    bad = first_nonfinite(candidate.losses, candidate.was_skipped)
    return Basis(
        steps=c.n, window=c.window, candidate_start=lv.c_start, candidate_end=lv.c_end,
        reference_start=lv.r_start, reference_end=lv.r_end, progress_limit=limits.progress,
        final_gap_limit=limits.final_gap, climb_margin=c.t.climb_margin,
        reference_flat=c.reference_flat, first_nonfinite_step=None if bad is None else bad + 1,
    )
