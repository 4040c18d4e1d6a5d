"""Step-time statistics: robust summaries, noise-aware comparisons, gaps and goodput (medians and
quartiles: step times on a shared machine have heavy tails)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

DEFAULT_WARMUP = 3
DEFAULT_MIN_MARGIN = 0.02
DEFAULT_CONFIDENCE = 0.95
# The fraction of paired runs trimmed from each end before the gap's mean (Yuen's trimmed mean):
# 20% leaves up to four pairs untouched and drops one run a neighbour's burst slowed from five.
GAP_TRIM = 0.2
MIN_SPREAD_STEPS = 8  # fewer measured steps give no stable 10th percentile


@dataclass(frozen=True)
class TimingSummary:
    """Robust statistics of the measured (post-warm-up) step times, in seconds."""

    n: int
    median: float
    q1: float
    q3: float
    iqr: float
    rel_iqr: float
    mean: float
    min: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Comparison:
    """``ratio`` is ``b.median / a.median``; ``verdict`` (faster, slower, tie) is said of ``a``;
    a lead within ``1 + noise`` either way is a tie."""

    ratio: float
    verdict: str
    noise: float


def summarize(step_times: Sequence[float], warmup: int = DEFAULT_WARMUP) -> TimingSummary:
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be an integer >= 0, got {warmup!r}")
    for i, v in enumerate(step_times):
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v) or v < 0:
            raise ValueError(f"step_times[{i}] must be a finite number of seconds >= 0, got {v!r}")
    if len(step_times) <= warmup:
        raise ValueError(f"step_times has {len(step_times)} steps and warmup discards {warmup}, "
                         "leaving none to measure; time more steps or lower warmup")
    measured = np.asarray(step_times[warmup:], dtype=float)
    median, q1, q3 = (float(v) for v in np.quantile(measured, [0.5, 0.25, 0.75]))
    return TimingSummary(n=len(measured), median=median, q1=q1, q3=q3, iqr=q3 - q1,
                         rel_iqr=(q3 - q1) / median if median > 0 else 0.0,
                         mean=math.fsum(measured) / len(measured), min=float(measured.min()))


def noise_band(a: TimingSummary, b: TimingSummary, *, min_margin: float = DEFAULT_MIN_MARGIN) -> float:
    """The relative lead two measurements must exceed to differ (see ``compare``)."""
    return max(min_margin, max(a.rel_iqr, b.rel_iqr) / 2.0)


def compare(a: TimingSummary, b: TimingSummary, *, min_margin: float = DEFAULT_MIN_MARGIN) -> Comparison:
    """Whether ``a`` is faster than ``b``, slower, or a tie within the noise: half the larger
    relative IQR, never less than ``min_margin``. It does not shrink with the steps, as a standard
    error would: a neighbour's job slows a run of consecutive steps, not single ones."""
    for name, summary in (("a", a), ("b", b)):
        if not summary.median > 0:
            raise ValueError(f"compare: {name}.median must be > 0 seconds to form a ratio, got {summary.median!r}")
    noise = noise_band(a, b, min_margin=min_margin)
    ratio = b.median / a.median
    verdict = "faster" if ratio > 1.0 + noise else "slower" if ratio < 1.0 / (1.0 + noise) else "tie"
    return Comparison(ratio=ratio, verdict=verdict, noise=noise)


@dataclass(frozen=True)
class Gap:
    """How much faster ``a`` runs than ``b`` over paired runs, with a confidence interval (0 and inf
    under two pairs). ``verdict``, of ``a``: faster/slower with the whole interval beyond
    ``min_margin`` on one side, tie within it, unresolved across it."""

    ratio: float
    low: float
    high: float
    pairs: int
    confidence: float
    min_margin: float
    verdict: str

    @property
    def resolved(self) -> bool:
        return self.verdict != "unresolved"

    @property
    def a_lead_ruled_out(self) -> bool:  # a is at most min_margin faster than b
        return self.pairs >= 2 and self.high <= 1.0 + self.min_margin

    @property
    def b_lead_ruled_out(self) -> bool:  # b is at most min_margin faster than a
        return self.pairs >= 2 and self.low >= 1.0 / (1.0 + self.min_margin)

    def to_dict(self) -> dict[str, Any]:  # an unbounded end of the interval is None
        data = asdict(self)
        for end in ("low", "high"):
            if not (math.isfinite(data[end]) and data[end] > 0):
                data[end] = None
        return data


def paired_gap(a: Sequence[float], b: Sequence[float], *, confidence: float = DEFAULT_CONFIDENCE,
               min_margin: float = DEFAULT_MIN_MARGIN) -> Gap:
    """The gap between two configurations from goodputs of paired runs (back to back, so a slow
    spell hits both alike): the 20%-trimmed mean of the log ratios with Yuen's interval, so one run
    a neighbour's burst slowed hides no real gap (up to four pairs, the paired t interval). Runs,
    unlike steps, are independent: it narrows with runs."""
    if len(a) != len(b):
        raise ValueError(f"paired_gap: a has {len(a)} runs but b has {len(b)}; give one goodput of each per pair")
    for name, values in (("a", a), ("b", b)):
        for i, v in enumerate(values):
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or not (math.isfinite(v) and v > 0):
                raise ValueError(f"paired_gap: {name}[{i}] must be a goodput > 0, got {v!r}")
    logs = np.log(np.asarray(a, dtype=float) / np.asarray(b, dtype=float))
    n = len(logs)
    if n < 2:
        return Gap(math.exp(logs[0]) if n else 1.0, 0.0, math.inf, n, confidence, min_margin, "unresolved")
    from scipy import stats  # a second of imports: only a tune that pairs its finalists pays it

    h = n - 2 * int(GAP_TRIM * n)
    winsorized = np.asarray(stats.mstats.winsorize(logs, limits=(GAP_TRIM, GAP_TRIM)))
    half = (float(stats.t.ppf(0.5 + confidence / 2.0, h - 1)) * math.sqrt((n - 1) / (h * (h - 1)))
            * float(np.std(winsorized, ddof=1)))
    centre = float(stats.trim_mean(logs, GAP_TRIM))
    low, high = centre - half, centre + half
    edge = math.log1p(min_margin)
    verdict = ("faster" if low > edge else "slower" if high < -edge
               else "tie" if low >= -edge and high <= edge else "unresolved")
    return Gap(math.exp(centre), math.exp(low), math.exp(high), n, confidence, min_margin, verdict)


def rounds_gap(a: Sequence[float | None], b: Sequence[float | None]) -> Gap:
    """``paired_gap`` over the rounds both ran (``None`` marks a round one sat out)."""
    pairs = [(x, y) for x, y in zip(a, b) if x is not None and y is not None]
    return paired_gap([x for x, _ in pairs], [y for _, y in pairs])


def goodput(samples_per_step: int, step_times: Sequence[float], skipped: Sequence[bool],
            warmup: int = DEFAULT_WARMUP, *, calibration_steps: int = 0) -> float:
    """Samples per second that reach the optimizer after the warm-up, over the median step time:
    a skipped step costs its time but its samples do not count, except within the first
    ``calibration_steps`` (the scaler's initial back-off, a one-time cost)."""
    if skipped and len(skipped) != len(step_times):
        raise ValueError(f"goodput: skipped has {len(skipped)} entries but step_times has "
                         f"{len(step_times)}; give one per step, or none when no scaler ran")
    summary = summarize(step_times, warmup)
    lost = sum(1 for s in list(skipped)[max(warmup, calibration_steps):] if s)
    return samples_per_step * (1.0 - lost / summary.n) / summary.median


def step_spread(step_times: Sequence[float], warmup: int) -> float | None:
    """The 90th percentile of the measured step times over their 10th, or ``None``."""
    if len(step_times) - warmup < MIN_SPREAD_STEPS:
        return None
    found = step_time_range(step_times, warmup)
    return found[1] / found[0] if found and found[0] > 0 else None


def step_time_range(step_times: Sequence[float], warmup: int) -> tuple[float, float] | None:
    """The 10th and 90th percentiles of the measured step times (a row's spread), or ``None``."""
    measured = [float(t) for t in list(step_times)[warmup:]]
    if len(measured) < 2 or not all(math.isfinite(t) and t >= 0 for t in measured):
        return None
    low, high = np.quantile(measured, [0.1, 0.9])
    return float(low), float(high)

