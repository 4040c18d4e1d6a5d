"""The stability rules: the measurements a candidate curve shares with fp32's
(``CurveComparison``) and named checks over them, run in order, a cause before its symptoms; the
first failure wins (docs/stability.md, "What is checked, in order")."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property

from advisor.tune import _spread
from advisor.tune._spread import StabilityThresholds, TrialCurve, Verdict, pct
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
    """A candidate curve against the reference. Each measurement is recorded in ``metrics`` on
    first use, so a verdict carries exactly the numbers computed up to its check."""

    candidate: TrialCurve
    reference: TrialCurve
    t: StabilityThresholds
    replicate: TrialCurve | None = None
    metrics: dict[str, float | int | bool] = field(default_factory=dict)

    @cached_property
    def mode_class(self) -> type[PrecisionMode] | None:
        try:
            return mode_class(self.candidate.mode)
        except MpadviseError:
            return None

    @property
    def name(self) -> str:  # the mode as reasons name it
        return self.candidate.mode if self.mode_class is None else self.mode_class.label()

    @property
    def ref_name(self) -> str:
        return self.reference.mode

    @cached_property
    def n(self) -> int:
        return min(len(self.candidate), len(self.reference))

    def advice(self, kind: str) -> str:
        """The mode class's advice after a failure ``kind`` (or ``"climbed"``)."""
        cls = self.mode_class or PrecisionMode
        return cls.advice(kind, optimizer_eps=self.candidate.optimizer_eps)

    @cached_property
    def window(self) -> int:
        window = self.t.smoothing_window(self.n)
        self.metrics.update(steps=self.n, smoothing_window=window)
        return window

    @cached_property
    def scaler(self) -> ScalerStats:
        n, candidate = self.n, self.candidate
        cal = min(self.t.calibration_steps, n)
        scales = [s for s in candidate.loss_scale[:n] if s is not None]
        if scales:
            self.metrics["min_scale"] = min(scales)
        skips = sum(candidate.was_skipped(i) for i in range(cal, n))
        skip_fraction = skips / (n - cal) if n > cal else 0.0
        self.metrics.update(skips_after_calibration=skips, skip_fraction=skip_fraction)
        under = ([u for u in candidate.underflow[cal:n] if u is not None]
                 or [u for u in candidate.underflow[:n] if u is not None])
        if under:
            self.metrics.update(mean_underflow=sum(under) / len(under), max_underflow=max(under))
        return ScalerStats(cal, scales, skips, n - cal, skip_fraction, under)

    @cached_property
    def levels(self) -> Levels:
        c_start, c_end = _spread.levels(self.candidate.losses[: self.n], self.window)
        r_start, r_end = _spread.levels(self.reference.losses[: self.n], self.window)
        r_drop = r_start - r_end
        ref_drop_rel = r_drop / max(abs(r_start), TINY)
        cand_rise_rel = (c_end - c_start) / max(abs(c_start), TINY)
        self.metrics.update(candidate_start=c_start, candidate_end=c_end, reference_start=r_start,
                            reference_end=r_end, reference_drop=ref_drop_rel,
                            candidate_rise=cand_rise_rel)
        return Levels(c_start, c_end, r_start, r_end, r_drop, ref_drop_rel, cand_rise_rel)

    @cached_property
    def limits(self) -> _spread.Limits:
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
        flat = (lv.r_drop <= 0 or lv.ref_drop_rel < self.t.min_reference_drop
                or self.limits.fell_within_spread)
        self.metrics["reference_flat"] = flat
        return flat

    @cached_property
    def final_gap(self) -> float:
        lv = self.levels
        gap = self.metrics["final_gap"] = _spread.final_gap(lv.c_end, lv.r_end, lv.r_drop)
        return gap


def first_nonfinite(losses: Sequence[float], skipped: Callable[[int], bool]) -> int | None:
    return next((i for i, v in enumerate(losses) if not math.isfinite(v) and not skipped(i)), None)


def _reference_finite(c: CurveComparison) -> Verdict | None:
    """The fp32 reference itself went NaN or inf: no verdict is possible."""
    losses = c.reference.losses
    bad = first_nonfinite(losses, lambda i: False)
    if bad is None:
        return None
    return Verdict(False, "reference_not_finite",
                   f"no verdict possible: the {c.ref_name} reference itself reached a "
                   f"{_describe(losses[bad])} loss at step {bad + 1} of {len(losses)}, so the "
                   "script diverges even in full precision; lower the learning rate or fix the "
                   "script (a log or division by zero, say) before tuning",
                   {"reference_first_nonfinite_step": bad + 1, "steps": len(losses)})


def _candidate_finite(c: CurveComparison) -> Verdict | None:
    """A NaN or inf loss on a step the optimizer applied is a divergence."""
    candidate = c.candidate
    bad = first_nonfinite(candidate.losses, candidate.was_skipped)
    if bad is None:
        return None
    applied = " on a step the optimizer applied" if any(candidate.skipped) else ""
    return Verdict(False, "diverged",
                   f"{c.name} diverged: loss became {_describe(candidate.losses[bad])} at step "
                   f"{bad + 1} of {len(candidate)}{applied}; {c.advice('diverged')}",
                   {"first_nonfinite_step": bad + 1, "steps": len(candidate)})


def _enough_steps(c: CurveComparison) -> Verdict | None:
    """Fewer than ``min_steps`` compared steps give no verdict."""
    if c.n >= c.t.min_steps:
        return None
    return Verdict(False, "too_short",
                   f"too few steps to judge {c.name}: {c.n} steps compared, need at least "
                   f"{c.t.min_steps}; run the trial longer (a few hundred optimizer steps give a "
                   "clear verdict)", {"steps": c.n})


def _finite_tail(c: CurveComparison) -> Verdict | None:
    """Every step of the final window non-finite (each skipped by the scaler) is a divergence."""
    losses = c.candidate.losses[: c.n]
    start = len(losses)  # of the trailing run of non-finite losses
    while start > 0 and not math.isfinite(losses[start - 1]):
        start -= 1
    if len(losses) - start < c.window:
        return None
    c.metrics["first_nonfinite_step"] = start + 1
    return Verdict(False, "diverged",
                   f"{c.name} diverged: loss stayed {_describe(losses[-1])} from step {start + 1} "
                   f"to the end ({c.n} steps), every one skipped by the scaler; "
                   f"{c.advice('diverged')}", c.metrics)


def _scale_collapse(c: CurveComparison) -> Verdict | None:
    """A loss scale below ``min_loss_scale``: gradients overflow fp16 even unscaled."""
    s, t = c.scaler, c.t
    if not s.scales or min(s.scales) >= t.min_loss_scale:
        return None
    return Verdict(False, "scale_collapse",
                   f"{c.name}'s loss scale collapsed to {_format_scale(min(s.scales))}, below the "
                   f"limit of {_format_scale(t.min_loss_scale)}, with {s.skips} of "
                   f"{s.judged_steps} steps skipped after the first {s.calibration}: gradients "
                   f"overflow fp16 even unscaled; {c.advice('scale_collapse')}", c.metrics)


def _persistent_skips(c: CurveComparison) -> Verdict | None:
    """More than ``max_skip_fraction`` of the steps after calibration skipped (and more than one)."""
    s, t = c.scaler, c.t
    if not (s.skips > 1 and s.skip_fraction > t.max_skip_fraction):
        return None
    scale_note = f"; the loss scale fell to {_format_scale(min(s.scales))}" if s.scales else ""
    return Verdict(False, "skips",
                   f"{c.name} skipped {pct(s.skip_fraction)} of steps after the first "
                   f"{s.calibration} ({s.skips} of {s.judged_steps}; limit "
                   f"{pct(t.max_skip_fraction)}{scale_note}): {c.advice('skips')}", c.metrics)


def _gradient_underflow(c: CurveComparison) -> Verdict | None:
    """On average more than ``max_underflow_fraction`` of sampled gradient values lost to fp16 underflow."""
    s, t, metrics = c.scaler, c.t, c.metrics
    if not (s.underflow and metrics["mean_underflow"] > t.max_underflow_fraction):
        return None
    scale_note = f" (lowest loss scale {_format_scale(min(s.scales))})" if s.scales else ""
    return Verdict(False, "underflow",
                   f"{c.name} loses gradients to underflow: on average "
                   f"{pct(metrics['mean_underflow'])} of sampled gradient values (up to "
                   f"{pct(metrics['max_underflow'])} on one step) were flushed to zero or fall "
                   "below fp16's smallest subnormal (2^-24) once scaled, where an fp16 backward "
                   f"flushes them, limit {pct(t.max_underflow_fraction)}{scale_note}; "
                   f"{c.advice('underflow')}", metrics)


def _climb(c: CurveComparison) -> Verdict | None:
    """The smoothed loss rose by more than ``climb_margin`` while fp32's did not: a slow divergence."""
    lv, t = c.levels, c.t
    if not (lv.cand_rise_rel > t.climb_margin and -lv.ref_drop_rel <= t.climb_margin):
        return None
    return Verdict(False, "diverged",
                   f"{c.name} diverged: its smoothed loss rose {_fmt(lv.c_start)} -> "
                   f"{_fmt(lv.c_end)} (+{pct(lv.cand_rise_rel)}, limit +{pct(t.climb_margin)}) "
                   f"over {c.n} steps against {_ref_curve(c)}; {c.advice('climbed')}", c.metrics)


def _progress(c: CurveComparison) -> Verdict | None:
    """The smoothed loss fell less than ``min_progress_ratio`` (or the spread) as far as fp32's."""
    if c.reference_flat:
        return None
    lv = c.levels
    progress = c.metrics["progress_ratio"] = (lv.c_start - lv.c_end) / lv.r_drop
    if progress >= c.limits.progress:
        return None
    moved = f"({_fmt(lv.c_start)} -> {_fmt(lv.c_end)})"
    how = (f"its smoothed loss did not fall {moved}" if progress <= 0
           else f"its smoothed loss fell {pct(progress)} as far as {c.ref_name}'s {moved}")
    return Verdict(False, "stalled",
                   f"{c.name} stalled: {how} against {_ref_curve(c)} over {c.n} steps "
                   f"({c.limits.describe('progress')}); {c.advice('stalled')}", c.metrics)


def _final_gap(c: CurveComparison) -> Verdict | None:
    """The smoothed final loss above fp32's by more than ``max_final_gap`` (or the spread)."""
    gap = c.final_gap
    if gap <= c.limits.final_gap:
        return None
    return Verdict(False, "stalled",
                   f"{c.name} fell behind {c.ref_name}: {_flat_note(c)}its smoothed final loss is "
                   f"{_fmt(c.levels.c_end)} against {_fmt(c.levels.r_end)} after {c.n} steps "
                   f"({_higher(gap)}, {c.limits.describe('final')}); {c.advice('stalled')}",
                   c.metrics)


def stable_verdict(c: CurveComparison) -> Verdict:
    gap, s = c.final_gap, c.scaler
    final = (f"final loss {pct(abs(gap))} {'higher' if gap > 0 else 'lower'} than {c.ref_name}'s "
             f"({c.limits.describe('final', ' higher')})")
    if c.reference_flat:
        pace = f"{_flat_note(c)}{final}"
    else:
        pace = (f"its loss fell {pct(c.metrics['progress_ratio'])} as far as {c.ref_name}'s "
                f"({c.limits.describe('progress')}), {final}")
    steps = "step" if s.skips == 1 else "steps"
    skipped = f", {s.skips} skipped {steps} after the first {s.calibration}"
    scaler_note = skipped if c.candidate.skipped else ""
    reason = f"{c.name} is stable over {c.n} steps: {pace}{scaler_note}{_bending_note(c)}"
    return Verdict(True, "ok", reason, c.metrics)


def _bending_note(c: CurveComparison) -> str:
    """The clause for a stable candidate whose gap above fp32 grew by half again or more over the
    window's second half, to over a quarter of its limit (a stall's gap doubles from the middle to
    the end; an offset does not): the window is too short to tell."""
    gap, half = c.final_gap, c.n // 2
    if gap <= 0.25 * c.limits.final_gap or half < 2 * c.window:
        return ""
    c_mid = _spread.median_finite(c.candidate.losses[half - c.window : half])
    r_mid = _spread.median_finite(c.reference.losses[half - c.window : half])
    if not (math.isfinite(c_mid) and math.isfinite(r_mid)):
        return ""
    mid_gap = _spread.final_gap(c_mid, r_mid, c.levels.r_start - r_mid)
    if gap <= 1.5 * max(mid_gap, 0.0):
        return ""
    c.metrics.update(bending_away=True, mid_gap=mid_gap)
    return (f"; the window is short for this workload: its loss is moving away from {c.ref_name}'s "
            f"({pct(mid_gap)} above it at step {half}, {pct(gap)} at step {c.n}); a longer trial "
            f"(--steps {2 * c.n}) shows whether it levels off")


STABILITY_CHECKS: tuple[Callable[[CurveComparison], Verdict | None], ...] = (
    _reference_finite, _candidate_finite, _enough_steps, _finite_tail, _scale_collapse, _persistent_skips,
    _gradient_underflow, _climb, _progress, _final_gap,
)


def _ref_curve(c: CurveComparison) -> str:  # "fp32's 1.142 -> 0.7277"
    return f"{c.ref_name}'s {_fmt(c.levels.r_start)} -> {_fmt(c.levels.r_end)}"


def _flat_note(c: CurveComparison) -> str:  # the clause saying that progress was not judged
    if not c.reference_flat:
        return ""
    limits = c.limits
    if limits.fell_within_spread and limits.spread is not None:
        return (f"{_ref_curve(c)} is a fall within {limits.multiplier:g}x the "
                f"{limits.spread.fall_gap:.4g} by which fp32 perturbed by one rounding fell "
                "differently, so progress cannot be compared and only the final loss is judged; ")
    return (f"{c.ref_name}'s loss did not fall ({_fmt(c.levels.r_start)} -> "
            f"{_fmt(c.levels.r_end)}), so progress cannot be compared and only the final loss is "
            "judged; ")


def _describe(value: float) -> str:
    return "NaN" if math.isnan(value) else ("inf" if value > 0 else "-inf")


def _fmt(value: float) -> str:
    return f"{value:.4g}"


def _higher(gap: float) -> str:
    """``"8.0% higher"``; a loss floor, ``"14,205 times as high"``, reads better as a factor."""
    if gap < 1:
        return f"{pct(gap)} higher"
    return f"{1 + gap:,.0f} times as high" if gap >= 9 else f"{1 + gap:.1f} times as high"


def _format_scale(scale: float) -> str:
    """A loss scale for people: ``65536``, ``0.0039 (2^-8)``."""
    if scale > 0:
        exponent = math.log2(scale)
        if exponent == int(exponent) and scale < 1:
            return f"{scale:.2g} (2^{int(exponent)})"
    return f"{scale:.0f}" if scale >= 1 else f"{scale:.2g}"
