"""A disturbed or lost trial is run again, and the winner is decided on paired runs only.

Fake runners replay what a busy machine did to real tunes: a neighbour's burst through part of
the fp32 reference (its steps spread 7x), a reference slowed through and through (every
candidate looks many times faster), a GPU another process computes on, and a trial lost
before its candidate was applied. Milliseconds each.
"""

from __future__ import annotations

import dataclasses
import functools
import io

import pytest
from rich.console import Console
from test_search import USER_BATCH, FakeRunner, tune
from test_search_remeasure import MODES

from advisor.cli._report import render_tune
from advisor.trial import TrialResult
from advisor.tune._space import Candidate
from advisor.tune._steady import (
    FIRST_SPREAD_LIMIT,
    SPREAD_FACTOR,
    DisturbanceWatch,
    SteadyRunner,
    judge_spread,
)
from advisor.tune._timing import step_spread
from policies import Policy
from probes import HardwareProfile

# The whole report (mpadvise tune --verbose): it holds every figure these tests read.
render_verbose = functools.partial(render_tune, verbose=True)


def test_the_spread_is_the_90th_percentile_over_the_10th_of_the_measured_steps():
    times = [5.0, 5.0, 5.0] + [0.01 * (1 + i / 10) for i in range(11)]  # warm-up, then 1.0x to 2.0x
    assert step_spread(times, 3) == pytest.approx(1.9 / 1.1)
    assert step_spread(times[:10], 3) is None  # seven measured steps: too few to read a spread


@pytest.mark.parametrize(("spread", "usual", "disturbed"), [
    (None, 1.2, False),  # no spread read: never disturbed
    (2.9, None, False), (3.1, None, True),  # before a usual exists, the first limit
    (1.45, 1.0, False),  # the floor: a quiet GPU's 1.01 doubled is still steady
    (2.3, 1.2, False), (2.5, 1.2, True),  # twice the usual
])
def test_a_spread_far_beyond_the_usual_is_disturbed(spread, usual, disturbed):
    assert judge_spread(spread, usual)[0] is disturbed
    assert FIRST_SPREAD_LIMIT == 3.0 and SPREAD_FACTOR == 2.0


class Machine:
    """Runs a fake trial; ``disturb`` decides, per call number, how its steps are slowed."""

    def __init__(self, step_ms: dict[str, float], disturb=None, outcomes=None):
        self.inner = FakeRunner(step_ms)
        self.disturb = disturb or (lambda call, label: None)
        self.outcomes = outcomes or {}
        self.labels: list[str] = []

    def __call__(self, policy: Policy, label: str) -> TrialResult:
        result = self.inner(policy, label)
        call = len(self.labels)
        self.labels.append(label)
        if call in self.outcomes:
            return result.with_outcome(*self.outcomes[call])
        slow = self.disturb(call, label)
        if slow is None:
            return result
        return dataclasses.replace(result, step_times=tuple(t * f for t, f in zip(result.step_times, slow)))


def burst_from(step: int, factor: float, n: int = 40) -> list[float]:
    """A neighbour's burst from ``step`` on: the later steps ``factor`` times slower."""
    return [1.0] * step + [factor] * (n - step)


def test_a_reference_disturbed_halfway_is_run_again_and_the_report_says_so():
    # The fp32 reference's steps go 7x slower from step 15 (a CPU-bound job started beside it).
    machine = Machine({"fp32": 100, "bf16-mixed": 60, "bf16-true": 55},
                      disturb=lambda call, label: burst_from(15, 7.0) if call == 0 else None)
    result = tune(machine, modes=MODES, remeasure=True)
    assert machine.labels[:2] == ["fp32", "fp32 (run 2)"]
    [event] = result.disturbances
    assert event.kind == "spread" and event.label == "fp32" and event.rerun and event.spread == pytest.approx(7.0)
    assert result.to_dict()["disturbed"][0]["kind"] == "spread"
    # the reference kept is the steady rerun: every candidate's search ratio is the true one
    assert result.reference.goodput == pytest.approx(USER_BATCH / 0.100)
    assert result.winner == Candidate("bf16-true")


def test_a_reference_slowed_through_and_through_cannot_make_a_slower_mode_win():
    # The reference ran 20x slow on every step (no spread to see): bf16-true then measured 17x
    # fp32 in the search. Truly it is slower than fp32 (110 ms against 100), and side by side
    # with fp32 it shows: fp32 wins, and no speed-up from the disturbed run is written.
    machine = Machine({"fp32": 100, "bf16-mixed": 130, "bf16-true": 110},
                      disturb=lambda call, label: [20.0] * 40 if call == 0 else None)
    result = tune(machine, modes=MODES, remeasure=True, no_priors=True)
    assert result.winner == Candidate("fp32")
    assert result.speedup.ratio == 1.0
    # The search's best (every candidate looked many times fp32's) ran beside fp32: fp32's lead, paired.
    rivals = [f for f in result.finalists if f.gap is not None]
    assert rivals and all(f.gap.pairs >= 2 and f.gap.verdict == "faster" for f in rivals)


def test_the_written_speed_up_is_the_paired_one_not_the_disturbed_search_run():
    # The reference ran 3x slow through and through; bf16-true is truly 1.25x fp32.
    machine = Machine({"fp32": 100, "bf16-mixed": 90, "bf16-true": 80},
                      disturb=lambda call, label: [3.0] * 40 if call == 0 else None)
    result = tune(machine, modes=MODES, remeasure=True, no_priors=True)
    assert result.winner == Candidate("bf16-true")
    assert result.speedup.ratio == pytest.approx(1.25) and result.speedup.pairs >= 2
    assert result.policy.tuned_on.speedup_vs_fp32 == result.speedup.ratio
    row = next(r for r in result.to_dict()["candidates"] if r["winner"])
    assert row["search_speedup_vs_fp32"] == pytest.approx(3.75)  # what one disturbed pair said
    assert row["speedup_vs_fp32"] == pytest.approx(1.25)


def test_a_re_measurement_disturbed_is_run_again_within_its_round():
    # The first re-measurement of bf16-true is disturbed from its 10th step.
    def disturb(call, label):
        return burst_from(10, 6.0) if label == "bf16-true (re-measure 1)" else None
    machine = Machine({"fp32": 100, "bf16-mixed": 60, "bf16-true": 55}, disturb=disturb)
    result = tune(machine, modes=MODES, remeasure=True)
    assert "bf16-true (re-measure 1) (run 2)" in machine.labels
    assert [e.label for e in result.disturbances] == ["bf16-true (re-measure 1)"]
    assert result.winner == Candidate("bf16-true") and result.speedup.ratio == pytest.approx(100 / 55, rel=1e-3)


def test_a_workload_that_always_spreads_is_kept_once_the_spread_repeats_and_sets_the_usual():
    # Every run of this workload spreads 4x (a data loader stall every few steps, or a machine
    # loaded through and through): the rerun spreads alike, so it is kept, its spread becomes
    # the usual, and no later trial reruns.
    def stalls(call, label):
        return [4.0 if i % 4 == 0 else 1.0 for i in range(40)]
    machine = Machine({"fp32": 100, "bf16-mixed": 60, "bf16-true": 55}, disturb=stalls)
    result = tune(machine, modes=MODES, remeasure=True)
    assert machine.labels[:2] == ["fp32", "fp32 (run 2)"]
    assert [(e.rerun, e.kept) for e in result.disturbances] == [(True, ""), (False, "repeats")]
    assert "kept the least spread of 2 runs: they spread alike" in result.disturbances[-1].describe()
    assert not any("(run" in label for label in machine.labels[2:])


def test_bursts_that_differ_each_time_are_kept_once_the_reruns_are_spent():
    bursts = {0: burst_from(10, 9.0), 1: burst_from(20, 3.5), 2: burst_from(30, 12.0)}
    machine = Machine({"fp32": 100, "bf16-mixed": 60, "bf16-true": 55},
                      disturb=lambda call, label: bursts.get(call))
    result = tune(machine, modes=MODES, remeasure=True)
    assert machine.labels[:3] == ["fp32", "fp32 (run 2)", "fp32 (run 3)"]
    assert [(e.rerun, e.kept) for e in result.disturbances] == [(True, ""), (True, ""), (False, "spent")]
    assert result.disturbances[-1].describe().endswith("kept the least spread of 3 runs (the machine stayed busy)")
    assert step_spread(result.reference.result.step_times, 3) == pytest.approx(3.5)  # the least spread run


def test_a_trial_lost_before_its_candidate_was_applied_is_run_again_not_judged():
    lost = ("lost", "lost before the candidate was applied (timed out in the script's imports)")
    machine = Machine({"fp32": 100, "bf16-mixed": 60, "bf16-true": 55}, outcomes={2: lost})
    result = tune(machine, modes=MODES, remeasure=True)
    rerun = machine.labels[3]
    assert rerun == f"{machine.labels[2]} (run 2)"
    assert [e.kind for e in result.disturbances] == ["lost"]
    assert all(m.outcome != "lost" for m in result.search.measured.values())
    assert result.winner == Candidate("bf16-true")


def test_a_trial_lost_every_time_is_reported_lost_never_unstable():
    machine = Machine({"fp32": 100, "bf16-mixed": 60, "bf16-true": 55},
                      outcomes={n: ("lost", "lost before the candidate was applied") for n in (2, 3, 4)})
    result = tune(machine, modes=MODES, remeasure=True)
    lost = [m for m in result.search.measured.values() if m.outcome == "lost"]
    assert len(lost) == 1 and not lost[0].stable and "unstable" not in lost[0].reason


def test_a_busy_gpu_reruns_the_trial_and_says_which_processes():
    gpu = HardwareProfile(kind="cuda", name="NVIDIA H200", compute_capability=(9, 0), index=0,
                          torch_version="2.11.0", memory_total=141 * 2**30)
    readings = iter([[], [4242]] + [[]] * 1000)  # another process appeared during the first trial
    watch = DisturbanceWatch(profile=gpu, busy=lambda profile: next(readings))
    runner = SteadyRunner(FakeRunner({"fp32": 100}), watch)
    result = runner(Policy(mode="fp32"), "fp32")
    assert result.outcome == "ok"
    [event] = watch.events
    assert event.kind == "busy-gpu" and "4242" in event.detail and event.rerun


def test_a_steady_runner_keeps_the_protocols_of_the_runner_it_wraps():
    from advisor.tune._run import Extendable, Perturbable

    class Plain:
        def __call__(self, policy, label):
            raise AssertionError

    watch = DisturbanceWatch()
    assert not isinstance(SteadyRunner(Plain(), watch), Perturbable)

    class Full(Plain):
        seed = 3
        measure_steps = 40

        def perturbed(self, perturb, draw=0):
            return Full()

        def with_measure_steps(self, steps):
            return Full()

    wrapped = SteadyRunner(Full(), watch)
    assert isinstance(wrapped, Perturbable) and isinstance(wrapped, Extendable) and wrapped.seed == 3
    derived = wrapped.perturbed("bf16")
    assert isinstance(derived, SteadyRunner) and derived.watch is watch



def test_the_report_names_each_trial_run_again_and_why():
    machine = Machine({"fp32": 100, "bf16-mixed": 60, "bf16-true": 55},
                      disturb=lambda call, label: burst_from(15, 7.0) if call == 0 else None)
    result = tune(machine, modes=MODES, remeasure=True)
    console = Console(record=True, width=200, file=io.StringIO())
    render_verbose(result.to_dict(), console)
    text = console.export_text()
    assert "disturbed fp32: steps spread 7.00x from the 10th to the 90th percentile (limit 3.00x, no usual yet); run again" in text
