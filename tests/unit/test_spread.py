"""How far one rounding carries fp32 (the perturbed replicate): the limits it sets, the replicate
trial, the window that grows while fp32 still falls, and the replicate's storage with a tune's
study, against fake runners (no processes)."""

from __future__ import annotations

import dataclasses
import json
import logging
import math

import pytest

from advisor._log import get_logger
from advisor.trial import TrialResult
from advisor.tune._engine import tune_policy
from advisor.tune._options import TuneOptions
from advisor.tune._spread import Limits, Spread, final_gap, measure_spread
from advisor.tune._study import STUDY_ATTR_REPLICATE
from advisor.tune._study_status import stored_replicate
from advisor.tune._trials import Replicate, run_comparison, run_reference, run_replicate
from policies import Policy
from probes import HardwareProfile

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


def test_final_spread_is_the_replicates_gap_in_either_direction() -> None:
    assert Spread(2.0, 0.1, 2.0, 0.3).final_spread(1.9) == pytest.approx(2.0)
    assert Spread(2.0, 0.3, 2.0, 0.1).final_spread(1.7) == pytest.approx(2 / 3)
    assert Spread(0.0, -1.0, 0.0, -1.1).final_spread(2.0) == pytest.approx(0.05)  # non-positive: of the fall


def test_progress_spread_compares_each_runs_fall_from_its_own_start() -> None:
    # The replicate started 0.01 higher and ended 0.02 higher: its fall differs by 0.01.
    assert Spread(2.0, 1.95, 2.01, 1.97).progress_spread(0.05) == pytest.approx(0.2)
    assert Spread(2.0, 1.95, 2.01, 1.97).progress_spread(0.0) == math.inf


def test_limits_widen_to_the_spread_and_never_tighten() -> None:
    floors = Limits(0.9, 0.05, 2.0, reference_drop=0.5)
    assert (floors.progress, floors.final_gap, floors.metrics()) == (0.9, 0.05, {})
    wide = Limits(0.9, 0.05, 2.0, reference_drop=0.5, spread=Spread(1.5, 1.0, 1.5, 1.1))
    assert wide.progress == pytest.approx(1 - 2 * 0.1 / 0.5)
    assert wide.final_gap == pytest.approx(2 * 0.1)  # a multiple of the spread, not of (1 + it)
    narrow = Limits(0.9, 0.05, 2.0, reference_drop=0.5, spread=Spread(1.5, 1.0, 1.5, 1.001))
    assert (narrow.progress, narrow.final_gap) == (0.9, 0.05)
    assert narrow.describe("final") == "limit 5.0%"
    assert wide.describe("progress") == (
        "limit 60%, set by fp32 perturbed by one rounding, whose fall differed by 20% (2x)")


def test_a_replicate_far_apart_never_lets_a_floor_pass() -> None:
    # fp32 perturbed once ends 3.5x apart; a candidate at a 5x floor is not stable for it.
    limits = Limits(0.9, 0.05, 2.0, reference_drop=0.9, spread=Spread(1.0, 0.1, 1.0, 0.35))
    assert limits.final_gap == 1.0 and limits.capped
    assert final_gap(0.5, 0.1, 0.9) > limits.final_gap
    assert "the most allowed" in limits.describe("final")
    assert Limits(0.9, 0.05, 2.0, 0.9, Spread(1.0, 0.1, 1.0, 0.35), final_gap_cap=9.0).final_gap == pytest.approx(5.0)


def test_a_fall_inside_the_spread_and_a_rise_are_told_apart() -> None:
    # fp32 fell 0.05; the replicate fell 0.03 less: twice that covers fp32's whole fall.
    assert Limits(0.9, 0.05, 2.0, reference_drop=0.05, spread=Spread(2.0, 1.95, 2.0, 1.98)).fell_within_spread
    assert not Limits(0.9, 0.05, 2.0, reference_drop=0.07, spread=Spread(2.02, 1.95, 2.02, 1.98)).fell_within_spread
    rising = Limits(0.9, 0.05, 2.0, reference_drop=-0.1, spread=Spread(1.85, 1.95, 1.85, 1.98))
    assert not rising.fell_within_spread
    assert "progress_spread" not in rising.metrics()  # nothing to compare progress against


def test_still_falling_sees_a_geometric_fall_and_not_a_levelling_one() -> None:
    from advisor.tune._spread import still_falling

    geometric = [0.5 * 0.9**i for i in range(45)]
    assert still_falling(geometric, 5) == pytest.approx(0.9**-11, rel=0.01)
    assert still_falling([1 / (i + 1) ** 0.5 for i in range(45)], 5) is None  # levelling off
    assert still_falling([1.0 - 0.01 * i for i in range(45)], 5) is None  # linear, judged by progress
    assert still_falling([0.5 * 0.5**i for i in range(45)], 5) is None  # already below 2^-24 of its start
    assert still_falling([0.0] * 45, 5) is None and still_falling([1.0] * 6, 5) is None


def test_measure_spread_needs_a_finite_replicate_as_long_as_the_comparison() -> None:
    reference = [1.0 - 0.01 * i for i in range(STEPS)]
    replicate = [1.1 - 0.01 * i for i in range(STEPS + 5)]
    spread = measure_spread(reference, replicate, 5)
    assert spread is not None and abs(spread.replicate_end - spread.reference_end) == pytest.approx(0.1)
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


class PerturbableRunner:
    """A fake runner whose fp32 curve moves when its initial parameters are perturbed, as a real
    script's does: the perturbed run ends its small fall ``end_spread`` further along. ``lag`` is
    each mode's final-loss excess; ``steps`` the measured window."""

    def __init__(self, seed: int = 0, *, lag: dict[str, float] | None = None, end_spread: float = 0.02,
                 calls: list[tuple[str, str | None]] | None = None, fail: str = "", perturb: str | None = None,
                 measure_steps: int = STEPS) -> None:
        self.seed = seed
        self.lag = lag or {}
        self.end_spread = end_spread
        self.calls = [] if calls is None else calls
        self.fail = fail
        self.perturb = perturb
        self.measure_steps = measure_steps

    def perturbed(self, perturb: str, draw: int = 0) -> PerturbableRunner:
        return PerturbableRunner(self.seed, lag=self.lag, end_spread=self.end_spread, calls=self.calls,
                                 fail=self.fail, perturb=perturb, measure_steps=self.measure_steps)

    def __call__(self, policy: Policy, label: str) -> TrialResult:
        self.calls.append((policy.mode, self.perturb))
        moved = 1 + (self.end_spread if self.perturb else 0.0)
        end = 1.95 * moved * (1 + self.lag.get(policy.mode, 0.0))
        losses = [2.0 + (end - 2.0) * i / (STEPS - 1) for i in range(STEPS)]
        if self.fail and self.perturb:
            return _result(policy, label, losses[:5], outcome=self.fail)
        return _result(policy, label, losses)


def test_a_runner_that_cannot_perturb_gets_no_replicate() -> None:
    def plain(policy: Policy, label: str) -> TrialResult:
        return _result(policy, label, [1.0] * STEPS)

    assert run_replicate(plain, plain(Policy(mode="fp32"), "fp32")) is None


def test_run_replicate_runs_fp32_with_the_same_seed_and_perturbed_weights() -> None:
    runner = PerturbableRunner(seed=7)
    reference = runner(Policy(mode="fp32"), "fp32")
    started: list[str] = []
    replicate = run_replicate(runner, reference, on_start=started.append)
    assert replicate is not None and replicate.seed == 7 and replicate.perturb == "bf16" and not replicate.reused
    assert runner.calls == [("fp32", None), ("fp32", "bf16")]
    assert started == ["fp32 (replicate, bf16-perturbed)"] and replicate.curve is not None
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
        runner = PerturbableRunner(fail=outcome)
        replicate = run_replicate(runner, runner(Policy(mode="fp32"), "fp32"))
    finally:
        logger.removeHandler(keep)
    assert replicate is not None and replicate.curve is None
    assert f"the fp32 replicate (bf16-perturbed) failed ({outcome})" in replicate.note
    assert any("the stability verdicts use the fixed limits" in w for w in warnings)


def test_a_replicate_that_goes_nan_calibrates_nothing() -> None:
    reference = _result(Policy(mode="fp32"), "fp32", [1.0] * STEPS)
    replicate = Replicate.from_result(_result(Policy(mode="fp32"), "r", [1.0] * 9 + [math.nan] * 51), 1, reference)
    assert replicate.curve is None and "step 10" in replicate.note and "fp32 itself diverges" in replicate.note


def test_a_replicate_identical_to_fp32_says_its_perturbation_did_not_reach_the_model() -> None:
    losses = [1.0 - 0.01 * i for i in range(STEPS)]
    reference = _result(Policy(mode="fp32"), "fp32", losses)
    replicate = Replicate.from_result(_result(Policy(mode="fp32"), "r", losses), 0, reference)
    assert replicate.curve is not None and replicate.identical  # spread zero: the fixed limits stand
    assert "bit for bit" in spread_line_of(replicate)
    assert not Replicate.from_result(_result(Policy(mode="fp32"), "r", losses[:-1] + [0.0]), 0, reference).identical


def spread_line_of(replicate: Replicate) -> str:
    from advisor.cli._report_cells import spread_line

    reference = _result(Policy(mode="fp32"), "fp32", list(replicate.losses))
    from advisor.tune._judge import evaluate

    ev = evaluate("fp32", Policy(mode="fp32"), reference, reference, replicate=replicate.curve)
    return spread_line(ev.to_dict(), replicate.to_dict(losses=False))


def test_a_stored_replicate_of_the_same_reference_is_reused_without_running() -> None:
    runner = PerturbableRunner()
    reference = runner(Policy(mode="fp32"), "fp32")
    first = run_replicate(runner, reference)
    stored = json.loads(json.dumps(first.to_dict(), allow_nan=False))
    again = run_replicate(runner, reference, stored=stored)
    assert again.reused and again.losses == first.losses and again.seed == 0
    assert runner.calls == [("fp32", None), ("fp32", "bf16")]  # not run a second time
    # Another seed, or another trial length, is another replicate: run it.
    assert not run_replicate(PerturbableRunner(seed=3), reference, stored=stored).reused
    shorter = dict(stored, losses=stored["losses"][:-1])
    assert not run_replicate(runner, reference, stored=shorter).reused
    # One stored by an earlier version ran under another seed: the wrong noise, never reused.
    seeded = {k: v for k, v in stored.items() if k != "perturb"}
    assert Replicate.from_dict(seeded) is None
    assert Replicate.from_dict({"seed": 1, "perturb": "bf16", "losses": [1.0, "nan"]}) is None
    assert Replicate.from_dict({"seed": 1}) is None


def test_comparison_judges_against_the_spread() -> None:
    # fp32 falls 2.0 -> 1.95; bf16-mixed ends 0.5% higher, inside what one rounding moves fp32 (2%).
    runner = PerturbableRunner(lag={"bf16-mixed": 0.005, "bf16-true": 0.06})
    labels: list[str] = []
    reference, evaluations, replicate, *_ = run_comparison(
        runner, [(Policy(mode="bf16-mixed"), "bf16-mixed"), (Policy(mode="bf16-true"), "bf16-true")],
        on_start=lambda i, label: labels.append(f"{i} {label}"),
    )
    # bf16-true's 6% is within eight times the spread: a second replicate (here no wider) judges it again.
    assert labels == ["0 fp32 (reference)", "1 fp32 (replicate, bf16-perturbed)", "2 bf16-mixed", "3 bf16-true",
                      "3 fp32 (replicate 2, bf16-perturbed)"]
    assert replicate is not None and replicate.seed == 0
    mixed, pure = evaluations
    assert mixed.stable, mixed.reason
    assert not pure.stable and pure.verdict.kind == "stalled"  # 6% higher is outside twice it
    assert reference.verdict.metrics["final_spread"] == pytest.approx(0.02, rel=0.05)


class FallingRunner(PerturbableRunner):
    """fp32 halves every 4 steps for ``fall_steps`` steps, then levels off; bf16-mixed stops at a
    floor of 1e-3. Over a short window the two are indistinguishable."""

    def __init__(self, *args, fall_steps: int = 100, halving: int = 4, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.fall_steps, self.halving = fall_steps, halving

    def perturbed(self, perturb: str, draw: int = 0) -> FallingRunner:
        return FallingRunner(calls=self.calls, perturb=perturb, measure_steps=self.measure_steps,
                             fall_steps=self.fall_steps, halving=self.halving)

    def with_measure_steps(self, steps: int) -> FallingRunner:
        return FallingRunner(calls=self.calls, perturb=self.perturb, measure_steps=steps, fall_steps=self.fall_steps,
                             halving=self.halving)

    def __call__(self, policy: Policy, label: str) -> TrialResult:
        self.calls.append((policy.mode, self.perturb))
        n = self.measure_steps + 3
        halving = self.halving or n / 8  # 0: eight halvings over whatever window, never levelling off
        losses = [0.5 * 0.5 ** (min(i, self.fall_steps) / halving) for i in range(n)]
        if policy.mode == "bf16-mixed":
            losses = [v + 1e-3 for v in losses]
        if self.perturb:
            losses = [v * 1.01 for v in losses]
        return _result(policy, label, losses)


def test_a_short_window_grows_while_fp32_still_falls_geometrically() -> None:
    runner = FallingRunner(measure_steps=20)
    comparison = run_comparison(runner, [(Policy(mode="bf16-mixed"), "bf16-mixed")])
    assert comparison.measure_steps == 160 and "instead of 20" in comparison.window_note
    (mixed,) = comparison.evaluations
    assert not mixed.stable and mixed.verdict.kind == "stalled", mixed.reason  # the floor, seen
    assert len(mixed.result.losses) == 163


def test_a_window_that_cannot_grow_says_it_is_short() -> None:
    # Eight halvings over any window: still falling 4x over its last quarter, however long.
    runner = FallingRunner(measure_steps=20, fall_steps=10_000, halving=0)
    comparison = run_comparison(runner, [])
    assert comparison.measure_steps == 160
    assert comparison.window_note.startswith("the window is short for this workload")
    assert "grew to 8x the 20 steps asked" in comparison.window_note
    # A time budget that leaves no room for a longer reference keeps the window, and says so.
    reference = run_reference(FallingRunner(measure_steps=20), deadline=1.0, clock=lambda: 0.0)
    assert reference.runner.measure_steps == 20 and "the time budget leaves no room" in reference.window_note
    assert run_comparison(FallingRunner(measure_steps=20, fall_steps=8), []).window_note == ""  # levelled off


# --- the tune: one replicate, kept with the study ---------------------------------------------


def _tune(runner: PerturbableRunner, storage: str, *, resume: bool = False):
    options = TuneOptions(trials=3, no_priors=True, storage=storage, resume=resume, modes=("bf16-mixed",))
    return tune_policy(runner, CPU, options, study_name="spread", dtype_ratio={"fp32": 1.0, "bf16": 2.0},
                       remeasure=False)


def test_tune_runs_one_replicate_and_resume_reuses_it(tmp_path) -> None:
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    first = PerturbableRunner(lag={"bf16-mixed": 0.005})
    result = _tune(first, storage)
    assert first.calls.count(("fp32", "bf16")) == 1  # the replicate: once
    assert all(perturb is None for mode, perturb in first.calls if (mode, perturb) != ("fp32", "bf16"))
    assert result.replicate is not None and not result.replicate.reused
    stored = stored_replicate(storage, "spread")
    assert stored is not None and stored["perturb"] == "bf16" and len(stored["losses"]) == STEPS
    bf16 = [m for c, m in result.search.measured.items() if c.mode == "bf16-mixed"]
    assert bf16 and all(m.stable for m in bf16), [m.reason for m in bf16]
    assert result.to_dict()["replicate"]["perturb"] == "bf16" and "losses" not in result.to_dict()["replicate"]

    second = PerturbableRunner(lag={"bf16-mixed": 0.005})
    resumed = _tune(second, storage, resume=True)
    assert ("fp32", "bf16") not in second.calls  # reused from the study
    assert resumed.replicate is not None and resumed.replicate.reused
    assert resumed.reference.verdict.metrics["final_spread"] == pytest.approx(0.02, rel=0.05)


def test_a_fresh_tune_replaces_the_stored_replicate(tmp_path) -> None:
    import optuna

    storage = f"sqlite:///{tmp_path / 'study.db'}"
    _tune(PerturbableRunner(), storage)
    again = PerturbableRunner(end_spread=0.04)
    _tune(again, storage)  # no --resume: the study starts afresh, and so does the replicate
    assert ("fp32", "bf16") in again.calls
    stored = optuna.load_study(study_name="spread", storage=storage).user_attrs[STUDY_ATTR_REPLICATE]
    assert stored["losses"][-1] == pytest.approx(1.95 * 1.04)


def test_stored_replicate_of_a_missing_or_in_memory_study_is_none(tmp_path) -> None:
    assert stored_replicate(None, "x") is None
    assert stored_replicate(f"sqlite:///{tmp_path / 'none.db'}", "no-such-study") is None


def test_replicate_result_is_not_part_of_its_identity() -> None:
    runner = PerturbableRunner()
    replicate = run_replicate(runner, runner(Policy(mode="fp32"), "fp32"))
    assert dataclasses.replace(replicate, result=None) == replicate


def test_spread_line_says_what_the_replicate_measured_and_allowed() -> None:
    from advisor.cli._report_cells import spread_line

    runner = PerturbableRunner()
    reference, _, replicate, *_ = run_comparison(runner, [])
    line = spread_line(reference.to_dict(), replicate.to_dict(losses=False))
    assert line.startswith("run-to-run spread: fp32 perturbed by one bf16 rounding ended at")
    assert "1.9% apart" in line and "final loss up to 5.0% above fp32's" in line
    assert "progress is not judged" in line  # 0.04 apart against a 0.05 fall: inside twice the noise
    failed = Replicate(0, note="the fp32 replicate (bf16-perturbed) failed (crash): it broke")
    failed_line = spread_line(reference.to_dict(), failed.to_dict())
    assert "not measured" in failed_line and "the fixed limits apply" in failed_line
    assert spread_line(reference.to_dict(), None) == ""


# --- a split of a summed loss -------------------------------------------------------------------


def test_a_split_of_a_loss_summed_over_the_batch_is_not_judged_against_fp32() -> None:
    from advisor.tune._judge import evaluate

    losses = [64.0 - 0.1 * i for i in range(STEPS)]
    reference = _result(Policy(mode="fp32"), "fp32", losses)
    split = dataclasses.replace(_result(Policy(mode="fp32", micro_batch_size=16), "fp32 mb16",
                                        [v / 4 for v in losses]), grad_accum_steps=4, micro_batch=16)
    ev = evaluate("fp32 mb16", Policy(mode="fp32", micro_batch_size=16), split, reference)
    assert ev.outcome == "unsupported" and "summed over the batch" in ev.reason and not ev.stable
    averaged = dataclasses.replace(split, losses=tuple(losses))  # a mean-reduced loss: the same first loss
    assert evaluate("fp32 mb16", Policy(mode="fp32", micro_batch_size=16), averaged, reference).stable


class LaggingRunner(PerturbableRunner):
    """fp32 falls 2.0 -> 1.0 at 1/200 a step; bf16-true loses a little of each step's progress, so
    its gap grows with every step: 1.4% after 63 steps, within the fixed 5%, and 13% after 243."""

    def perturbed(self, perturb: str, draw: int = 0) -> LaggingRunner:
        return LaggingRunner(calls=self.calls, perturb=perturb, measure_steps=self.measure_steps)

    def with_measure_steps(self, steps: int) -> LaggingRunner:
        return LaggingRunner(calls=self.calls, perturb=self.perturb, measure_steps=steps)

    def __call__(self, policy: Policy, label: str) -> TrialResult:
        self.calls.append((f"{policy.mode} {self.measure_steps}", self.perturb))
        losses = [2.0 - i / 200 for i in range(self.measure_steps + 3)]
        if policy.mode == "bf16-true":
            losses = [v + 0.0004 * i for i, v in enumerate(losses)]
        if self.perturb:
            losses = [v * 1.001 for v in losses]
        return _result(policy, label, losses)


def test_a_candidate_bending_away_is_judged_on_a_longer_window() -> None:
    runner = LaggingRunner(measure_steps=60)
    comparison = run_comparison(runner, [(Policy(mode="bf16-mixed"), "bf16-mixed"), (Policy(mode="bf16-true"), "bf16-true")])
    mixed, pure = comparison.evaluations
    assert mixed.stable and len(mixed.result.losses) == 63  # not bending: judged where it ran
    assert not pure.stable and pure.verdict.kind == "stalled", pure.reason
    assert len(pure.result.losses) == 243
    # fp32 and its replicate ran once per window, shared by whoever needed it.
    assert runner.calls.count(("fp32 120", None)) == 1 and runner.calls.count(("fp32 240", "bf16")) == 1
    assert ("bf16-mixed 120", None) not in runner.calls


def test_a_bending_candidate_that_cannot_be_extended_keeps_the_note() -> None:
    from advisor.tune._trials import Yardsticks

    runner = LaggingRunner(measure_steps=60)
    reference = runner(Policy(mode="fp32"), "fp32")
    sticks = Yardsticks(runner, reference, run_replicate(runner, reference), asked=60, deadline=0.0,
                        clock=lambda: 1.0)
    ev = sticks.evaluate("bf16-true", Policy(mode="bf16-true"), runner(Policy(mode="bf16-true"), "bf16-true"))
    assert ev.stable and "the window is short for this workload" in ev.reason and ev.verdict.metrics["bending_away"]
