"""Loss curves (``TrialCurve``), the thresholds and the verdict, loss levels, and the limits fp32's
own spread sets on a gap: a replicate (fp32 perturbed by about one bf16 rounding) drifts as far as
this workload amplifies a perturbation of precision's size, and a candidate's gap is judged against
a multiple of that, never less than the fixed thresholds (docs/stability.md)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

VERDICT_KINDS: tuple[str, ...] = ("ok", "diverged", "stalled", "skips", "scale_collapse",
                                  "underflow", "reference_not_finite", "too_short")


@dataclass(frozen=True)
class TrialCurve:
    """What one trial recorded per optimizer step (``skipped``, ``loss_scale`` and ``underflow``
    empty when not recorded). ``underflow``: the fraction of sampled gradient values an fp16
    backward flushes to zero; ``optimizer_eps`` shapes the advice (pure fp16 rounds 1e-8 to 0)."""

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
        skipped = tuple(self.skipped)
        bad = next((i for i, s in enumerate(skipped) if not isinstance(s, bool)), None)
        if bad is not None:
            raise ValueError(f"TrialCurve.skipped[{bad}] must be a bool, got {skipped[bad]!r}")
        scales = _optional_floats("loss_scale", self.loss_scale, ">= 0", lambda v: v >= 0.0)
        underflow = _optional_floats("underflow", self.underflow, "a fraction in [0, 1]",
                                     lambda v: 0.0 <= v <= 1.0)
        for name, values in (("skipped", skipped), ("loss_scale", scales),
                             ("underflow", underflow)):
            if values and len(values) != len(losses):
                raise ValueError(f"TrialCurve.{name} has {len(values)} entries but losses has "
                                 f"{len(losses)}; record one per optimizer step, or leave it empty "
                                 "when not recorded")
            object.__setattr__(self, name, values)
        object.__setattr__(self, "losses", losses)
        if self.lr is not None:
            object.__setattr__(self, "lr", _as_float("lr", None, self.lr))

    def __len__(self) -> int:
        return len(self.losses)

    def was_skipped(self, step: int) -> bool:
        return bool(self.skipped) and self.skipped[step]


@dataclass(frozen=True)
class StabilityThresholds:
    """The limits ``judge`` applies, each default justified in docs/stability.md.
    ``calibration_steps``: skips in the first steps are ignored (GradScaler starts at 2**16).
    ``min_reference_drop``: when fp32 falls by less, only the final gap is judged.
    ``spread_multiplier``: how many times a replicate's drift the progress shortfall and final gap
    may reach (the fixed limits stay floors; 0 ignores it), up to ``max_spread_final_gap``."""

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
        highs = {"max_skip_fraction": 1.0, "max_underflow_fraction": 1.0, "min_reference_drop": 1.0,
                 "smoothing_fraction": 0.5}
        for f in fields(self):
            value, where = getattr(self, f.name), f"StabilityThresholds.{f.name}"
            if f.type == "int":
                least = 0 if f.name == "calibration_steps" else 1
                if isinstance(value, bool) or not isinstance(value, int) or value < least:
                    raise ValueError(f"{where} must be an integer >= {least}, got {value!r}")
                continue
            high = highs.get(f.name)
            number = not isinstance(value, bool) and isinstance(value, int | float)
            if not number or not math.isfinite(value) or value < 0.0 or value > (high or math.inf):
                bound = ">= 0.0" if high is None else f"in [0.0, {high}]"
                raise ValueError(f"{where} must be a number {bound}, got {value!r}")
        if self.smoothing_fraction == 0.0:
            raise ValueError("StabilityThresholds.smoothing_fraction must be > 0 (a fraction of "
                             "the steps), got 0.0")

    def smoothing_window(self, steps: int) -> int:
        return min(max(self.min_smoothing_steps, round(steps * self.smoothing_fraction)), max(1, steps // 2))


@dataclass(frozen=True)
class Verdict:
    """One candidate curve judged against fp32's: ``kind`` is one of ``VERDICT_KINDS``,
    ``reason`` is for the user, ``metrics`` the numbers behind it."""

    stable: bool
    kind: str
    reason: str
    metrics: Mapping[str, float | int | bool] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "metrics", dict(self.metrics))

    def to_dict(self) -> dict[str, Any]:
        # Strict JSON has no NaN or inf: those are written as "nan", "inf" and "-inf".
        metrics = {k: v if isinstance(v, bool | int) or math.isfinite(v) else str(v)
                   for k, v in self.metrics.items()}
        return {"stable": self.stable, "kind": self.kind, "reason": self.reason, "metrics": metrics}


def _as_float(name: str, index: int | None, value: Any) -> float:
    where = f"TrialCurve.{name}" + ("" if index is None else f"[{index}]")
    if isinstance(value, bool):
        raise ValueError(f"{where} must be a number, got {value!r}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{where} must be a number, got {value!r}") from None


def _optional_floats(name: str, values: Sequence[Any], what: str,
                     ok: Callable[[float], bool]) -> tuple[float | None, ...]:
    out = tuple(None if v is None else _as_float(name, i, v) for i, v in enumerate(values))
    for i, v in enumerate(out):
        if v is not None and not ok(v):
            raise ValueError(f"TrialCurve.{name}[{i}] must be {what} or None, got {v!r}")
    return out


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
    """The factor by which a positive loss fell over the last quarter of the steps, when at least
    ``GEOMETRIC_FALL`` and still above ``SEEN_FALL`` of its start."""
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


def measure_spread(reference: Sequence[float], replicate: Sequence[float],
                   window: int) -> Spread | None:
    """The spread between fp32 and its replicate, or ``None`` (the fixed limits apply alone)."""
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
    """The progress and final-gap limits of one comparison: fixed floors, widened to the spread."""

    min_progress_ratio: float
    max_final_gap: float
    multiplier: float
    reference_drop: float
    spread: Spread | None = None
    final_gap_cap: float = 1.0

    @property
    def fell_within_spread(self) -> bool:  # fp32 fell no further than a gap may reach
        spread = self.spread
        return spread is not None and 0 < self.reference_drop <= self.multiplier * spread.fall_gap

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


def pct(fraction: float) -> str:
    return f"{fraction:.0%}" if abs(fraction) >= 0.1 else f"{fraction:.1%}"
