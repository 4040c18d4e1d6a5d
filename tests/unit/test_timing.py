"""Step-time summaries, noise-aware comparisons and goodput on fixed sample sets."""

from __future__ import annotations

import math
import random

import pytest
from scipy import stats

from advisor.tune._timing import (
    Comparison,
    TimingSummary,
    compare,
    goodput,
    paired_gap,
    summarize,
)


def noisy(median: float, spread: float, n: int = 60, seed: int = 0) -> list[float]:
    """Step times around ``median``, uniform within +-``spread`` (a fraction), after 3 slow
    warm-up steps."""
    rng = random.Random(seed)
    warm = [median * 10.0] * 3
    return warm + [median * (1.0 + rng.uniform(-spread, spread)) for _ in range(n)]


def test_warmup_is_discarded() -> None:
    summary = summarize([5.0, 4.0, 3.0, 1.0, 1.0, 1.0])
    assert summary.n == 3
    assert summary.median == 1.0
    assert summary.mean == 1.0
    assert summary.min == 1.0


def test_warmup_zero_keeps_every_step() -> None:
    assert summarize([5.0, 1.0, 1.0], warmup=0).n == 3
    assert summarize([5.0, 1.0, 1.0], warmup=0).mean == pytest.approx(7.0 / 3.0)


def test_quartiles_iqr_and_relative_iqr() -> None:
    summary = summarize([9.0, 1.0, 5.0, 3.0, 7.0, 2.0, 8.0, 4.0, 6.0], warmup=0)
    assert summary == TimingSummary(
        n=9, median=5.0, q1=3.0, q3=7.0, iqr=4.0, rel_iqr=0.8, mean=5.0, min=1.0
    )


def test_quartiles_interpolate_between_samples() -> None:
    summary = summarize([1.0, 2.0, 3.0, 4.0], warmup=0)
    assert summary.median == 2.5
    assert summary.q1 == pytest.approx(1.75)
    assert summary.q3 == pytest.approx(3.25)


def test_single_sample_has_no_spread() -> None:
    summary = summarize([3.0, 3.0, 3.0, 0.5])
    assert (summary.n, summary.median, summary.iqr, summary.rel_iqr) == (1, 0.5, 0.0, 0.0)


def test_nothing_left_after_warmup_is_an_error() -> None:
    with pytest.raises(ValueError, match="step_times has 3 steps and warmup discards 3"):
        summarize([1.0, 1.0, 1.0])


@pytest.mark.parametrize(
    ("times", "warmup", "match"),
    [
        ([1.0, -1.0], 0, r"step_times\[1\]"),
        ([1.0, math.nan], 0, r"step_times\[1\]"),
        ([1.0, math.inf], 0, r"step_times\[1\]"),
        ([1.0, "2"], 0, r"step_times\[1\]"),
        ([1.0, 1.0], -1, "warmup"),
    ],
)
def test_invalid_input_names_the_problem(times: list[object], warmup: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        summarize(times, warmup)  # type: ignore[arg-type]


# --- compare -------------------------------------------------------------------------------


def test_clear_speedup_is_faster() -> None:
    fast = summarize(noisy(0.010, 0.01, seed=1))
    slow = summarize(noisy(0.020, 0.01, seed=2))
    result = compare(fast, slow)
    assert result.verdict == "faster"
    assert result.ratio == pytest.approx(2.0, rel=0.02)
    assert compare(slow, fast).verdict == "slower"
    assert compare(slow, fast).ratio == pytest.approx(1.0 / result.ratio)


def test_small_lead_within_noisy_samples_is_a_tie() -> None:
    # The build machine's step times vary ~20% between quartiles: a 5% lead is noise.
    a = summarize(noisy(0.0095, 0.2, seed=3))
    b = summarize(noisy(0.0100, 0.2, seed=4))
    assert a.rel_iqr > 0.15
    result = compare(a, b)
    assert result.verdict == "tie"
    assert result.noise == pytest.approx(max(a.rel_iqr, b.rel_iqr) / 2.0)
    assert compare(b, a).verdict == "tie"


def test_same_lead_with_quiet_samples_is_faster() -> None:
    a = summarize(noisy(0.0095, 0.005, seed=3))
    b = summarize(noisy(0.0100, 0.005, seed=4))
    result = compare(a, b)
    assert result.verdict == "faster"
    assert result.noise == 0.02  # the floor: the measured noise is below it


def test_min_margin_is_honoured() -> None:
    a = summarize([1.0, 1.0, 1.0, 0.99, 0.99, 0.99])
    b = summarize([1.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    assert compare(a, b).verdict == "tie"
    assert compare(a, b, min_margin=0.005) == Comparison(
        ratio=pytest.approx(1.0 / 0.99), verdict="faster", noise=0.005
    )


def test_band_edges_are_symmetric() -> None:
    b = summarize([1.0] * 4, warmup=0)
    just_inside = summarize([1.0 / 1.0199] * 4, warmup=0)
    just_outside = summarize([1.0 / 1.0201] * 4, warmup=0)
    assert compare(just_inside, b).verdict == "tie"
    assert compare(just_outside, b).verdict == "faster"
    assert compare(b, just_inside).verdict == "tie"
    assert compare(b, just_outside).verdict == "slower"


def test_compare_rejects_zero_median() -> None:
    a = summarize([1.0, 1.0], warmup=0)
    zero = summarize([0.0, 0.0], warmup=0)
    with pytest.raises(ValueError, match="b.median"):
        compare(a, zero)


# --- goodput -------------------------------------------------------------------------------


def test_goodput_without_skips_is_samples_over_median() -> None:
    times = [9.0, 9.0, 9.0, 0.5, 0.5, 0.4, 0.6, 0.5]
    assert goodput(32, times, []) == pytest.approx(64.0)
    assert goodput(32, times, [False] * 8) == pytest.approx(64.0)


def test_goodput_counts_skipped_steps_as_lost() -> None:
    times = [9.0, 9.0, 9.0] + [0.5] * 8
    skipped = [False] * 3 + [True, False, True, False, False, False, False, False]
    # 2 of the 8 measured steps skipped: 25% of samples lost, time still spent.
    assert goodput(32, times, skipped) == pytest.approx(32 * 0.75 / 0.5)


def test_goodput_ignores_skips_in_warmup_and_calibration() -> None:
    times = [0.5] * 20
    skipped = [i < 10 for i in range(20)]
    assert goodput(10, times, skipped) == pytest.approx(10 * (1 - 7 / 17) / 0.5)
    assert goodput(10, times, skipped, calibration_steps=10) == pytest.approx(20.0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"skipped": [False] * 4}, "skipped has 4 entries but step_times has 5"),
        ({"warmup": 5}, "warmup discards 5"),
    ],
)
def test_goodput_validation(kwargs: dict[str, object], match: str) -> None:
    args: dict[str, object] = {
        "samples_per_step": 8,
        "step_times": [1.0] * 5,
        "skipped": [False] * 5,
    }
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        goodput(**args)  # type: ignore[arg-type]


# --- paired gaps ---------------------------------------------------------------------------


def paired_runs(gap: float, sigma: float, n: int, seed: int = 0) -> tuple[list[float], list[float]]:
    """Goodputs of ``a`` (``gap`` times faster) and ``b`` in ``n`` paired runs, each run off by
    a lognormal factor of spread ``sigma``."""
    rng = random.Random(seed)
    a = [100.0 * gap * math.exp(rng.gauss(0.0, sigma)) for _ in range(n)]
    b = [100.0 * math.exp(rng.gauss(0.0, sigma)) for _ in range(n)]
    return a, b


def test_quiet_pairs_resolve_a_real_gap_quickly() -> None:
    gap = paired_gap(*paired_runs(1.19, 0.01, 3))
    assert gap.verdict == "faster" and gap.resolved
    assert gap.low < 1.19 < gap.high and gap.ratio == pytest.approx(1.19, rel=0.02)
    assert gap.pairs == 3 and gap.confidence == 0.95


def test_noisy_pairs_leave_a_gap_unresolved_until_more_runs_come() -> None:
    a, b = paired_runs(1.19, 0.15, 10, seed=3)
    assert paired_gap(a[:2], b[:2]).verdict == "unresolved"
    assert paired_gap(a, b).verdict == "faster"


def test_a_gap_within_the_margin_is_a_resolved_tie() -> None:
    gap = paired_gap([101.0, 101.0, 101.0], [100.0, 100.0, 100.0])
    assert gap.verdict == "tie" and gap.resolved
    assert gap.ratio == pytest.approx(1.01) and gap.low == pytest.approx(1.01)
    assert paired_gap([101.0] * 3, [100.0] * 3, min_margin=0.005).verdict == "faster"


def test_slower_is_said_of_a() -> None:
    a, b = paired_runs(1.19, 0.01, 3)
    assert paired_gap(b, a).verdict == "slower"
    assert paired_gap(b, a).ratio == pytest.approx(1.0 / paired_gap(a, b).ratio)


def test_one_run_slowed_by_a_neighbour_does_not_hide_the_gap() -> None:
    # Five clean pairs 19% apart, and one in which b's run was slowed threefold: the trimmed
    # mean drops it, where a plain t interval would be swamped by it.
    a, b = paired_runs(1.19, 0.03, 6, seed=1)
    b[2] /= 3.0
    gap = paired_gap(a, b)
    assert gap.verdict == "faster" and gap.ratio == pytest.approx(1.19, rel=0.05)
    logs = [math.log(x / y) for x, y in zip(a, b)]
    mean = sum(logs) / len(logs)
    sd = math.sqrt(sum((v - mean) ** 2 for v in logs) / (len(logs) - 1))
    assert mean - stats.t.ppf(0.975, 5) * sd / math.sqrt(len(logs)) < 0  # the plain interval would not resolve


def test_fewer_than_two_pairs_give_no_interval() -> None:
    one = paired_gap([120.0], [100.0])
    assert one.verdict == "unresolved" and one.low == 0.0 and one.high == math.inf
    assert one.to_dict()["low"] is None and one.to_dict()["high"] is None
    assert paired_gap([], []).pairs == 0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"a": [1.0, 2.0], "b": [1.0]}, "a has 2 runs but b has 1"),
        ({"a": [1.0, 0.0], "b": [1.0, 1.0]}, r"a\[1\] must be a goodput > 0"),
        ({"a": [1.0, 1.0], "b": [1.0, math.nan]}, r"b\[1\] must be a goodput > 0"),
    ],
)
def test_paired_gap_validation(kwargs: dict[str, object], match: str) -> None:
    args: dict[str, object] = {"a": [1.0, 1.1], "b": [1.0, 1.0]}
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        paired_gap(**args)  # type: ignore[arg-type]
