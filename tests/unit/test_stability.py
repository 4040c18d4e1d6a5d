"""Stability verdicts on synthetic curves, one per failure kind, plus the ok cases."""

from __future__ import annotations

import json
import math
import random

import pytest

from advisor.tune._stability import (
    VERDICT_KINDS,
    StabilityThresholds,
    TrialCurve,
    Verdict,
    judge,
    safety_rank,
    smooth,
)
from policies import safety_order

STEPS = 300


def decay(
    start: float, end: float, n: int = STEPS, noise: float = 0.0, seed: int = 0
) -> list[float]:
    """An exponentially decaying loss from ``start`` towards ``end``, with seeded noise."""
    rng = random.Random(seed)
    tau = n / 5
    out = []
    for i in range(n):
        value = end + (start - end) * math.exp(-i / tau)
        out.append(value * (1.0 + rng.gauss(0.0, noise)))
    return out


def curve(mode: str, losses: list[float], **kwargs: object) -> TrialCurve:
    return TrialCurve(mode=mode, losses=tuple(losses), **kwargs)


@pytest.fixture
def reference() -> TrialCurve:
    # Measured on the build machine: fp32 went 1.25 -> 0.72 in 300 steps.
    return curve("fp32", decay(1.25, 0.72, noise=0.02, seed=1))


# --- ok ------------------------------------------------------------------------------------


def test_small_noise_is_ok(reference: TrialCurve) -> None:
    candidate = curve("bf16-mixed", decay(1.25, 0.72, noise=0.02, seed=2))
    verdict = judge(candidate, reference)
    assert verdict.kind == "ok", verdict.reason
    assert verdict.stable is True
    assert 0.9 < verdict.metrics["progress_ratio"] < 1.1
    assert abs(verdict.metrics["final_gap"]) < 0.02
    assert verdict.metrics["steps"] == STEPS
    assert "bf16-mixed is stable over 300 steps" in verdict.reason


def test_reference_against_itself_is_ok(reference: TrialCurve) -> None:
    verdict = judge(reference, reference)
    assert verdict.kind == "ok"
    assert verdict.metrics["progress_ratio"] == pytest.approx(1.0)
    assert verdict.metrics["final_gap"] == pytest.approx(0.0)


def test_default_thresholds_used_when_none(reference: TrialCurve) -> None:
    candidate = curve("bf16-true", decay(1.25, 0.92))
    assert judge(candidate, reference, None) == judge(candidate, reference, StabilityThresholds())


def test_fp16_mixed_calibration_skips_and_their_nan_losses_are_ignored(
    reference: TrialCurve,
) -> None:
    losses = decay(1.25, 0.72, noise=0.02, seed=3)
    skipped = [i < 12 for i in range(STEPS)]
    losses[3] = math.inf  # forward overflowed while the scale was still too high
    scales = [2.0**16 / 2 ** min(i + 1, 12) for i in range(STEPS)]
    candidate = curve("fp16-mixed", losses, skipped=tuple(skipped), loss_scale=tuple(scales))
    verdict = judge(candidate, reference)
    assert verdict.kind == "ok", verdict.reason
    assert verdict.metrics["skips_after_calibration"] == 0
    assert verdict.metrics["min_scale"] == 16.0


def test_one_skip_after_calibration_is_tolerated(reference: TrialCurve) -> None:
    skipped = [i == 100 for i in range(STEPS)]
    candidate = curve("fp16-mixed", decay(1.25, 0.72, noise=0.02, seed=4), skipped=tuple(skipped))
    verdict = judge(candidate, reference, StabilityThresholds(max_skip_fraction=0.0))
    assert verdict.kind == "ok", verdict.reason
    assert verdict.metrics["skips_after_calibration"] == 1


def test_candidate_doing_better_than_reference_is_ok(reference: TrialCurve) -> None:
    candidate = curve("tf32", decay(1.25, 0.60, noise=0.02, seed=5))
    verdict = judge(candidate, reference)
    assert verdict.kind == "ok", verdict.reason
    assert verdict.metrics["final_gap"] < 0


# --- diverged ------------------------------------------------------------------------------


def test_nan_on_applied_step_is_divergence(reference: TrialCurve) -> None:
    losses = decay(1.25, 0.72)
    losses[36:] = [math.nan] * (STEPS - 36)
    verdict = judge(curve("fp16-true", losses), reference)
    assert verdict.kind == "diverged"
    assert verdict.stable is False
    assert "NaN at step 37 of 300" in verdict.reason
    assert "fp16-mixed" in verdict.reason  # advice: use loss scaling
    assert verdict.metrics["first_nonfinite_step"] == 37


def test_inf_is_named_as_inf(reference: TrialCurve) -> None:
    losses = decay(1.25, 0.72)
    losses[5] = math.inf
    verdict = judge(curve("bf16-true", losses), reference)
    assert verdict.kind == "diverged"
    assert "became inf at step 6" in verdict.reason
    assert "bf16-mixed" in verdict.reason


def test_divergence_is_reported_even_before_enough_steps(reference: TrialCurve) -> None:
    losses = decay(1.25, 0.72, n=10)
    losses[7] = math.nan
    verdict = judge(curve("fp16-true", losses), reference)
    assert verdict.kind == "diverged"
    assert "step 8 of 10" in verdict.reason


def test_nonfinite_to_the_end_is_divergence_even_when_skipped(reference: TrialCurve) -> None:
    losses = decay(1.25, 0.72)
    losses[200:] = [math.nan] * (STEPS - 200)
    skipped = tuple(i >= 200 for i in range(STEPS))
    verdict = judge(curve("fp16-mixed", losses, skipped=skipped), reference)
    assert verdict.kind == "diverged"
    assert "from step 201" in verdict.reason
    assert verdict.metrics["first_nonfinite_step"] == 201


def test_climbing_loss_is_divergence(reference: TrialCurve) -> None:
    # Falls at first, then climbs away: finite, but ends well above its start.
    losses = [1.25 - 0.002 * i if i < 50 else 1.15 + 0.004 * (i - 50) for i in range(STEPS)]
    verdict = judge(curve("fp8-te", losses), reference)
    assert verdict.kind == "diverged", verdict.reason
    assert "rose" in verdict.reason
    assert "bf16-mixed" in verdict.reason  # fp8 advice
    assert verdict.metrics["candidate_rise"] > 0.05


def test_climb_is_not_divergence_when_reference_climbs_too() -> None:
    rising = [1.0 + 0.002 * i for i in range(STEPS)]
    reference = curve("fp32", rising)
    candidate = curve("bf16-mixed", [v * 1.01 for v in rising])
    verdict = judge(candidate, reference)
    assert verdict.kind == "ok", verdict.reason
    assert verdict.metrics["reference_flat"] is True


# --- stalled -------------------------------------------------------------------------------


def test_pure_bf16_stall_as_measured(reference: TrialCurve) -> None:
    # Measured on the build machine: pure bf16 stopped at 0.92 where fp32 reached 0.72.
    candidate = curve("bf16-true", decay(1.25, 0.92, noise=0.02, seed=6))
    verdict = judge(candidate, reference)
    assert verdict.kind == "stalled"
    assert verdict.stable is False
    ratio = verdict.metrics["progress_ratio"]
    assert 0.3 < ratio < 0.75
    assert f"fell {ratio:.0%} as far as fp32's" in verdict.reason
    assert "over 300 steps" in verdict.reason
    assert "pure bf16" in verdict.reason
    assert "use bf16-mixed" in verdict.reason


def test_candidate_that_does_not_fall_is_stalled(reference: TrialCurve) -> None:
    candidate = curve("fp8-torchao", [1.25] * STEPS)
    verdict = judge(candidate, reference)
    assert verdict.kind == "stalled"
    assert "did not fall" in verdict.reason


def test_offset_curve_fails_the_final_gap(reference: TrialCurve) -> None:
    # Same progress, but the whole curve sits 8% higher (a quantisation offset).
    candidate = curve("fp8-te", [v * 1.08 for v in reference.losses])
    verdict = judge(candidate, reference)
    assert verdict.kind == "stalled", verdict.reason
    assert verdict.metrics["progress_ratio"] >= 0.9
    gap = verdict.metrics["final_gap"]
    assert gap == pytest.approx(0.08, abs=0.01)
    assert f"{gap:.1%} higher" in verdict.reason
    assert "limit 5.0%" in verdict.reason


# --- loss scaler ---------------------------------------------------------------------------


def test_persistent_skips_after_calibration(reference: TrialCurve) -> None:
    rng = random.Random(7)
    skipped = tuple(i < 16 or rng.random() < 0.31 for i in range(STEPS))
    scales = tuple(2.0**16 / 2 ** min(i, 24) for i in range(STEPS))
    scales = tuple(max(s, 2.0**-8) for s in scales)
    candidate = curve(
        "fp16-mixed",
        decay(1.25, 0.72, noise=0.02, seed=8),
        skipped=skipped,
        loss_scale=scales,
    )
    verdict = judge(candidate, reference, StabilityThresholds(min_loss_scale=0.0))
    assert verdict.kind == "skips", verdict.reason
    fraction = verdict.metrics["skip_fraction"]
    skips = verdict.metrics["skips_after_calibration"]
    assert skips == sum(skipped[16:])
    assert fraction == pytest.approx(skips / 284)
    assert f"skipped {fraction:.0%} of steps after the first 16" in verdict.reason
    assert f"({skips} of 284" in verdict.reason
    assert "0.0039 (2^-8)" in verdict.reason
    assert "bf16-mixed" in verdict.reason


def test_scale_collapse_below_one(reference: TrialCurve) -> None:
    scales = tuple(max(2.0**16 / 2**i, 2.0**-8) for i in range(STEPS))
    skipped = tuple(i < 24 for i in range(STEPS))
    candidate = curve(
        "fp16-mixed", decay(1.25, 0.72, noise=0.02, seed=9), skipped=skipped, loss_scale=scales
    )
    verdict = judge(candidate, reference)
    assert verdict.kind == "scale_collapse"
    assert verdict.metrics["min_scale"] == 2.0**-8
    assert "collapsed to 0.0039 (2^-8)" in verdict.reason
    assert "below the limit of 1" in verdict.reason


def test_heavy_underflow(reference: TrialCurve) -> None:
    underflow = tuple(None if i % 10 else 0.12 + 0.0002 * i for i in range(STEPS))
    candidate = curve(
        "fp16-mixed",
        decay(1.25, 0.72, noise=0.02, seed=10),
        skipped=(False,) * STEPS,
        loss_scale=(4.0,) * STEPS,
        underflow=underflow,
    )
    verdict = judge(candidate, reference)
    assert verdict.kind == "underflow", verdict.reason
    measured = [u for i, u in enumerate(underflow) if u is not None and i >= 16]
    assert verdict.metrics["mean_underflow"] == pytest.approx(sum(measured) / len(measured))
    assert verdict.metrics["max_underflow"] == pytest.approx(max(measured))
    assert f"{verdict.metrics['mean_underflow']:.0%}" in verdict.reason
    assert "2^-24" in verdict.reason  # the threshold the underflow evidence is for
    assert "lowest loss scale 4" in verdict.reason


def test_light_underflow_is_ok(reference: TrialCurve) -> None:
    candidate = curve(
        "fp16-mixed",
        decay(1.25, 0.72, noise=0.02, seed=11),
        underflow=(0.01,) * STEPS,
    )
    verdict = judge(candidate, reference)
    assert verdict.kind == "ok", verdict.reason
    assert verdict.metrics["mean_underflow"] == pytest.approx(0.01)


def test_scaler_problems_are_reported_before_the_stall_they_cause(reference: TrialCurve) -> None:
    skipped = tuple(i % 2 == 0 for i in range(STEPS))
    candidate = curve("fp16-mixed", decay(1.25, 0.95), skipped=skipped)
    assert judge(candidate, reference).kind == "skips"


# --- no verdict possible -------------------------------------------------------------------


def test_reference_not_finite() -> None:
    losses = decay(1.25, 0.72)
    losses[11] = math.nan
    reference = curve("fp32", losses)
    verdict = judge(curve("bf16-mixed", decay(1.25, 0.72)), reference)
    assert verdict.kind == "reference_not_finite"
    assert verdict.stable is False
    assert "no verdict possible" in verdict.reason
    assert "fp32 reference" in verdict.reason
    assert "step 12 of 300" in verdict.reason
    assert "learning rate" in verdict.reason
    assert verdict.metrics["reference_first_nonfinite_step"] == 12


def test_too_short(reference: TrialCurve) -> None:
    candidate = curve("bf16-mixed", decay(1.25, 0.72, n=20))
    verdict = judge(candidate, reference)
    assert verdict.kind == "too_short"
    assert verdict.stable is False
    assert "20 steps compared, need at least 32" in verdict.reason
    assert verdict.metrics["steps"] == 20


def test_curves_are_compared_over_their_common_length(reference: TrialCurve) -> None:
    candidate = curve("bf16-mixed", list(reference.losses[:150]))
    verdict = judge(candidate, reference)
    assert verdict.metrics["steps"] == 150
    assert verdict.kind == "ok", verdict.reason


# --- flat reference ------------------------------------------------------------------------


def test_flat_reference_judges_final_gap_only() -> None:
    reference = curve("fp32", decay(1.0, 0.995, noise=0.005, seed=12))
    candidate = curve("bf16-mixed", decay(1.0, 0.99, noise=0.005, seed=13))
    verdict = judge(candidate, reference)
    assert verdict.kind == "ok", verdict.reason
    assert verdict.metrics["reference_flat"] is True
    assert "progress_ratio" not in verdict.metrics
    assert "only the final loss is judged" in verdict.reason


def test_flat_reference_still_catches_a_final_gap() -> None:
    reference = curve("fp32", [1.0] * STEPS)
    candidate = curve("fp8-te", [1.0] * 10 + [1.08] * (STEPS - 10))
    verdict = judge(candidate, reference)
    assert verdict.kind == "stalled", verdict.reason
    assert verdict.metrics["reference_flat"] is True
    assert verdict.metrics["final_gap"] == pytest.approx(0.08)
    assert "8.0% higher" in verdict.reason
    assert "did not fall" in verdict.reason


# --- thresholds are honoured ---------------------------------------------------------------


def test_min_progress_ratio_is_honoured(reference: TrialCurve) -> None:
    candidate = curve("bf16-true", decay(1.25, 0.92, noise=0.02, seed=6))
    ratio = judge(candidate, reference).metrics["progress_ratio"]
    loose = StabilityThresholds(min_progress_ratio=ratio - 0.05, max_final_gap=1.0)
    assert judge(candidate, reference, loose).kind == "ok"
    tight = StabilityThresholds(min_progress_ratio=ratio + 0.05, max_final_gap=1.0)
    verdict = judge(candidate, reference, tight)
    assert verdict.kind == "stalled"
    assert f"limit {ratio + 0.05:.0%}" in verdict.reason


def test_max_final_gap_is_honoured(reference: TrialCurve) -> None:
    candidate = curve("fp8-te", [v * 1.08 for v in reference.losses])
    assert judge(candidate, reference, StabilityThresholds(max_final_gap=0.10)).kind == "ok"


def test_max_skip_fraction_is_honoured(reference: TrialCurve) -> None:
    skipped = tuple(i % 10 == 0 for i in range(STEPS))  # 10% after calibration
    candidate = curve("fp16-mixed", decay(1.25, 0.72, noise=0.02, seed=14), skipped=skipped)
    assert judge(candidate, reference).kind == "skips"
    assert judge(candidate, reference, StabilityThresholds(max_skip_fraction=0.15)).kind == "ok"


def test_calibration_steps_is_honoured(reference: TrialCurve) -> None:
    skipped = tuple(i < 40 for i in range(STEPS))  # 24 of the 284 steps after the first 16
    candidate = curve("fp16-mixed", decay(1.25, 0.72, noise=0.02, seed=15), skipped=skipped)
    assert judge(candidate, reference).kind == "skips"
    verdict = judge(candidate, reference, StabilityThresholds(calibration_steps=40))
    assert verdict.kind == "ok", verdict.reason


def test_min_loss_scale_is_honoured(reference: TrialCurve) -> None:
    candidate = curve(
        "fp16-mixed", decay(1.25, 0.72, noise=0.02, seed=16), loss_scale=(8.0,) * STEPS
    )
    assert judge(candidate, reference).kind == "ok"
    verdict = judge(candidate, reference, StabilityThresholds(min_loss_scale=16.0))
    assert verdict.kind == "scale_collapse"
    assert "collapsed to 8, below the limit of 16" in verdict.reason


def test_max_underflow_fraction_is_honoured(reference: TrialCurve) -> None:
    candidate = curve(
        "fp16-mixed", decay(1.25, 0.72, noise=0.02, seed=17), underflow=(0.08,) * STEPS
    )
    assert judge(candidate, reference).kind == "underflow"
    assert judge(candidate, reference, StabilityThresholds(max_underflow_fraction=0.1)).kind == "ok"


def test_min_steps_is_honoured(reference: TrialCurve) -> None:
    candidate = curve("bf16-mixed", list(reference.losses[:20]))
    verdict = judge(candidate, reference, StabilityThresholds(min_steps=10, calibration_steps=5))
    assert verdict.kind == "ok", verdict.reason
    assert judge(candidate, reference, StabilityThresholds(min_steps=21)).kind == "too_short"


def test_climb_margin_is_honoured(reference: TrialCurve) -> None:
    candidate = curve("fp8-te", [1.25 + 0.0004 * i for i in range(STEPS)])  # ~+9%
    assert judge(candidate, reference).kind == "diverged"
    assert judge(candidate, reference, StabilityThresholds(climb_margin=0.2)).kind == "stalled"


def test_min_reference_drop_is_honoured() -> None:
    reference = curve("fp32", decay(1.0, 0.95))  # falls ~5%
    candidate = curve("bf16-true", [1.0] * STEPS)
    assert judge(candidate, reference).kind == "stalled"
    verdict = judge(candidate, reference, StabilityThresholds(min_reference_drop=0.1))
    assert verdict.metrics["reference_flat"] is True
    assert verdict.kind == "stalled"  # the final gap still counts: ~5% higher
    assert "only the final loss is judged" in verdict.reason


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("min_steps", 0),
        ("calibration_steps", -1),
        ("calibration_steps", 2.5),
        ("max_skip_fraction", 1.5),
        ("max_underflow_fraction", -0.1),
        ("min_loss_scale", math.nan),
        ("smoothing_fraction", 0.0),
        ("min_progress_ratio", -1.0),
        ("max_final_gap", math.inf),
        ("spread_multiplier", -1.0),
        ("min_smoothing_steps", True),
    ],
)
def test_invalid_threshold_names_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"StabilityThresholds.{field}"):
        StabilityThresholds(**{field: value})


# --- calibration to the workload: the fp32 replicate's spread --------------------------------


def settle(start: float, end: float) -> list[float]:
    """A loss level at ``start`` over the first window, then settling at ``end`` well before the
    last: the smoothed levels are ``start`` and ``end`` themselves."""
    return [start if i < 30 else end + (start - end) * math.exp(-(i - 30) / 20) for i in range(STEPS)]


def line(start: float, end: float, noise: float = 0.0, seed: int = 0) -> list[float]:
    """A loss falling steadily from ``start`` to ``end``: a small drop that keeps on going."""
    rng = random.Random(seed)
    return [(start + (end - start) * i / (STEPS - 1)) * (1.0 + rng.gauss(0.0, noise)) for i in range(STEPS)]


def test_loss_floor_is_caught_without_a_replicate() -> None:
    # fp32 drives the loss towards zero; the candidate stops at five times fp32's final loss.
    # Judged against how far fp32 fell, the 0.4 gap looked like 4% and passed.
    reference = curve("fp32", settle(10.0, 0.1))
    candidate = curve("bf16-true", settle(10.0, 0.5))
    verdict = judge(candidate, reference)
    assert verdict.kind == "stalled", verdict.reason
    assert verdict.metrics["progress_ratio"] > 0.9  # the fall alone looks fine
    assert verdict.metrics["final_gap"] == pytest.approx(4.0, rel=1e-3)
    assert "(5.0 times as high, limit 5.0%)" in verdict.reason


def test_loss_floor_is_caught_against_the_spread() -> None:
    reference = curve("fp32", settle(10.0, 0.1))
    replicate = curve("fp32", settle(10.0, 0.12))  # one rounding: 20% apart at the end
    candidate = curve("bf16-mixed", settle(10.0, 0.5))
    verdict = judge(candidate, reference, replicate=replicate)
    assert verdict.kind == "stalled", verdict.reason
    assert verdict.metrics["final_spread"] == pytest.approx(0.2, rel=1e-3)
    assert verdict.metrics["final_gap_limit"] == pytest.approx(2 * 0.2, rel=1e-3)  # twice the spread
    assert "set by fp32 perturbed by one rounding ending 20% apart (2x)" in verdict.reason


def test_small_drop_within_the_spread_is_stable() -> None:
    # fp32 falls 2.00 -> 1.95 and the candidate ends 0.5% higher: 80% of fp32's progress, which
    # the fixed 90% calls a stall. fp32 perturbed by one rounding falls 0.0195 less.
    reference = curve("fp32", line(2.0, 1.95))
    candidate = curve("bf16-mixed", line(2.0, 1.95 * 1.005))
    alone = judge(candidate, reference)
    assert alone.kind == "stalled", alone.reason  # the fixed limits, without a replicate
    assert alone.metrics["progress_ratio"] == pytest.approx(0.8, abs=0.02)
    replicate = curve("fp32", line(2.0, 1.95 * 1.01))
    verdict = judge(candidate, reference, replicate=replicate)
    assert verdict.kind == "ok", verdict.reason
    spread = verdict.metrics["progress_spread"]
    assert spread == pytest.approx(0.39, abs=0.02)  # its fall 0.0195 short, of a 0.05 fall
    assert verdict.metrics["progress_limit"] == pytest.approx(1 - 2 * spread)
    assert "whose fall differed by" in verdict.reason


def test_fall_within_twice_the_spread_is_not_judged_for_progress() -> None:
    reference = curve("fp32", line(2.0, 1.95, noise=0.005, seed=20))
    replicate = curve("fp32", line(2.0, 1.90, noise=0.005, seed=21))  # fell 0.05 further: the whole fall
    candidate = curve("fp16-mixed", line(2.0, 1.99, noise=0.005, seed=22))
    verdict = judge(candidate, reference, replicate=replicate)
    assert verdict.kind == "ok", verdict.reason
    assert verdict.metrics["reference_flat"] is True and "progress_ratio" not in verdict.metrics
    assert "is a fall within 2x the" in verdict.reason
    # A final loss far outside the spread still fails.
    lagging = curve("fp16-mixed", line(2.0, 2.08))
    assert judge(lagging, reference, replicate=replicate).kind == "stalled"


def test_a_real_stall_stays_a_stall_against_the_spread(reference: TrialCurve) -> None:
    replicate = curve("fp32", decay(1.25, 0.80, noise=0.02, seed=23))
    candidate = curve("bf16-true", decay(1.25, 0.92, noise=0.02, seed=6))
    verdict = judge(candidate, reference, replicate=replicate)
    assert verdict.kind == "stalled", verdict.reason
    assert verdict.metrics["progress_limit"] < 0.9
    assert "set by fp32 perturbed by one rounding" in verdict.reason


def test_the_spread_never_tightens_the_fixed_limits(reference: TrialCurve) -> None:
    # A replicate that ends where fp32 ends measures no spread: the floors decide, as without.
    candidate = curve("fp8-te", [v * 1.08 for v in reference.losses])
    alone = judge(candidate, reference)
    calibrated = judge(candidate, reference, replicate=reference)
    assert calibrated.kind == alone.kind == "stalled"
    assert calibrated.reason == alone.reason
    assert calibrated.metrics["final_gap_limit"] == 0.05 and calibrated.metrics["progress_limit"] == 0.9


def test_unusable_replicate_leaves_the_fixed_limits(reference: TrialCurve) -> None:
    candidate = curve("bf16-mixed", decay(1.25, 0.72, noise=0.02, seed=2))
    short = curve("fp32", list(reference.losses[:100]))
    nan_end = curve("fp32", list(reference.losses[:-40]) + [math.nan] * 40)
    alone = judge(candidate, reference)
    for replicate in (short, nan_end):
        verdict = judge(candidate, reference, replicate=replicate)
        assert verdict == alone and "final_gap_limit" not in verdict.metrics


def test_spread_multiplier_is_honoured() -> None:
    reference = curve("fp32", line(2.0, 1.95))
    replicate = curve("fp32", line(2.0, 1.95 * 1.01))
    candidate = curve("bf16-mixed", line(2.0, 1.95 * 1.005))
    assert judge(candidate, reference, replicate=replicate).kind == "ok"
    off = StabilityThresholds(spread_multiplier=0.0)
    assert judge(candidate, reference, off, replicate=replicate) == judge(candidate, reference, off)
    assert judge(candidate, reference, off, replicate=replicate).kind == "stalled"


def test_negative_losses_fall_back_to_the_size_of_the_fall() -> None:
    # A loss that ends below zero has no scale of its own: the gap is taken against the fall.
    reference = curve("fp32", line(3.0, -0.5))
    candidate = curve("bf16-mixed", line(3.0, -0.4))
    verdict = judge(candidate, reference)
    m = verdict.metrics
    fall = m["reference_start"] - m["reference_end"]
    assert m["reference_end"] < 0 and fall > abs(m["reference_end"])
    assert m["final_gap"] == pytest.approx((m["candidate_end"] - m["reference_end"]) / fall)
    assert verdict.kind == "ok", verdict.reason


def test_calibrated_verdict_round_trips(reference: TrialCurve) -> None:
    replicate = curve("fp32", decay(1.20, 0.70, noise=0.02, seed=23))
    verdict = judge(curve("bf16-true", decay(1.25, 0.92)), reference, replicate=replicate)
    assert {"replicate_end", "final_spread", "progress_spread", "final_gap_limit", "progress_limit"} <= set(
        verdict.metrics
    )
    assert _from_json(verdict) == verdict


# --- data types ----------------------------------------------------------------------------


def test_curve_lengths_must_match() -> None:
    with pytest.raises(ValueError, match="TrialCurve.skipped has 2 entries but losses has 3"):
        TrialCurve(mode="fp16-mixed", losses=(1.0, 0.9, 0.8), skipped=(False, False))


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"underflow": (0.1, 1.5)}, r"underflow\[1\]"),
        ({"loss_scale": (1.0, -2.0)}, r"loss_scale\[1\]"),
        ({"skipped": (False, 1)}, r"skipped\[1\]"),
        ({"losses": (1.0, "x")}, r"losses\[1\]"),
        ({"mode": ""}, "mode"),
    ],
)
def test_invalid_curve_names_the_field(kwargs: dict[str, object], field: str) -> None:
    base: dict[str, object] = {"mode": "fp16-mixed", "losses": (1.0, 0.9)}
    base.update(kwargs)
    with pytest.raises(ValueError, match=f"TrialCurve.{field}"):
        TrialCurve(**base)


def test_curve_from_lists_is_hashable_tuples() -> None:
    c = TrialCurve(mode="fp32", losses=[1.0, 0.5], skipped=[False, False])  # type: ignore[arg-type]
    assert c.losses == (1.0, 0.5)
    assert c.skipped == (False, False)
    hash(c)


def test_verdict_round_trips(reference: TrialCurve) -> None:
    verdict = judge(curve("bf16-true", decay(1.25, 0.92)), reference)
    assert _from_json(verdict) == verdict


def _from_json(verdict: Verdict) -> Verdict:
    """The verdict read back from the strict JSON of ``to_dict`` (non-finite metrics as strings)."""
    data = json.loads(json.dumps(verdict.to_dict(), allow_nan=False))
    metrics = {k: float(v) if isinstance(v, str) else v for k, v in data["metrics"].items()}
    return Verdict(stable=data["stable"], kind=data["kind"], reason=data["reason"], metrics=metrics)


def test_verdict_kinds() -> None:
    assert set(VERDICT_KINDS) >= {"ok", "too_short", "reference_not_finite"}


# --- smoothing and safety order ------------------------------------------------------------


def test_smooth_is_a_trailing_median_ignoring_spikes_and_nan() -> None:
    assert smooth([1.0, 9.0, 2.0, math.nan, 3.0], 3) == (1.0, 5.0, 2.0, 5.5, 2.5)
    assert math.isnan(smooth([math.nan], 2)[0])
    with pytest.raises(ValueError, match="window"):
        smooth([1.0], 0)


def test_safety_order() -> None:
    assert safety_order()[0] == "fp32"
    ranks = [safety_rank(m) for m in ("fp32", "tf32", "bf16-mixed", "fp16-mixed")]
    assert ranks == sorted(ranks)
    assert safety_rank("bf16-mixed") < safety_rank("bf16-true")  # mixed over pure
    assert safety_rank("bf16-mixed") < safety_rank("fp16-mixed")  # bf16 over fp16
    assert safety_rank("bf16-true") < safety_rank("fp16-true")
    assert safety_rank("fp8-torchao") < safety_rank("bf16-true")
    assert max(safety_rank(m) for m in safety_order()) == safety_rank("fp16-true")


def test_unknown_mode_has_no_rank() -> None:
    with pytest.raises(ValueError, match="'int4' has no safety rank"):
        safety_rank("int4")
