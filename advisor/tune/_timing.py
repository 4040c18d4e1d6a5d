"""Step-time statistics: robust summaries, noise-aware comparisons, gaps and goodput.

Pure functions over recorded step times in seconds: no torch, no clocks. The shells time the
steps (synchronising the device at the edges); these functions decide what the times say.
Medians and quartiles rather than means and standard deviations, because step times on a
shared machine have heavy tails (a neighbour's burst, a page fault, a GC pause). The
distributions and the trimmed statistics come from ``scipy.stats``.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

import numpy as np

DEFAULT_WARMUP = 3
DEFAULT_MIN_MARGIN = 0.02
DEFAULT_CONFIDENCE = 0.95
# The fraction of paired runs trimmed from each end before the gap's mean (Yuen's trimmed mean):
# 20% leaves up to four pairs untouched and drops one run a neighbour's burst slowed from five.
GAP_TRIM = 0.2
MIN_SPREAD_STEPS = 8
"""Measured steps needed before ``step_spread`` reads a spread: fewer give no stable 10th percentile."""


@dataclass(frozen=True)
class TimingSummary:
    """Robust statistics of the measured (post-warm-up) step times, in seconds.

    Attributes:
        n: how many step times were summarised.
        median: the median step time.
        q1: the first quartile (25th percentile, linear interpolation).
        q3: the third quartile (75th percentile, linear interpolation).
        iqr: ``q3 - q1``.
        rel_iqr: ``iqr / median``, the spread as a fraction of the typical step.
        mean: the arithmetic mean (sensitive to outliers; reported, not used to decide).
        min: the fastest step.
    """

    n: int
    median: float
    q1: float
    q3: float
    iqr: float
    rel_iqr: float
    mean: float
    min: float

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of every field."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TimingSummary:
        """Inverse of ``to_dict``; unknown keys are ignored."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


@dataclass(frozen=True)
class Comparison:
    """Whether one configuration is faster than another, beyond the measured noise.

    Attributes:
        ratio: ``b.median / a.median``: the speedup of ``a`` over ``b`` (above 1 when ``a``
            is faster).
        verdict: ``"faster"``, ``"slower"`` or ``"tie"``, said of ``a``.
        noise: the relative band used: a lead within ``1 + noise`` either way is a tie.
    """

    ratio: float
    verdict: str
    noise: float


def summarize(step_times: Sequence[float], warmup: int = DEFAULT_WARMUP) -> TimingSummary:
    """Summarise step times after discarding the warm-up steps.

    Args:
        step_times: seconds per step, in the order they ran.
        warmup: how many leading steps to discard (cuDNN autotuning, allocator growth and
            compilation happen there).

    Returns:
        The median, quartiles, IQR, relative IQR, mean and minimum of the remaining steps.

    Raises:
        ValueError: ``warmup`` is negative, a step time is negative or not finite, or no
            step is left after the warm-up.
    """
    measured = _measured("step_times", step_times, warmup)
    ordered = sorted(measured)
    median = _quantile(ordered, 0.5)
    q1 = _quantile(ordered, 0.25)
    q3 = _quantile(ordered, 0.75)
    iqr = q3 - q1
    return TimingSummary(
        n=len(ordered),
        median=median,
        q1=q1,
        q3=q3,
        iqr=iqr,
        rel_iqr=iqr / median if median > 0 else 0.0,
        mean=math.fsum(ordered) / len(ordered),
        min=ordered[0],
    )


def noise_band(a: TimingSummary, b: TimingSummary, *, min_margin: float = DEFAULT_MIN_MARGIN) -> float:
    """The relative lead two measurements must exceed to differ: half the larger relative
    IQR, and never less than ``min_margin`` (see ``compare`` for why)."""
    return max(min_margin, max(a.rel_iqr, b.rel_iqr) / 2.0)


def compare(
    a: TimingSummary, b: TimingSummary, *, min_margin: float = DEFAULT_MIN_MARGIN
) -> Comparison:
    """Decide whether ``a`` is faster than ``b``, slower, or a tie within the noise.

    The noise band is half the larger relative IQR of the two, and never less than
    ``min_margin``. Half the IQR is how far a typical step strays from the median; a lead
    smaller than that is within what the measurement itself scatters. The band does not
    shrink with the number of steps (as a standard error would) because consecutive step
    times on a shared machine are correlated: a neighbour's job slows a run of steps, not
    single ones. ``min_margin`` keeps quiet devices (GPU step times spread well under 1%)
    from calling a winner on a lead too small to matter. The test is symmetric: ``a`` is
    faster when ``ratio > 1 + noise``, slower when ``ratio < 1 / (1 + noise)``.

    Args:
        a: summary of the configuration being judged.
        b: summary of the configuration it is compared with.
        min_margin: the smallest relative lead that can count, as a fraction (0.02 = 2%).

    Returns:
        The speedup of ``a`` over ``b``, the verdict said of ``a``, and the band used.

    Raises:
        ValueError: ``min_margin`` is negative or not finite, or a median is not positive.
    """
    if isinstance(min_margin, bool) or not (
        isinstance(min_margin, numbers.Real) and math.isfinite(min_margin) and min_margin >= 0
    ):
        raise ValueError(f"compare: min_margin must be a number >= 0, got {min_margin!r}")
    for name, summary in (("a", a), ("b", b)):
        if not summary.median > 0:
            raise ValueError(
                f"compare: {name}.median must be > 0 seconds to form a ratio, got "
                f"{summary.median!r}"
            )
    noise = noise_band(a, b, min_margin=min_margin)
    ratio = b.median / a.median
    if ratio > 1.0 + noise:
        verdict = "faster"
    elif ratio < 1.0 / (1.0 + noise):
        verdict = "slower"
    else:
        verdict = "tie"
    return Comparison(ratio=ratio, verdict=verdict, noise=noise)


@dataclass(frozen=True)
class Gap:
    """How much faster ``a`` runs than ``b`` over paired runs, with a confidence interval.

    Attributes:
        ratio: the estimated speedup of ``a`` over ``b`` (above 1 when ``a`` is faster).
        low: the lower end of its confidence interval (0.0 when there are too few pairs).
        high: the upper end (``math.inf`` when there are too few pairs).
        pairs: how many paired runs it rests on.
        confidence: the interval's confidence level.
        min_margin: the smallest relative lead that counts.
        verdict: said of ``a``: ``"faster"`` or ``"slower"`` when the whole interval lies beyond
            ``min_margin`` on one side; ``"tie"`` when it lies within ``min_margin`` either way
            (resolved: the lead is too small to matter); ``"unresolved"`` when it straddles
            the margin, so that more runs are needed to tell.
    """

    ratio: float
    low: float
    high: float
    pairs: int
    confidence: float
    min_margin: float
    verdict: str

    @property
    def resolved(self) -> bool:
        """Whether more runs could not change the verdict's kind (faster, slower or a tie)."""
        return self.verdict != "unresolved"

    @property
    def a_lead_ruled_out(self) -> bool:
        """Whether ``a`` cannot be more than ``min_margin`` faster than ``b``: the interval's
        upper end lies within the margin (its lower end may still be anywhere)."""
        return self.pairs >= 2 and self.high <= 1.0 + self.min_margin

    @property
    def b_lead_ruled_out(self) -> bool:
        """Whether ``b`` cannot be more than ``min_margin`` faster than ``a``: the interval's
        lower end lies within the margin."""
        return self.pairs >= 2 and self.low >= 1.0 / (1.0 + self.min_margin)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict; an unbounded end of the interval is ``None``."""
        data = asdict(self)
        for end in ("low", "high"):
            if not (math.isfinite(data[end]) and data[end] > 0):
                data[end] = None
        return data


def paired_gap(
    a: Sequence[float],
    b: Sequence[float],
    *,
    confidence: float = DEFAULT_CONFIDENCE,
    min_margin: float = DEFAULT_MIN_MARGIN,
) -> Gap:
    """The gap between two configurations from paired runs, with its confidence interval.

    Each pair is one run of each, back to back, so a slow spell of the machine hits both
    alike; its log ratio is one observation of the gap. The estimate is the 20%-trimmed mean of
    those log ratios, with Yuen's interval (Student's t on the winsorized variance), so that
    one run a neighbour's burst slowed does not hide a real gap. With up to four pairs
    nothing is trimmed and this is the paired t interval. Runs, unlike steps, are independent,
    so the interval narrows as runs are added (``compare`` cannot narrow, see there).

    Args:
        a: goodput (samples per second, higher is faster) of ``a`` in each paired run.
        b: goodput of ``b`` in the same runs, in the same order.
        confidence: the interval's confidence level, between 0 and 1.
        min_margin: the smallest relative lead that counts (0.02 = 2%), as in ``compare``.

    Returns:
        The gap, its interval and its verdict; with fewer than two pairs the interval is
        unbounded and the verdict ``"unresolved"``.

    Raises:
        ValueError: ``a`` and ``b`` differ in length, a goodput is not a positive finite
            number, ``confidence`` is not between 0 and 1, or ``min_margin`` is negative.
    """
    _check_gap_args(a, b, confidence, min_margin)
    logs = np.log(np.asarray(a, dtype=float) / np.asarray(b, dtype=float))
    n = len(logs)
    if n < 2:
        ratio = math.exp(logs[0]) if n else 1.0
        return Gap(ratio, 0.0, math.inf, n, confidence, min_margin, "unresolved")
    from scipy import stats  # a second of imports: only a tune that pairs its finalists pays it

    centre = float(stats.trim_mean(logs, GAP_TRIM))
    winsorized = np.asarray(stats.mstats.winsorize(logs, limits=(GAP_TRIM, GAP_TRIM)))
    half = _half_width_factor(n, confidence) * float(np.std(winsorized, ddof=1))
    low, high = centre - half, centre + half
    edge = math.log1p(min_margin)
    if low > edge:
        verdict = "faster"
    elif high < -edge:
        verdict = "slower"
    elif low >= -edge and high <= edge:
        verdict = "tie"
    else:
        verdict = "unresolved"
    return Gap(math.exp(centre), math.exp(low), math.exp(high), n, confidence, min_margin, verdict)


def _half_width_factor(n: int, confidence: float) -> float:
    """Yuen's interval half-width over ``n`` pairs per unit of winsorized standard deviation
    (``GAP_TRIM`` cut from each end; with up to four pairs, the paired t interval's)."""
    h = n - 2 * int(GAP_TRIM * n)
    from scipy import stats

    return float(stats.t.ppf(0.5 + confidence / 2.0, h - 1)) * math.sqrt((n - 1) / (h * (h - 1)))


def _check_gap_args(a: Sequence[float], b: Sequence[float], confidence: float, min_margin: float) -> None:
    """Raise a ValueError naming the first argument of ``paired_gap`` that is not allowed."""
    if len(a) != len(b):
        raise ValueError(
            f"paired_gap: a has {len(a)} runs but b has {len(b)}; give one goodput of each per pair"
        )
    for name, values in (("a", a), ("b", b)):
        for i, v in enumerate(values):
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or not (math.isfinite(v) and v > 0):
                raise ValueError(f"paired_gap: {name}[{i}] must be a goodput > 0, got {v!r}")
    if isinstance(confidence, bool) or not (isinstance(confidence, numbers.Real) and 0.0 < confidence < 1.0):
        raise ValueError(f"paired_gap: confidence must be between 0 and 1 (0.95 = 95%), got {confidence!r}")
    if isinstance(min_margin, bool) or not (
        isinstance(min_margin, numbers.Real) and math.isfinite(min_margin) and min_margin >= 0
    ):
        raise ValueError(f"paired_gap: min_margin must be a number >= 0, got {min_margin!r}")


def goodput(
    samples_per_step: int,
    step_times: Sequence[float],
    skipped: Sequence[bool],
    warmup: int = DEFAULT_WARMUP,
    *,
    calibration_steps: int = 0,
) -> float:
    """Samples per second that reach the optimizer, counting skipped steps as lost.

    ``samples_per_step * (1 - skip_fraction) / median_step_time`` over the steps after the
    warm-up: a skipped step costs its time but its samples do not count. The median rather
    than total time keeps one slow step on a noisy machine from moving the answer.

    Args:
        samples_per_step: samples in one optimizer step (the global batch).
        step_times: seconds per optimizer step, in the order they ran.
        skipped: per step, whether the GradScaler skipped it; empty when no scaler ran.
        warmup: how many leading steps to discard, from both sequences.
        calibration_steps: skips within the first ``calibration_steps`` steps (counted from
            step 0) are not counted as lost: the scaler's initial back-off from 2**16 is a
            one-time cost that a long run amortises. Pass the stability thresholds' value to
            match the stability judgement; 0 counts every skip.

    Returns:
        Samples per second.

    Raises:
        ValueError: ``samples_per_step`` is not a positive integer, the sequences differ in
            length, a step time is invalid, or no step is left after the warm-up.
    """
    if isinstance(samples_per_step, bool) or not isinstance(samples_per_step, int):
        raise ValueError(
            f"goodput: samples_per_step must be a positive integer, got {samples_per_step!r}"
        )
    if samples_per_step <= 0:
        raise ValueError(
            f"goodput: samples_per_step must be a positive integer, got {samples_per_step!r}"
        )
    if isinstance(calibration_steps, bool) or not isinstance(calibration_steps, int):
        raise ValueError(
            f"goodput: calibration_steps must be an integer >= 0, got {calibration_steps!r}"
        )
    if calibration_steps < 0:
        raise ValueError(
            f"goodput: calibration_steps must be an integer >= 0, got {calibration_steps!r}"
        )
    if skipped and len(skipped) != len(step_times):
        raise ValueError(
            f"goodput: skipped has {len(skipped)} entries but step_times has "
            f"{len(step_times)}; give one per step, or none when no scaler ran"
        )
    summary = summarize(step_times, warmup)
    start = max(warmup, calibration_steps)
    lost = sum(1 for s in list(skipped)[start:] if s)
    skip_fraction = lost / summary.n
    return samples_per_step * (1.0 - skip_fraction) / summary.median


def step_spread(step_times: Sequence[float], warmup: int) -> float | None:
    """The 90th percentile of the measured step times over their 10th; ``None`` with fewer than
    ``MIN_SPREAD_STEPS`` measured steps, or a zero 10th percentile."""
    measured = sorted(float(t) for t in list(step_times)[warmup:])
    if len(measured) < MIN_SPREAD_STEPS:
        return None
    low, high = _quantile(measured, 0.1), _quantile(measured, 0.9)
    return high / low if low > 0 else None


def step_time_range(step_times: Sequence[float], warmup: int) -> tuple[float, float] | None:
    """The 10th and 90th percentiles of the measured step times, in seconds: the spread a
    search row's speed-up carries (wider, never narrower, than the truth with few steps, where
    they near the fastest and the slowest step); ``None`` with fewer than two measured steps or
    a non-finite one."""
    measured = sorted(float(t) for t in list(step_times)[warmup:])
    if len(measured) < 2 or not all(math.isfinite(t) and t >= 0 for t in measured):
        return None
    return _quantile(measured, 0.1), _quantile(measured, 0.9)


def _measured(name: str, step_times: Sequence[float], warmup: int) -> list[float]:
    """The step times after the warm-up, validated."""
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be an integer >= 0, got {warmup!r}")
    values = []
    for i, v in enumerate(step_times):
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v) or v < 0:
            raise ValueError(f"{name}[{i}] must be a finite number of seconds >= 0, got {v!r}")
        values.append(float(v))
    if len(values) <= warmup:
        raise ValueError(
            f"{name} has {len(values)} steps and warmup discards {warmup}, leaving none to "
            "measure; time more steps or lower warmup"
        )
    return values[warmup:]


def _quantile(ordered: Sequence[float], p: float) -> float:
    """The p-quantile of sorted values by linear interpolation (numpy's default)."""
    pos = p * (len(ordered) - 1)
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)
