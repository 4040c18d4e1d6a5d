"""fp32's run-to-run spread: the limits it sets, the replicate trial, and its storage with a
tune's study, against fake runners (no processes)."""

from __future__ import annotations

import dataclasses
import json
import logging
import math

import pytest

from advisor._log import get_logger
from advisor.tune._engine import tune_policy
from advisor.tune._options import TuneOptions
from advisor.tune._search import STUDY_ATTR_REPLICATE, stored_replicate
from advisor.tune._spread import Limits, Spread, final_gap, measure_spread
from advisor.tune._trials import Replicate, replicate_seed, run_comparison, run_replicate
from policies import Policy
from probes import HardwareProfile
from probes._trial import TrialResult

STEPS = 60
CPU = HardwareProfile(kind="cpu", name="cpu", cores=2, cpu_flags=("amx_bf16", "avx512_bf16"),
                      torch_version="2.13.0")


# --- the pure rule ---------------------------------------------------------------------------


def test_final_gap_is_relative_to_fp32s_final_loss() -> None:
    assert final_gap(0.5, 0.1, 9.9) == pytest.approx(4.0)  # a floor, however far fp32 fell
    assert final_gap(0.1, 0.1, 9.9) == 0.0
    # At or below zero there is no scale of its own: the fall gives one.
    assert final_gap(-0.9, -1.0, 2.0) == pytest.approx(0.05)
    assert final_gap(0.1, 0.0, 2.0) == pytest.approx(0.05)


def test_final_spread_is_symmetric_in_log_space() -> None:
    assert Spread(0.3, 0.1).final_spread(1.0) == pytest.approx(2.0)
    assert Spread(0.1, 0.3).final_spread(1.0) == pytest.approx(2.0)
    assert Spread(-1.0, -1.1).final_spread(2.0) == pytest.approx(0.05)  # non-positive: of the fall


def test_progress_spread_is_the_end_gap_over_fp32s_fall() -> None:
    assert Spread(1.95, 1.97).progress_spread(0.05) == pytest.approx(0.4)
    assert Spread(1.95, 1.97).progress_spread(0.0) == math.inf


def test_limits_widen_to_the_spread_and_never_tighten() -> None:
    floors = Limits(0.9, 0.05, 2.0, reference_drop=0.5)
    assert (floors.progress, floors.final_gap, floors.metrics()) == (0.9, 0.05, {})
    wide = Limits(0.9, 0.05, 2.0, reference_drop=0.5, spread=Spread(1.0, 1.1))
    assert wide.progress == pytest.approx(1 - 2 * 0.1 / 0.5)
    assert wide.final_gap == pytest.approx(1.1**2 - 1)
    narrow = Limits(0.9, 0.05, 2.0, reference_drop=0.5, spread=Spread(1.0, 1.001))
    assert (narrow.progress, narrow.final_gap) == (0.9, 0.05)
    assert narrow.describe("final") == "limit 5.0%"
    assert wide.describe("progress") == "limit 60%, set by fp32 with another seed ending 20% of its fall apart (2x)"


def test_a_fall_inside_the_spread_and_a_rise_are_told_apart() -> None:
    assert Limits(0.9, 0.05, 2.0, reference_drop=0.05, spread=Spread(1.95, 1.98)).fell_within_spread
    assert not Limits(0.9, 0.05, 2.0, reference_drop=0.07, spread=Spread(1.95, 1.98)).fell_within_spread
    rising = Limits(0.9, 0.05, 2.0, reference_drop=-0.1, spread=Spread(1.95, 1.98))
    assert not rising.fell_within_spread
    assert "progress_spread" not in rising.metrics()  # nothing to compare progress against


def test_measure_spread_needs_a_finite_replicate_as_long_as_the_comparison() -> None:
    reference = [1.0 - 0.01 * i for i in range(STEPS)]
    replicate = [1.1 - 0.01 * i for i in range(STEPS + 5)]
    spread = measure_spread(reference, replicate, 5)
    assert spread is not None and spread.end_gap == pytest.approx(0.1)
    assert measure_spread(reference, replicate[:30], 5) is None
    assert measure_spread(reference, replicate[:10] + [math.nan] + replicate[11:], 5) is None


# --- the replicate trial ---------------------------------------------------------------------


def _result(policy: Policy, label: str, losses: list[float], *, outcome: str = "ok") -> TrialResult:
    return TrialResult(
        outcome=outcome, reason="" if outcome == "ok" else "it broke", label=label, policy=policy.to_dict(),
        losses=tuple(losses), step_times=(0.01,) * len(losses), samples=(64,) * len(losses),
        skipped=(False,) * len(losses), warmup_steps=3, user_batch=64, global_batch=64,
        workload_fingerprint="ab" * 8, model_signature="cd" * 8, wall_s=2.0,
    )


class SeededRunner:
    """A fake runner whose fp32 curve depends on the seed, as a real script's does: each seed
    ends its small fall ``end_spread`` further apart. ``lag`` is each mode's final-loss excess."""

    def __init__(self, seed: int = 0, *, lag: dict[str, float] | None = None, end_spread: float = 0.02,
                 calls: list[tuple[str, int]] | None = None, fail: str = "") -> None:
        self.seed = seed
        self.lag = lag or {}
        self.end_spread = end_spread
        self.calls = [] if calls is None else calls
        self.fail = fail

    def reseeded(self, seed: int) -> SeededRunner:
        return SeededRunner(seed, lag=self.lag, end_spread=self.end_spread, calls=self.calls, fail=self.fail)

    def __call__(self, policy: Policy, label: str) -> TrialResult:
        self.calls.append((policy.mode, self.seed))
        end = 1.95 * (1 + self.end_spread * self.seed) * (1 + self.lag.get(policy.mode, 0.0))
        losses = [2.0 + (end - 2.0) * i / (STEPS - 1) for i in range(STEPS)]
        if self.fail and self.seed != 0:
            return _result(policy, label, losses[:5], outcome=self.fail)
        return _result(policy, label, losses)


def test_replicate_seed_is_the_next_one() -> None:
    assert replicate_seed(0) == 1 and replicate_seed(41) == 42
    assert replicate_seed(2**32 - 1) == 2**32 - 2  # numpy's seeds stop below 2**32


def test_a_runner_that_cannot_reseed_gets_no_replicate() -> None:
    def plain(policy: Policy, label: str) -> TrialResult:
        return _result(policy, label, [1.0] * STEPS)

    assert run_replicate(plain, plain(Policy(mode="fp32"), "fp32")) is None


def test_run_replicate_runs_fp32_under_the_next_seed() -> None:
    runner = SeededRunner(seed=7)
    reference = runner(Policy(mode="fp32"), "fp32")
    started: list[str] = []
    replicate = run_replicate(runner, reference, on_start=started.append)
    assert replicate is not None and replicate.seed == 8 and not replicate.reused
    assert runner.calls == [("fp32", 7), ("fp32", 8)]
    assert started == ["fp32 (replicate, seed 8)"] and replicate.curve is not None
    assert replicate.wall_s == 2.0


@pytest.mark.parametrize("outcome", ["crash", "timeout"])
def test_a_failed_replicate_says_why_and_calibrates_nothing(outcome: str) -> None:
    warnings: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            warnings.append(record.getMessage())

    logger, keep = get_logger(), Keep(logging.WARNING)
    logger.addHandler(keep)
    try:
        runner = SeededRunner(fail=outcome)
        replicate = run_replicate(runner, runner(Policy(mode="fp32"), "fp32"))
    finally:
        logger.removeHandler(keep)
    assert replicate is not None and replicate.curve is None
    assert f"the fp32 replicate (seed 1) failed ({outcome})" in replicate.note
    assert any("the stability verdicts use the fixed limits" in w for w in warnings)


def test_a_replicate_that_goes_nan_calibrates_nothing() -> None:
    reference = _result(Policy(mode="fp32"), "fp32", [1.0] * STEPS)
    replicate = Replicate.from_result(_result(Policy(mode="fp32"), "r", [1.0] * 9 + [math.nan] * 51), 1, reference)
    assert replicate.curve is None and "step 10" in replicate.note and "unstable under some seeds" in replicate.note


def test_a_stored_replicate_of_the_same_reference_is_reused_without_running() -> None:
    runner = SeededRunner()
    reference = runner(Policy(mode="fp32"), "fp32")
    first = run_replicate(runner, reference)
    stored = json.loads(json.dumps(first.to_dict(), allow_nan=False))
    again = run_replicate(runner, reference, stored=stored)
    assert again.reused and again.losses == first.losses and again.seed == 1
    assert runner.calls == [("fp32", 0), ("fp32", 1)]  # not run a second time
    # Another seed, or another trial length, is another replicate: run it.
    assert not run_replicate(SeededRunner(seed=3), reference, stored=stored).reused
    shorter = dict(stored, losses=stored["losses"][:-1])
    assert not run_replicate(runner, reference, stored=shorter).reused
    assert Replicate.from_dict({"seed": 1, "losses": [1.0, "nan"]}) is None
    assert Replicate.from_dict({"seed": 1}) is None


def test_comparison_judges_against_the_spread() -> None:
    # fp32 falls 2.0 -> 1.95; bf16-mixed ends 0.5% higher, inside fp32's own seed spread of 2%.
    runner = SeededRunner(lag={"bf16-mixed": 0.005, "bf16-true": 0.06})
    labels: list[str] = []
    reference, evaluations, replicate = run_comparison(
        runner, [(Policy(mode="bf16-mixed"), "bf16-mixed"), (Policy(mode="bf16-true"), "bf16-true")],
        on_start=lambda i, label: labels.append(f"{i} {label}"),
    )
    assert labels == ["0 fp32 (reference)", "1 fp32 (replicate, seed 1)", "2 bf16-mixed", "3 bf16-true"]
    assert replicate is not None and replicate.seed == 1
    mixed, pure = evaluations
    assert mixed.stable, mixed.reason
    assert not pure.stable and pure.verdict.kind == "stalled"  # 6% higher is outside twice it
    assert reference.verdict.metrics["final_spread"] == pytest.approx(0.02, rel=0.05)


# --- the tune: one replicate, kept with the study ---------------------------------------------


def _tune(runner: SeededRunner, storage: str, *, resume: bool = False):
    options = TuneOptions(trials=3, no_priors=True, storage=storage, resume=resume, modes=("bf16-mixed",))
    return tune_policy(runner, CPU, options, study_name="spread", dtype_ratio={"fp32": 1.0, "bf16": 2.0},
                       remeasure=False)


def test_tune_runs_one_replicate_and_resume_reuses_it(tmp_path) -> None:
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    first = SeededRunner(lag={"bf16-mixed": 0.005})
    result = _tune(first, storage)
    assert first.calls.count(("fp32", 1)) == 1  # the replicate: once, under seed 1
    assert all(seed == 0 for mode, seed in first.calls if (mode, seed) != ("fp32", 1))
    assert result.replicate is not None and not result.replicate.reused
    stored = stored_replicate(storage, "spread")
    assert stored is not None and stored["seed"] == 1 and len(stored["losses"]) == STEPS
    bf16 = [m for c, m in result.search.measured.items() if c.mode == "bf16-mixed"]
    assert bf16 and all(m.stable for m in bf16), [m.reason for m in bf16]
    assert result.to_dict()["replicate"]["seed"] == 1 and "losses" not in result.to_dict()["replicate"]

    second = SeededRunner(lag={"bf16-mixed": 0.005})
    resumed = _tune(second, storage, resume=True)
    assert ("fp32", 1) not in second.calls  # reused from the study
    assert resumed.replicate is not None and resumed.replicate.reused
    assert resumed.reference.verdict.metrics["final_spread"] == pytest.approx(0.02, rel=0.05)


def test_a_fresh_tune_replaces_the_stored_replicate(tmp_path) -> None:
    import optuna

    storage = f"sqlite:///{tmp_path / 'study.db'}"
    _tune(SeededRunner(), storage)
    again = SeededRunner(end_spread=0.04)
    _tune(again, storage)  # no --resume: the study starts afresh, and so does the replicate
    assert ("fp32", 1) in again.calls
    stored = optuna.load_study(study_name="spread", storage=storage).user_attrs[STUDY_ATTR_REPLICATE]
    assert stored["losses"][-1] == pytest.approx(1.95 * 1.04)


def test_stored_replicate_of_a_missing_or_in_memory_study_is_none(tmp_path) -> None:
    assert stored_replicate(None, "x") is None
    assert stored_replicate(f"sqlite:///{tmp_path / 'none.db'}", "no-such-study") is None


def test_replicate_result_is_not_part_of_its_identity() -> None:
    runner = SeededRunner()
    replicate = run_replicate(runner, runner(Policy(mode="fp32"), "fp32"))
    assert dataclasses.replace(replicate, result=None) == replicate


def test_spread_line_says_what_the_replicate_measured_and_allowed() -> None:
    from advisor.cli._report import spread_line

    runner = SeededRunner()
    reference, _, replicate = run_comparison(runner, [])
    line = spread_line(reference.to_dict(), replicate.to_dict(losses=False))
    assert line.startswith("run-to-run spread: fp32 with seed 1 ended at")
    assert "1.9% apart" in line and "final loss up to 5.0% above fp32's" in line
    assert "progress is not judged" in line  # 0.04 apart against a 0.05 fall: inside twice the noise
    failed = Replicate(1, note="the fp32 replicate (seed 1) failed (crash): it broke")
    failed_line = spread_line(reference.to_dict(), failed.to_dict())
    assert "not measured" in failed_line and "the fixed limits apply" in failed_line
    assert spread_line(reference.to_dict(), None) == ""
