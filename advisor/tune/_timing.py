"""Step-time statistics: robust summaries, noise-aware comparisons and goodput.

Pure functions over recorded step times in seconds: no torch, no clocks. The shells time the
steps (synchronising the device at the edges); these functions decide what the times say.
Medians and quartiles rather than means and standard deviations, because step times on a
shared machine have heavy tails (a neighbour's burst, a page fault, a GC pause).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

DEFAULT_WARMUP = 3
DEFAULT_MIN_MARGIN = 0.02


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
