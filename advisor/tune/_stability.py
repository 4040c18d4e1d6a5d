"""Stability verdicts: is a candidate's loss curve as good as the fp32 reference's? The data
types are in ``_spread``, the checks in ``_verdict_rules``; the defaults and their evidence in
docs/stability.md."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from advisor.tune import _spread
from advisor.tune._spread import VERDICT_KINDS as VERDICT_KINDS
from advisor.tune._spread import StabilityThresholds as StabilityThresholds
from advisor.tune._spread import TrialCurve as TrialCurve
from advisor.tune._spread import Verdict as Verdict
from advisor.tune._spread import smooth as smooth  # re-exported: part of this module's surface
from advisor.tune._verdict_rules import (
    STABILITY_CHECKS,
    TINY,
    CurveComparison,
    first_nonfinite,
    stable_verdict,
)
from policies import safety_order
from policies import safety_rank as safety_rank  # re-exported: the search ranks ties with it


def __getattr__(name: str) -> tuple[str, ...]:
    # SAFETY_ORDER (the modes from safest to least safe) is derived from the registered mode
    # classes on every lookup, so a mode registered later is ranked too.
    if name == "SAFETY_ORDER":
        return safety_order()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def judge(candidate: TrialCurve, reference: TrialCurve,
          thresholds: StabilityThresholds | None = None, *,
          replicate: TrialCurve | None = None) -> Verdict:
    """Whether a candidate's curve is as stable as the fp32 reference's over their common length:
    the first of ``STABILITY_CHECKS`` that fails gives the verdict. Non-finite losses on steps the
    GradScaler skipped count as skips, not divergence. A ``replicate`` (fp32 with its initial
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
    """What ``judge`` measures on the way to a verdict, for ``mpadvise trial --plot``: the
    verdict's own levels (medians over ``window`` steps) and limits."""

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
    def progress_level(self) -> float:
        """The smoothed end level the candidate had to reach to keep pace."""
        return self.candidate_start - self.progress_limit * (self.reference_start - self.reference_end)

    @property
    def final_level(self) -> float:
        """The highest smoothed final level within the final-gap limit (``final_gap`` is linear)."""
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
