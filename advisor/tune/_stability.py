"""Stability verdicts: is a candidate's loss curve as good as fp32's? The data types are in
``_spread``, the checks in ``_verdict_rules``, the defaults' evidence in docs/stability.md."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from advisor.tune import _spread
from advisor.tune._spread import VERDICT_KINDS, StabilityThresholds, TrialCurve, Verdict, smooth
from advisor.tune._verdict_rules import (
    STABILITY_CHECKS,
    TINY,
    CurveComparison,
    first_nonfinite,
    stable_verdict,
)
from policies import safety_rank

__all__ = ["VERDICT_KINDS", "Basis", "StabilityThresholds", "TrialCurve", "Verdict", "basis",
           "judge", "safety_rank", "smooth"]


def judge(candidate: TrialCurve, reference: TrialCurve,
          thresholds: StabilityThresholds | None = None, *,
          replicate: TrialCurve | None = None) -> Verdict:
    """Whether a candidate's curve is as stable as fp32's over their common length: the first of
    ``STABILITY_CHECKS`` that fails gives the verdict. A ``replicate`` (fp32 with its initial
    parameters perturbed by one rounding) widens the progress and final-gap limits to
    ``spread_multiplier`` times its drift, never below the fixed ones."""
    thresholds = thresholds or StabilityThresholds()
    comparison = CurveComparison(candidate, reference, thresholds, replicate)
    for check in STABILITY_CHECKS:
        verdict = check(comparison)
        if verdict is not None:
            return verdict
    return stable_verdict(comparison)


@dataclass(frozen=True)
class Basis:
    """The levels (medians over ``window`` steps) and limits ``judge`` uses, for ``--plot``."""

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
        return smooth(losses[: self.steps], self.window)

    @property
    def progress_level(self) -> float:  # the smoothed end level that keeps pace
        return self.candidate_start - self.progress_limit * (self.reference_start - self.reference_end)

    @property
    def final_level(self) -> float:  # the highest within the final-gap limit (final_gap is linear)
        r_end, r_drop = self.reference_end, self.reference_start - self.reference_end
        per_unit = _spread.final_gap(r_end + 1.0, r_end, r_drop)
        return r_end + self.final_gap_limit / per_unit

    @property
    def climb_level(self) -> float:
        return self.candidate_start + self.climb_margin * max(abs(self.candidate_start), TINY)


def basis(candidate: TrialCurve, reference: TrialCurve,
          thresholds: StabilityThresholds | None = None, *,
          replicate: TrialCurve | None = None) -> Basis:
    """The levels and limits ``judge`` applies to these curves, without a verdict."""
    c = CurveComparison(candidate, reference, thresholds or StabilityThresholds(),
                        replicate)
    lv, limits = c.levels, c.limits
    bad = first_nonfinite(candidate.losses, candidate.was_skipped)
    return Basis(
        steps=c.n, window=c.window, candidate_start=lv.c_start, candidate_end=lv.c_end,
        reference_start=lv.r_start, reference_end=lv.r_end, progress_limit=limits.progress,
        final_gap_limit=limits.final_gap, climb_margin=c.t.climb_margin,
        reference_flat=c.reference_flat, first_nonfinite_step=None if bad is None else bad + 1,
    )
