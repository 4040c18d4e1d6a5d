"""Stability verdicts: is a candidate's loss curve as good as the fp32 reference's?

Pure functions over recorded trial data: no torch, no files, no clocks. A trial records one
``TrialCurve`` per precision mode, all with the same seed and data order, so the candidate
and the fp32 reference can be compared step by step. ``judge`` turns the pair into a
``Verdict`` whose reason says, with numbers, what went wrong and what to do. Given fp32 run again
with its initial parameters perturbed by one rounding (the replicate), the limits widen to how
far that perturbation carried it on this workload (``_spread``).

The defaults of ``StabilityThresholds`` and the evidence for them are in docs/stability.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from functools import cached_property
from typing import Any

from advisor.tune import _spread
from advisor.tune._spread import levels as _levels
from advisor.tune._spread import smooth as smooth  # re-exported: part of this module's surface
from policies import PrecisionMode, mode_class, safety_order
from policies import safety_rank as safety_rank  # re-exported: the search ranks ties with it
from probes import MpadviseError


def __getattr__(name: str) -> tuple[str, ...]:
    # SAFETY_ORDER (the modes from safest to least safe) is derived from the registered mode
    # classes on every lookup, so a mode registered later is ranked too.
    if name == "SAFETY_ORDER":
        return safety_order()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


VERDICT_KINDS: tuple[str, ...] = (
    "ok",
    "diverged",
    "stalled",
    "skips",
    "scale_collapse",
    "underflow",
    "reference_not_finite",
    "too_short",
)

# Below this, a loss level is treated as zero when it divides (avoids dividing by 0.0).
_TINY = 1e-12


@dataclass(frozen=True)
class TrialCurve:
    """What one trial recorded per optimizer step, for one precision mode.

    Attributes:
        mode: the precision mode that produced the curve (``"fp32"``, ``"fp16-mixed"``, ...).
        losses: the loss of every optimizer step, in order; may contain NaN or inf.
        skipped: per step, whether the GradScaler skipped the optimizer step because the
            gradients overflowed. Empty when no scaler was used (no step skipped).
        loss_scale: per step, the GradScaler's scale, ``None`` where no scaler ran. Empty when
            not recorded at all.
        underflow: per step, the fraction of sampled gradient values lost to fp16 underflow:
            already flushed to zero by an fp16 backward, or nonzero with a scaled magnitude
            ``|g| * loss_scale`` below fp16's smallest subnormal value (2**-24), which it would flush:
            an fp16 backward flushes them to zero. ``None`` where not measured (modes other
            than fp16). Empty when not recorded at all.
        lr: the learning rate of the trial, when known (only reported, never judged).
        optimizer_eps: the smallest eps of the trial's optimizer, when known: the advice after
            a failure may depend on it (pure fp16 rounds eps=1e-8 to zero).
    """

    mode: str
    losses: tuple[float, ...]
    skipped: tuple[bool, ...] = ()
    loss_scale: tuple[float | None, ...] = ()
    underflow: tuple[float | None, ...] = ()
    lr: float | None = None
    optimizer_eps: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.mode, str) or not self.mode:
            raise ValueError(f"TrialCurve.mode must be a non-empty string, got {self.mode!r}")
        # Accept any sequence (lists from JSON), store tuples so the curve stays hashable.
        losses = tuple(_as_float("losses", i, v) for i, v in enumerate(self.losses))
        object.__setattr__(self, "losses", losses)
        n = len(losses)
        skipped = tuple(self.skipped)
        for i, s in enumerate(skipped):
            if not isinstance(s, bool):
                raise ValueError(f"TrialCurve.skipped[{i}] must be a bool, got {s!r}")
        scales = tuple(
            None if v is None else _as_float("loss_scale", i, v)
            for i, v in enumerate(self.loss_scale)
        )
        for i, v in enumerate(scales):
            if v is not None and not v >= 0.0:
                raise ValueError(f"TrialCurve.loss_scale[{i}] must be >= 0 or None, got {v!r}")
        underflow = tuple(
            None if v is None else _as_float("underflow", i, v)
            for i, v in enumerate(self.underflow)
        )
        for i, v in enumerate(underflow):
            if v is not None and not 0.0 <= v <= 1.0:
                raise ValueError(
                    f"TrialCurve.underflow[{i}] must be a fraction in [0, 1] or None, got {v!r}"
                )
        for name, values in (
            ("skipped", skipped),
            ("loss_scale", scales),
            ("underflow", underflow),
        ):
            if values and len(values) != n:
                raise ValueError(
                    f"TrialCurve.{name} has {len(values)} entries but losses has {n}; "
                    "record one per optimizer step, or leave it empty when not recorded"
                )
        object.__setattr__(self, "skipped", skipped)
        object.__setattr__(self, "loss_scale", scales)
        object.__setattr__(self, "underflow", underflow)
        if self.lr is not None:
            object.__setattr__(self, "lr", _as_float("lr", None, self.lr))

    def __len__(self) -> int:
        return len(self.losses)

    def was_skipped(self, step: int) -> bool:
        """Whether the scaler skipped ``step`` (False when skips were not recorded)."""
        return bool(self.skipped) and self.skipped[step]

    def to_dict(self) -> dict[str, Any]:
        """A strict-JSON-ready dict: non-finite losses become ``"nan"``, ``"inf"``, ``"-inf"``.

        Returns:
            Plain lists, strings, numbers and ``None``; ``from_dict`` reads it back.
        """
        return {
            "mode": self.mode,
            "losses": [_encode_float(v) for v in self.losses],
            "skipped": list(self.skipped),
            "loss_scale": [None if v is None else _encode_float(v) for v in self.loss_scale],
            "underflow": list(self.underflow),
            "lr": self.lr,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TrialCurve:
        """Inverse of ``to_dict``; unknown keys are ignored so that newer files still load.

        Args:
            data: a mapping as written by ``to_dict``.

        Returns:
            The curve.
        """
        if "mode" not in data or "losses" not in data:
            raise ValueError("TrialCurve data needs 'mode' and 'losses'")
        return cls(
            mode=data["mode"],
            losses=tuple(data["losses"]),
            skipped=tuple(data.get("skipped") or ()),
            loss_scale=tuple(data.get("loss_scale") or ()),
            underflow=tuple(data.get("underflow") or ()),
            lr=data.get("lr"),
        )


@dataclass(frozen=True)
class StabilityThresholds:
    """The limits ``judge`` applies; each default is justified in docs/stability.md.

    Attributes:
        min_steps: fewer compared steps than this gives a ``too_short`` verdict. 32 is twice
            the calibration window: as many judged steps as calibration steps.
        calibration_steps: skips in the first steps are ignored. GradScaler starts at 2**16
            and halves on every overflow, so 16 consecutive skips bring it down to 1, the
            lowest healthy scale; any healthy scale is found within 16 steps.
        max_skip_fraction: most skipped steps allowed after calibration, as a fraction of
            those steps (one skip is always allowed). A healthy dynamic scaler skips about one
            step per growth_interval (2000 by default), i.e. 0.05%; 5% leaves room for a
            growth_interval as short as 20 while catching persistent overflow.
        min_loss_scale: a loss scale below this is a collapse. A healthy GradScaler never
            goes below 1: below 1 the gradients overflow fp16 even unscaled.
        max_underflow_fraction: most gradient values allowed to flush to zero in fp16, as
            the mean over the measured steps after calibration. Micikevicius et al. (2018)
            found about 5% of weight gradients below 2**-24 with no scaling at all, the very
            loss that scaling exists to prevent; with a scaler in place, more than that means
            the scale is too small.
        smoothing_fraction: the smoothing window, as a fraction of the compared steps; loss
            levels are medians over a window, robust to the odd spiky batch.
        min_smoothing_steps: the smoothing window is at least this many steps.
        min_progress_ratio: stall limit; the candidate's smoothed loss decrease must be at
            least this fraction of fp32's. The seed-to-seed spread of final BERT loss is about
            1.8% and the TF32-vs-AMP gap 0.2% (NVIDIA DeepLearningExamples); a short trial is
            noisier, so the band is 10%.
        max_final_gap: most the candidate's smoothed final loss may exceed fp32's, relative to
            fp32's final loss (so a loss floor above a loss heading towards zero is caught). 5%
            is nearly three times the seed spread of 1.8%.
        climb_margin: divergence limit for a finite curve; the candidate's smoothed loss ending
            more than this fraction above where it started, while fp32's did not, is a
            divergence. 5% is well outside seed noise.
        min_reference_drop: when fp32's smoothed loss falls by less than this fraction of its
            start, the ratio of two decreases that are both within noise means nothing, so
            progress is not judged; only the final gap is. 2% is just above the 1.8% seed
            spread.
        spread_multiplier: with a replicate (fp32 again, its initial parameters perturbed by
            one bf16 rounding), how many times the replicate's drift a candidate's progress
            shortfall and final gap may reach; the two limits above stay floors. A candidate
            rounds at every step where the replicate rounded once, and one replicate is one
            draw, so 2 rather than 1; 0 ignores the replicate.
        max_spread_final_gap: the most a replicate's drift may widen the final-gap limit to
            (1.0: twice fp32's final loss). A candidate ending further above fp32 than that is
            never stable: where one rounding moves fp32's final loss that far, the final level
            cannot vouch for a candidate, and a loss floor must not hide in it.
    """

    min_steps: int = 32
    calibration_steps: int = 16
    max_skip_fraction: float = 0.05
    min_loss_scale: float = 1.0
    max_underflow_fraction: float = 0.05
    smoothing_fraction: float = 0.1
    min_smoothing_steps: int = 5
    min_progress_ratio: float = 0.9
    max_final_gap: float = 0.05
    climb_margin: float = 0.05
    min_reference_drop: float = 0.02
    spread_multiplier: float = 2.0
    max_spread_final_gap: float = 1.0

    def __post_init__(self) -> None:
        for name in ("min_steps", "min_smoothing_steps"):
            _check_int(name, getattr(self, name), minimum=1)
        _check_int("calibration_steps", self.calibration_steps, minimum=0)
        for name in ("max_skip_fraction", "max_underflow_fraction", "min_reference_drop"):
            _check_number(name, getattr(self, name), low=0.0, high=1.0)
        _check_number("smoothing_fraction", self.smoothing_fraction, low=0.0, high=0.5)
        if self.smoothing_fraction == 0.0:
            raise ValueError(
                "StabilityThresholds.smoothing_fraction must be > 0 (a fraction of the steps), "
                "got 0.0"
            )
        for name in ("min_loss_scale", "min_progress_ratio", "max_final_gap", "climb_margin",
                     "spread_multiplier", "max_spread_final_gap"):
            _check_number(name, getattr(self, name), low=0.0, high=None)

    def smoothing_window(self, steps: int) -> int:
        """The smoothing window, in steps, for ``steps`` compared steps."""
        return min(max(self.min_smoothing_steps, round(steps * self.smoothing_fraction)), max(1, steps // 2))

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of every threshold."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StabilityThresholds:
        """Inverse of ``to_dict``; missing keys take their defaults, unknown keys are ignored."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


@dataclass(frozen=True)
class Verdict:
    """The judgement of one candidate curve against the fp32 reference.

    Attributes:
        stable: whether the candidate may be recommended.
        kind: one of ``VERDICT_KINDS``.
        reason: one or two sentences for the user, with the numbers and what to do.
        metrics: plain numbers behind the verdict; keys present only where computed:
            ``steps`` (compared steps), ``first_nonfinite_step`` (1-based),
            ``reference_first_nonfinite_step``, ``skips_after_calibration``,
            ``skip_fraction``, ``min_scale``, ``mean_underflow``, ``max_underflow``,
            ``smoothing_window``, ``candidate_start``, ``candidate_end``,
            ``reference_start``, ``reference_end``, ``reference_drop`` (fraction of its
            start), ``candidate_rise`` (fraction of its start), ``reference_flat``
            (True when fp32's loss did not fall, or fell within its own spread, so progress was
            not judged), ``progress_ratio``, ``final_gap``; with a replicate also the spread
            and the limits it set: ``replicate_end``, ``progress_spread``, ``final_spread``,
            ``progress_limit``, ``final_gap_limit``.
    """

    stable: bool
    kind: str
    reason: str
    metrics: Mapping[str, float | int | bool] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in VERDICT_KINDS:
            raise ValueError(
                f"Verdict.kind must be one of {', '.join(VERDICT_KINDS)}, got {self.kind!r}"
            )
        if self.stable != (self.kind == "ok"):
            raise ValueError(
                f"Verdict.stable must be True exactly when kind is 'ok'; got stable={self.stable} "
                f"with kind={self.kind!r}"
            )
        object.__setattr__(self, "metrics", dict(self.metrics))

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict; non-finite metric values become strings like ``"nan"``."""
        return {
            "stable": self.stable,
            "kind": self.kind,
            "reason": self.reason,
            "metrics": {
                k: v if isinstance(v, bool | int) else _encode_float(v)
                for k, v in self.metrics.items()
            },
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Verdict:
        """Inverse of ``to_dict``."""
        metrics = {
            k: float(v) if isinstance(v, str) else v for k, v in (data.get("metrics") or {}).items()
        }
        return cls(
            stable=bool(data["stable"]),
            kind=data["kind"],
            reason=data["reason"],
            metrics=metrics,
        )


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
    return _stable(comparison)


def _compare(
    candidate: TrialCurve,
    reference: TrialCurve,
    thresholds: StabilityThresholds | None,
    replicate: TrialCurve | None,
) -> _Comparison:
    """The comparison ``judge`` decides on and ``basis`` shows: one construction for both."""
    return _Comparison(
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
        return self.candidate_start + self.climb_margin * max(abs(self.candidate_start), _TINY)


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
    bad = _first_nonfinite(candidate.losses, candidate.was_skipped)
    return Basis(
        steps=c.n, window=c.window, candidate_start=lv.c_start, candidate_end=lv.c_end,
        reference_start=lv.r_start, reference_end=lv.r_end, progress_limit=limits.progress,
        final_gap_limit=limits.final_gap, climb_margin=c.t.climb_margin,
        reference_flat=c.reference_flat, first_nonfinite_step=None if bad is None else bad + 1,
    )


@dataclass(frozen=True)
class _ScalerStats:
    """What the loss scaler did after calibration."""

    calibration: int  # steps whose skips are calibration
    scales: list[float]  # every recorded loss scale
    skips: int  # skipped steps after calibration
    judged_steps: int  # steps after calibration
    skip_fraction: float
    underflow: list[float]  # per-step underflow fractions after calibration (all if none)


@dataclass(frozen=True)
class _Levels:
    """Smoothed start and end levels of both curves, and how each moved."""

    c_start: float
    c_end: float
    r_start: float
    r_end: float
    r_drop: float  # how far the reference fell
    ref_drop_rel: float  # ... as a fraction of its start
    cand_rise_rel: float  # how far the candidate rose, as a fraction of its start


@dataclass
class _Comparison:
    """A candidate curve against the reference, and the measurements the checks share.

    Each measurement is computed on first use and recorded in ``metrics`` then, so a verdict
    carries exactly the numbers computed up to its check, in the order they were computed.
    """

    candidate: TrialCurve
    reference: TrialCurve
    t: StabilityThresholds
    replicate: TrialCurve | None = None
    metrics: dict[str, float | int | bool] = field(default_factory=dict)

    @cached_property
    def name(self) -> str:
        return _label(self.candidate.mode)

    @property
    def ref_name(self) -> str:
        return self.reference.mode

    @cached_property
    def n(self) -> int:
        """Compared steps: the common length of the two curves."""
        return min(len(self.candidate), len(self.reference))

    def advice(self, kind: str) -> str:
        return _advice(self.candidate.mode, kind, optimizer_eps=self.candidate.optimizer_eps)

    @cached_property
    def window(self) -> int:
        """The smoothing window, in steps."""
        n = self.n
        window = self.t.smoothing_window(n)
        self.metrics.update(steps=n, smoothing_window=window)
        return window

    @cached_property
    def scaler(self) -> _ScalerStats:
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
        return _ScalerStats(cal, scales, skips, judged_steps, skip_fraction, under)

    @cached_property
    def levels(self) -> _Levels:
        n, window = self.n, self.window
        c_start, c_end = _levels(self.candidate.losses[:n], window)
        r_start, r_end = _levels(self.reference.losses[:n], window)
        r_drop = r_start - r_end
        ref_drop_rel = r_drop / max(abs(r_start), _TINY)
        cand_rise_rel = (c_end - c_start) / max(abs(c_start), _TINY)
        self.metrics.update(
            candidate_start=c_start, candidate_end=c_end, reference_start=r_start,
            reference_end=r_end, reference_drop=ref_drop_rel, candidate_rise=cand_rise_rel,
        )
        return _Levels(c_start, c_end, r_start, r_end, r_drop, ref_drop_rel, cand_rise_rel)

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

    def ref_curve(self) -> str:
        """``"fp32's 1.142 -> 0.7277"``."""
        return f"{self.ref_name}'s {_fmt(self.levels.r_start)} -> {_fmt(self.levels.r_end)}"

    def flat_note(self) -> str:
        """The clause saying that progress was not judged, or nothing."""
        if not self.reference_flat:
            return ""
        if self.limits.fell_within_spread:
            return self.limits.flat_note(self.ref_curve())
        return (
            f"{self.ref_name}'s loss did not fall ({_fmt(self.levels.r_start)} -> "
            f"{_fmt(self.levels.r_end)}), so progress cannot be compared and only the final "
            "loss is judged; "
        )


def _reference_finite(c: _Comparison) -> Verdict | None:
    """The fp32 reference itself went NaN or inf: no verdict is possible."""
    reference = c.reference
    bad = _first_nonfinite(reference.losses, lambda i: False)
    if bad is None:
        return None
    return Verdict(
        False,
        "reference_not_finite",
        f"no verdict possible: the {c.ref_name} reference itself reached a "
        f"{_describe(reference.losses[bad])} loss at step {bad + 1} of {len(reference)}, "
        "so the script diverges even in full precision; lower the learning rate or fix the "
        "script (a log or division by zero, say) before tuning",
        {"reference_first_nonfinite_step": bad + 1, "steps": len(reference)},
    )


def _candidate_finite(c: _Comparison) -> Verdict | None:
    """A NaN or inf loss on a step the optimizer applied is a divergence."""
    candidate = c.candidate
    bad = _first_nonfinite(candidate.losses, candidate.was_skipped)
    if bad is None:
        return None
    applied = " on a step the optimizer applied" if any(candidate.skipped) else ""
    return Verdict(
        False,
        "diverged",
        f"{c.name} diverged: loss became {_describe(candidate.losses[bad])} at step {bad + 1} "
        f"of {len(candidate)}{applied}; {c.advice('diverged')}",
        {"first_nonfinite_step": bad + 1, "steps": len(candidate)},
    )


def _enough_steps(c: _Comparison) -> Verdict | None:
    """Fewer than ``min_steps`` compared steps give no verdict."""
    if c.n >= c.t.min_steps:
        return None
    return Verdict(
        False,
        "too_short",
        f"too few steps to judge {c.name}: {c.n} steps compared, need at least {c.t.min_steps}; "
        "run the trial longer (a few hundred optimizer steps give a clear verdict)",
        {"steps": c.n},
    )


def _finite_tail(c: _Comparison) -> Verdict | None:
    """Every step of the final window non-finite (each skipped by the scaler) is a divergence."""
    losses = c.candidate.losses[: c.n]
    tail_bad = _nonfinite_tail(losses, c.window)
    if tail_bad is None:
        return None
    c.metrics["first_nonfinite_step"] = tail_bad + 1
    return Verdict(
        False,
        "diverged",
        f"{c.name} diverged: loss stayed {_describe(losses[-1])} from step {tail_bad + 1} "
        f"to the end ({c.n} steps), every one skipped by the scaler; "
        f"{c.advice('diverged')}",
        c.metrics,
    )


def _scale_collapse(c: _Comparison) -> Verdict | None:
    """A loss scale below ``min_loss_scale``: gradients overflow fp16 even unscaled."""
    s, t = c.scaler, c.t
    if not s.scales or min(s.scales) >= t.min_loss_scale:
        return None
    return Verdict(
        False,
        "scale_collapse",
        f"{c.name}'s loss scale collapsed to {_format_scale(min(s.scales))}, below the limit of "
        f"{_format_scale(t.min_loss_scale)}, with {s.skips} of {s.judged_steps} steps skipped "
        f"after the first {s.calibration}: gradients overflow fp16 even unscaled; "
        f"{c.advice('scale_collapse')}",
        c.metrics,
    )


def _persistent_skips(c: _Comparison) -> Verdict | None:
    """More than ``max_skip_fraction`` of the steps after calibration skipped (and more than one)."""
    s, t = c.scaler, c.t
    if not (s.skips > 1 and s.skip_fraction > t.max_skip_fraction):
        return None
    scale_note = f"; the loss scale fell to {_format_scale(min(s.scales))}" if s.scales else ""
    return Verdict(
        False,
        "skips",
        f"{c.name} skipped {_pct(s.skip_fraction)} of steps after the first {s.calibration} "
        f"({s.skips} of {s.judged_steps}; limit {_pct(t.max_skip_fraction)}{scale_note}): "
        f"{c.advice('skips')}",
        c.metrics,
    )


def _gradient_underflow(c: _Comparison) -> Verdict | None:
    """On average more than ``max_underflow_fraction`` of sampled gradient values lost to fp16
    underflow (flushed to zero already, or below fp16's smallest subnormal once scaled)."""
    s, t, metrics = c.scaler, c.t, c.metrics
    if not (s.underflow and metrics["mean_underflow"] > t.max_underflow_fraction):
        return None
    scale_note = f" (lowest loss scale {_format_scale(min(s.scales))})" if s.scales else ""
    return Verdict(
        False,
        "underflow",
        f"{c.name} loses gradients to underflow: on average {_pct(metrics['mean_underflow'])} "
        f"of sampled gradient values (up to {_pct(metrics['max_underflow'])} on one step) "
        f"were flushed to zero or fall below fp16's smallest subnormal (2^-24) once scaled, "
        f"where an fp16 backward flushes them, limit "
        f"{_pct(t.max_underflow_fraction)}{scale_note}; {c.advice('underflow')}",
        metrics,
    )


def _climb(c: _Comparison) -> Verdict | None:
    """The smoothed loss rose by more than ``climb_margin`` while fp32's did not: a slow divergence."""
    lv, t = c.levels, c.t
    if not (lv.cand_rise_rel > t.climb_margin and -lv.ref_drop_rel <= t.climb_margin):
        return None
    return Verdict(
        False,
        "diverged",
        f"{c.name} diverged: its smoothed loss rose {_fmt(lv.c_start)} -> {_fmt(lv.c_end)} "
        f"(+{_pct(lv.cand_rise_rel)}, limit +{_pct(t.climb_margin)}) over {c.n} steps against "
        f"{c.ref_curve()}; {c.advice('climbed')}",
        c.metrics,
    )


def _progress(c: _Comparison) -> Verdict | None:
    """The smoothed loss fell less than ``min_progress_ratio`` (or less than the spread
    allows) as far as fp32's: a stall."""
    if c.reference_flat:
        return None
    lv = c.levels
    progress = (lv.c_start - lv.c_end) / lv.r_drop
    c.metrics["progress_ratio"] = progress
    if progress >= c.limits.progress:
        return None
    if progress <= 0:
        how = f"its smoothed loss did not fall ({_fmt(lv.c_start)} -> {_fmt(lv.c_end)})"
    else:
        how = (
            f"its smoothed loss fell {_pct(progress)} as far as {c.ref_name}'s "
            f"({_fmt(lv.c_start)} -> {_fmt(lv.c_end)})"
        )
    return Verdict(
        False,
        "stalled",
        f"{c.name} stalled: {how} against {c.ref_curve()} over {c.n} steps "
        f"({c.limits.describe('progress')}); {c.advice('stalled')}",
        c.metrics,
    )


def _final_gap(c: _Comparison) -> Verdict | None:
    """The smoothed final loss more than ``max_final_gap`` (or than the spread allows) above
    fp32's: the candidate lags, or stops at a loss floor."""
    gap = c.final_gap
    if gap <= c.limits.final_gap:
        return None
    return Verdict(
        False,
        "stalled",
        f"{c.name} fell behind {c.ref_name}: {c.flat_note()}its smoothed final loss is "
        f"{_fmt(c.levels.c_end)} against {_fmt(c.levels.r_end)} after {c.n} steps "
        f"({_higher(gap)}, {c.limits.describe('final')}); {c.advice('stalled')}",
        c.metrics,
    )


def _stable(c: _Comparison) -> Verdict:
    """Every check passed: the ``ok`` verdict, with the numbers that show it."""
    gap, s = c.final_gap, c.scaler
    final = (
        f"final loss {_pct(abs(gap))} {'higher' if gap > 0 else 'lower'} than {c.ref_name}'s "
        f"({c.limits.describe('final', ' higher')})"
    )
    if c.reference_flat:
        pace = f"{c.flat_note()}{final}"
    else:
        pace = (
            f"its loss fell {_pct(c.metrics['progress_ratio'])} as far as {c.ref_name}'s "
            f"({c.limits.describe('progress')}), {final}"
        )
    scaler_note = (
        f", {s.skips} skipped step{'s' if s.skips != 1 else ''} after the first {s.calibration}"
        if c.candidate.skipped
        else ""
    )
    return Verdict(True, "ok", f"{c.name} is stable over {c.n} steps: {pace}{scaler_note}{_bending_note(c)}",
                   c.metrics)


def _bending_note(c: _Comparison) -> str:
    """A stable candidate whose gap above fp32 grew by half again or more over the second half
    of the window, to over a quarter of its limit, is bending away (a gap that grows with every
    step, as a stall's does, doubles from the middle to the end; an offset or a levelling one
    does not): the window is short to tell whether it levels off. The clause that says so, or
    nothing."""
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
    c.metrics["bending_away"] = True
    c.metrics["mid_gap"] = mid_gap
    return (f"; the window is short for this workload: its loss is moving away from {c.ref_name}'s "
            f"({_pct(mid_gap)} above it at step {half}, {_pct(gap)} at step {c.n}); a longer trial "
            f"(--steps {2 * c.n}) shows whether it levels off")


STABILITY_CHECKS: tuple[Callable[[_Comparison], Verdict | None], ...] = (
    _reference_finite,
    _candidate_finite,
    _enough_steps,
    _finite_tail,
    _scale_collapse,
    _persistent_skips,
    _gradient_underflow,
    _climb,
    _progress,
    _final_gap,
)
"""The checks ``judge`` runs, in order; the first that returns a Verdict gives it. The order puts
the cause before its symptoms: an fp16 run that skips a third of its steps also falls behind,
but the skips are what a user can act on (docs/stability.md, "What is checked, in order")."""


def _mode_class(mode: str) -> type[PrecisionMode] | None:
    """The registered class of ``mode``, or ``None`` (a curve may name any mode)."""
    try:
        return mode_class(mode)
    except MpadviseError:
        return None


def _advice(mode: str, kind: str, *, optimizer_eps: float | None = None) -> str:
    """What to try instead after a failure ``kind`` of ``mode``: the mode class's advice.

    ``kind`` is a verdict kind, or ``"climbed"`` for a finite loss that rose (a divergence
    that is not an overflow); ``optimizer_eps`` the trial's, when known. A mode that is not
    registered gets the generic advice.
    """
    return (_mode_class(mode) or PrecisionMode).advice(kind, optimizer_eps=optimizer_eps)


def _label(mode: str) -> str:
    """The mode as named in reasons: the mode class's label, or the name as given."""
    cls = _mode_class(mode)
    return mode if cls is None else cls.label()


def _first_nonfinite(losses: Sequence[float], skipped: Any) -> int | None:
    """Index of the first non-finite loss on a step that was not skipped, or None."""
    for i, v in enumerate(losses):
        if not math.isfinite(v) and not skipped(i):
            return i
    return None


def _nonfinite_tail(losses: Sequence[float], window: int) -> int | None:
    """Start of a trailing run of non-finite losses at least ``window`` long, or None."""
    start = len(losses)
    while start > 0 and not math.isfinite(losses[start - 1]):
        start -= 1
    return start if len(losses) - start >= window else None


def _describe(value: float) -> str:
    return "NaN" if math.isnan(value) else ("inf" if value > 0 else "-inf")


def _fmt(value: float) -> str:
    return f"{value:.4g}"


def _higher(gap: float) -> str:
    """``"8.0% higher"``; a loss floor, ``"14,205 times as high"``, reads better as a factor."""
    if gap < 1:
        return f"{_pct(gap)} higher"
    return f"{1 + gap:,.0f} times as high" if gap >= 9 else f"{1 + gap:.1f} times as high"


def _pct(fraction: float) -> str:
    return f"{fraction:.0%}" if abs(fraction) >= 0.1 else f"{fraction:.1%}"


def _format_scale(scale: float) -> str:
    """A loss scale for people: ``65536``, ``0.0039 (2^-8)``."""
    if scale > 0:
        exponent = math.log2(scale)
        if exponent == int(exponent) and scale < 1:
            return f"{scale:.2g} (2^{int(exponent)})"
    return f"{scale:.0f}" if scale >= 1 else f"{scale:.2g}"


def _encode_float(value: float) -> float | str:
    """Finite floats as they are; NaN and infinities as strings that strict JSON accepts."""
    if math.isfinite(value):
        return value
    return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")


def _as_float(name: str, index: int | None, value: Any) -> float:
    where = f"TrialCurve.{name}" + ("" if index is None else f"[{index}]")
    if isinstance(value, bool):
        raise ValueError(f"{where} must be a number, got {value!r}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{where} must be a number, got {value!r}") from None


def _check_int(name: str, value: Any, *, minimum: int, owner: str = "StabilityThresholds") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{owner}.{name} must be an integer >= {minimum}, got {value!r}")


def _check_number(name: str, value: Any, *, low: float, high: float | None) -> None:
    ok = (
        not isinstance(value, bool)
        and isinstance(value, int | float)
        and math.isfinite(value)
        and value >= low
        and (high is None or value <= high)
    )
    if not ok:
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"StabilityThresholds.{name} must be a number {bound}, got {value!r}")
