"""Re-measurement that ends: a tie settles within the round limit and goes to the safer mode,
a clear lead or a riskier mode shown no faster stops it early, the time budget stops it, and
fp32 runs alongside for the winner's speed-up. A fake runner and a fake clock: milliseconds."""

from __future__ import annotations

import dataclasses
import functools
import io
import math
import re

from rich.console import Console
from test_search import FakeRunner, tune

from advisor.cli._report import render_tune, tune_progress
from advisor.trial import TrialResult
from advisor.tune._engine import REMEASURE_LEANING_ROUNDS, REMEASURE_MAX_ROUNDS
from advisor.tune._space import Candidate
from policies import Policy
from probes import HardwareProfile

# The whole report (mpadvise tune --verbose): it holds every figure these tests read.
render_verbose = functools.partial(render_tune, verbose=True)

MODES = ["fp32", "bf16-mixed", "bf16-true"]
ROUND = re.compile(r"\(re-measure (\d+)\)")


class FakeClock:
    """Monotonic seconds that move only when a trial runs."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class ScriptedRunner(FakeRunner):
    """Step times per mode for the search's run, and per round of re-measurement; every trial
    takes ``trial_s`` seconds of the fake clock."""

    def __init__(self, search_ms: dict[str, float], rounds_ms: dict[str, list[float]] | None = None, *,
                 clock: FakeClock | None = None, trial_s: float = 10.0):
        super().__init__(search_ms)
        self.rounds_ms = rounds_ms or {}
        self.clock = clock
        self.trial_s = trial_s

    def __call__(self, policy: Policy, label: str) -> TrialResult:
        result = super().__call__(policy, label)
        if self.clock is not None:
            self.clock.now += self.trial_s
        found = ROUND.search(label)
        per_round = self.rounds_ms.get(policy.mode)
        if found is None or not per_round:
            return result
        ms = per_round[min(int(found.group(1)), len(per_round)) - 1]
        return dataclasses.replace(result, step_times=tuple([ms / 1e3] * len(result.step_times)))


def remeasured(runner: FakeRunner) -> list[tuple[int, str]]:
    """(round, mode) of every re-measurement the runner ran, in order."""
    out = []
    for policy, label in zip(runner.calls, runner.labels):
        found = ROUND.search(label)
        if found:
            out.append((int(found.group(1)), policy.mode))
    return out


def test_a_tie_the_rounds_cannot_resolve_ends_at_the_limit_and_goes_to_the_safer_mode():
    # bf16-true and bf16-mixed within 1%, each run scattered by a few percent: no number of
    # rounds the budget allows tells them apart. Four rounds, then a tie: the safer mixed wins.
    scatter = [math.exp(x) for x in (0.04, -0.03, 0.05, -0.03, 0.04, -0.03, 0.05, -0.03, 0.04, -0.03)]
    runner = ScriptedRunner({"fp32": 100, "bf16-mixed": 20.2, "bf16-true": 20.0},
                            {"bf16-true": [20.0 / s for s in scatter], "bf16-mixed": [20.2] * 10})
    result = tune(runner, modes=MODES, remeasure=True)
    assert REMEASURE_MAX_ROUNDS == 4
    assert result.remeasure_rounds == 4 and result.remeasure_stop == "round limit"
    assert max(r for r, _ in remeasured(runner)) == 4
    assert result.winner == Candidate("bf16-mixed")
    assert "not resolved after 4 paired runs: the safer bf16-mixed wins the tie" in result.tie_note
    data = result.to_dict()
    assert data["remeasure_stop"] == "round limit" and data["remeasure_max_rounds"] == 4
    console = Console(record=True, width=300, file=io.StringIO())
    render_verbose(data, console)
    assert "re-measurement stopped at its limit of 4 rounds" in console.export_text()


def test_a_riskier_mode_shown_no_faster_than_the_margin_stops_re_measurement_early():
    # Side by side, the safer bf16-mixed leads bf16-true by 3%, 1% and 2%: not resolved (the
    # interval reaches below 1.02x), but bf16-true cannot be more than 2% faster, so a fourth
    # round could not make it win. Three rounds, not four.
    runner = ScriptedRunner({"fp32": 100, "bf16-mixed": 20.2, "bf16-true": 20.0},
                            {"bf16-true": [20.0 * math.exp(x) for x in (0.03, 0.01, 0.02, 0.02)],
                             "bf16-mixed": [20.0] * 4})
    result = tune(runner, modes=MODES, remeasure=True)
    assert result.remeasure_rounds == 3 and result.remeasure_stop == "settled"
    assert result.winner == Candidate("bf16-mixed")
    gap = next(f for f in result.finalists if f.candidate.mode == "bf16-true").gap
    assert gap.verdict == "unresolved" and gap.b_lead_ruled_out and gap.pairs == 3


def test_a_clear_lead_stops_re_measurement_after_two_rounds():
    # bf16-true's search run was slowed into bf16-mixed's band; side by side it leads by 20%.
    runner = ScriptedRunner({"fp32": 100, "bf16-mixed": 24.0, "bf16-true": 23.8},
                            {"bf16-true": [20.0] * 4, "bf16-mixed": [24.0] * 4})
    result = tune(runner, modes=MODES, remeasure=True)
    assert result.remeasure_rounds == 2 and result.remeasure_stop == "settled"
    assert result.winner == Candidate("bf16-true") and not result.tie_note
    assert result.decisive_gap()["verdict"] == "faster"
    # fp32 ran beside them in both rounds: the speed-up is the paired one, 100 / 20
    assert sorted(m for r, m in remeasured(runner) if r == 1) == ["bf16-mixed", "bf16-true", "fp32"]
    assert result.speedup.ratio == 5.0 and result.speedup.pairs == 2
    assert result.speedup.basis == "paired re-measurement, 2 pairs"


def test_the_time_budget_stops_re_measurement_and_the_result_says_so():
    clock = FakeClock()
    runner = ScriptedRunner({"fp32": 100, "bf16-mixed": 20.2, "bf16-true": 20.0}, clock=clock, trial_s=10.0)
    started: list[float] = []
    # The search runs 3 trials (30 s of the 45); the first round (3 runs) ends past the budget.
    result = tune(runner, modes=MODES, remeasure=True, trials=3, no_priors=True, time_budget=45,
                  clock=clock, on_round=lambda number, most, runs: started.append(clock.now))
    search_start = 10.0  # after the reference
    assert len(started) == 1 and all(t - search_start < 45 for t in started)
    assert result.remeasure_rounds == 1 and result.remeasure_stop == "time budget"
    assert result.speedup.pairs == 1 and result.speedup.low is None  # one pair: no interval
    data = result.to_dict()
    console = Console(record=True, width=300, file=io.StringIO())
    render_verbose(data, console)
    text = console.export_text()
    assert "re-measurement cut short by the time budget (45 s) after 1 round" in text
    assert result.winner == Candidate("bf16-mixed") and "time budget" in result.tie_note


def test_a_budget_spent_by_the_search_leaves_single_runs():
    clock = FakeClock()
    runner = ScriptedRunner({"fp32": 100, "bf16-mixed": 20.2, "bf16-true": 20.0}, clock=clock)
    result = tune(runner, modes=MODES, remeasure=True, trials=10, no_priors=True, time_budget=25, clock=clock)
    assert "time budget" in result.search.stop_reason
    assert not remeasured(runner) and result.remeasure_stop == "time budget"
    assert result.speedup.basis == "single runs, not re-measured (the time budget was spent first)"


def test_a_clear_winner_is_re_measured_against_fp32_only():
    # The search's lead over bf16-mixed is 2x, far outside the noise: bf16-mixed cannot win and
    # is not re-measured. The winner still runs side by side with fp32 for its speed-up.
    runner = ScriptedRunner({"fp32": 100, "bf16-mixed": 40, "bf16-true": 20},
                            {"fp32": [100, 110, 100, 100], "bf16-true": [20, 21, 20, 20]})
    result = tune(runner, modes=MODES, remeasure=True)
    assert [f.candidate.mode for f in result.finalists] == ["bf16-true", "fp32"]
    assert {m for _, m in remeasured(runner)} == {"bf16-true", "fp32"}
    assert result.winner == Candidate("bf16-true")
    assert result.speedup.pairs >= 2 and result.speedup.low <= result.speedup.ratio <= result.speedup.high
    assert result.policy.tuned_on.speedup_vs_fp32 == result.speedup.ratio


def test_an_fp32_winner_has_a_speed_up_of_exactly_one_and_runs_no_rounds():
    cpu = HardwareProfile(kind="cpu", name="cpu", cores=2, torch_version="2.13.0")
    runner = FakeRunner({"fp32": 10, "bf16-mixed": 200, "fp16-mixed": 300, "bf16-true": 190, "fp16-true": 290})
    result = tune(runner, profile=cpu, dtype_ratio={"fp32": 1.0, "bf16": 0.02, "fp16": 0.02}, remeasure=True)
    assert result.winner.mode == "fp32" and not remeasured(runner)
    assert result.winner_speedup == 1.0 and result.policy.tuned_on.speedup_vs_fp32 == 1.0
    assert result.speedup.basis == "the fp32 reference itself"


def test_without_re_measurement_the_speed_up_says_it_rests_on_single_runs():
    runner = FakeRunner({"fp32": 100, "tf32": 40, "bf16-mixed": 20, "fp16-mixed": 21, "bf16-true": 15,
                         "fp16-true": 16, "fp8-torchao": 30})
    result = tune(runner, remeasure=False)
    assert result.speedup.basis == "single runs, not re-measured" and result.remeasure_stop == "off"
    assert result.speedup.ratio == round(100 / 15, 4) == result.policy.tuned_on.speedup_vs_fp32


def test_the_progress_bar_counts_the_rounds_of_re_measurement():
    console = Console(record=True, width=120, file=io.StringIO())
    with tune_progress(console, 12) as (on_start, on_done, on_round):
        rounds = []
        runner = ScriptedRunner({"fp32": 100, "bf16-mixed": 24.0, "bf16-true": 23.8},
                                {"bf16-true": [20.0] * 4, "bf16-mixed": [24.0] * 4})

        def counting(number: int, most: int, runs: int) -> None:
            rounds.append((number, most, runs))
            on_round(number, most, runs)

        tune(runner, modes=MODES, remeasure=True, on_start=on_start, on_done=on_done, on_round=counting)
    assert rounds == [(1, 4, 3), (2, 4, 3)]
    finished = [ln for ln in console.export_text().splitlines() if "/" in ln][-1]
    done = len(runner.calls)  # every trial, the re-measurements too, counted once
    assert f"{done}/{done}" in finished


def test_a_gap_leaning_beyond_the_margin_runs_more_rounds_until_it_resolves():
    # bf16-true runs about 10% faster than bf16-mixed side by side, scattered by 5% either way:
    # after four rounds the interval still reaches below the 2% that counts, but its estimate
    # lies well beyond it. Stopping there would give the tie to the safer bf16-mixed; more
    # rounds show the lead, and the faster mode wins.
    scatter = [math.exp(x) for x in (0.15, 0.05) * 5]
    runner = ScriptedRunner({"fp32": 100, "bf16-mixed": 20.2, "bf16-true": 20.0},
                            {"bf16-true": [20.0 / s for s in scatter], "bf16-mixed": [20.0] * 10})
    result = tune(runner, modes=MODES, remeasure=True)
    assert REMEASURE_MAX_ROUNDS < result.remeasure_rounds <= REMEASURE_LEANING_ROUNDS
    assert result.remeasure_stop == "settled"
    assert result.winner == Candidate("bf16-true") and not result.tie_note
    gap = next(f for f in result.finalists if f.candidate.mode == "bf16-mixed").gap
    assert gap.verdict == "faster" and gap.pairs == result.remeasure_rounds


def test_a_leaning_gap_that_never_resolves_stops_at_the_longer_limit_and_says_so():
    # A 6% lead, scattered by 15% either way: no number of rounds tells it from a tie.
    scatter = [math.exp(x) for x in (0.21, -0.09) * 5]
    runner = ScriptedRunner({"fp32": 100, "bf16-mixed": 20.2, "bf16-true": 20.0},
                            {"bf16-true": [20.0 / s for s in scatter], "bf16-mixed": [20.0] * 10})
    result = tune(runner, modes=MODES, remeasure=True)
    assert result.remeasure_rounds == REMEASURE_LEANING_ROUNDS and result.remeasure_stop == "round limit"
    assert result.winner == Candidate("bf16-mixed")
    assert f"not resolved after {REMEASURE_LEANING_ROUNDS} paired runs" in result.tie_note
    data = result.to_dict()
    assert data["remeasure_max_rounds"] == REMEASURE_MAX_ROUNDS
    assert data["remeasure_leaning_rounds"] == REMEASURE_LEANING_ROUNDS
    console = Console(record=True, width=300, file=io.StringIO())
    render_verbose(data, console)
    assert (f"re-measurement stopped after {REMEASURE_LEANING_ROUNDS} rounds, past its usual "
            f"{REMEASURE_MAX_ROUNDS} while a lead lay beyond the margin" in console.export_text())


def test_a_safer_mode_leading_an_unresolved_gap_runs_no_extra_round():
    # The safer bf16-mixed leads by about 5% on the estimate, unresolved: more rounds could
    # only confirm what the tie already gives it, so the fourth round is the last.
    scatter = [math.exp(x) for x in (0.15, -0.05) * 5]
    runner = ScriptedRunner({"fp32": 100, "bf16-mixed": 20.2, "bf16-true": 20.0},
                            {"bf16-mixed": [20.0 / s for s in scatter], "bf16-true": [20.0] * 10})
    result = tune(runner, modes=MODES, remeasure=True)
    assert result.remeasure_rounds <= REMEASURE_MAX_ROUNDS
    assert result.winner == Candidate("bf16-mixed")
