"""``--speedup-within``: the winner is paired with fp32 until its speed-up is that precise.

A tune stops re-measuring once its decision is resolved; a winner whose lead over fp32 was
resolved after two pairs can carry a wide interval (1.03x to 1.89x on the Accelerate MLP at
width 4096 on the 2-core Xeon), and that figure was cached. By default the tune asks for 10%,
and gives it up once three pairs or more say the round bound cannot reach it. A fake runner:
milliseconds.
"""

from __future__ import annotations

import io
import math

import pytest
from rich.console import Console
from test_search import tune
from test_search_remeasure import ScriptedRunner, remeasured
from typer.testing import CliRunner

from advisor.cli import app
from advisor.cli._report import render_tune
from advisor.tune._engine import LOCAL_PAIRS, PAIRING_ROUNDS
from advisor.tune._options import DEFAULT_SPEEDUP_WITHIN, TuneOptions, option_info
from advisor.tune._space import Candidate
from advisor.tune._timing import paired_gap
from probes import UsageError

MODES = ["fp32", "bf16-mixed"]


def _half_width(speedup) -> float:
    """The larger of the interval's two sides, as a fraction of the figure."""
    return max(speedup.high / speedup.ratio, speedup.ratio / speedup.low) - 1


def _runner(bf16_rounds_ms: list[float]) -> ScriptedRunner:
    return ScriptedRunner({"fp32": 100, "bf16-mixed": 41}, {"fp32": [100] * 20, "bf16-mixed": bf16_rounds_ms})


def _report(data: dict) -> str:
    console = Console(record=True, width=300, file=io.StringIO())
    render_tune(data, console)
    return console.export_text()


def test_at_zero_a_resolved_lead_stops_at_two_pairs_with_a_wide_interval():
    result = tune(_runner([40, 42] + [41] * 18), modes=MODES, remeasure=True, speedup_within=0)
    assert result.winner == Candidate("bf16-mixed")
    assert result.speedup.pairs == LOCAL_PAIRS == 2
    assert _half_width(result.speedup) > 0.10
    data = result.to_dict()
    assert (data["speedup_within"], data["speedup_within_met"]) == (None, None)


def test_by_default_the_winner_runs_on_until_its_interval_is_within_ten_percent():
    assert DEFAULT_SPEEDUP_WITHIN == 0.1
    result = tune(_runner([40, 42] + [41] * 18), modes=MODES, remeasure=True)
    assert result.speedup.pairs == 3  # one pair past the resolved lead: 2.5x, 2.38x, 2.44x
    assert _half_width(result.speedup) <= 0.10
    data = result.to_dict()
    assert (data["speedup_within"], data["speedup_within_met"]) == (0.1, True)


def test_a_precision_within_reach_runs_as_many_pairs_as_it_takes():
    runner = _runner([38, 44] * 10)  # 2.63x and 2.27x in turn: nine pairs get within 10%
    result = tune(runner, modes=MODES, remeasure=True)
    assert result.speedup.pairs == 9 < PAIRING_ROUNDS
    assert _half_width(result.speedup) <= 0.10
    assert result.to_dict()["speedup_within_met"] is True


def test_with_it_the_winner_and_fp32_run_on_until_the_interval_is_that_narrow():
    runner = _runner([40, 42] + [41] * 18)
    result = tune(runner, modes=MODES, remeasure=True, speedup_within=0.1)
    assert result.winner == Candidate("bf16-mixed")
    assert result.speedup.pairs == 3  # one round more: 2.5x, 2.38x, 2.44x
    assert _half_width(result.speedup) <= 0.10
    assert result.speedup.ratio == pytest.approx(math.exp((math.log(100 / 40) + math.log(100 / 42)
                                                           + math.log(100 / 41)) / 3), rel=1e-3)
    assert remeasured(runner)[-2:] in ([(3, "bf16-mixed"), (3, "fp32")], [(3, "fp32"), (3, "bf16-mixed")])
    assert result.policy.tuned_on.speedup_vs_fp32 == pytest.approx(result.speedup.ratio, rel=1e-3)
    data = result.to_dict()
    assert (data["speedup_within"], data["speedup_within_met"]) == (0.1, True)
    assert "wider than" not in _report(data)


def test_a_precision_out_of_reach_stops_on_three_pairs_and_the_figure_is_still_written():
    runner = _runner([36, 45] * 10)  # 2.78x and 2.22x in turn: some twenty pairs would be needed
    two = paired_gap([100 / 36, 100 / 45], [1.0, 1.0])
    assert two.pairs_for(0.1, PAIRING_ROUNDS) is None  # two pairs say so already, but are not trusted to
    result = tune(runner, modes=MODES, remeasure=True)
    assert result.winner == Candidate("bf16-mixed") and result.policy is not None
    assert result.speedup.pairs == 3
    assert max(r for r, _ in remeasured(runner)) == 3
    assert _half_width(result.speedup) > 0.10
    data = result.to_dict()
    assert (data["speedup_within"], data["speedup_within_met"], data["speedup_within_out_of_reach"]) == (0.1, False, True)
    assert data["speedup_within_pairs_needed"] == 22 > PAIRING_ROUNDS
    assert (f"the speed-up's interval is wider than 10% of its figure either way after 3 pairs: at their scatter it "
            f"would take about {data['speedup_within_pairs_needed']} pairs, more than the {PAIRING_ROUNDS} rounds allow"
            in _report(data))


def test_a_scatter_past_the_projection_says_so():
    data = tune(_runner([30, 50] * 10), modes=MODES, remeasure=True).to_dict()  # 3.33x and 2x in turn
    assert (data["speedup_within_out_of_reach"], data["speedup_within_pairs_needed"]) == (True, None)
    assert "at their scatter it would take over 100 pairs" in _report(data)


def test_a_round_bound_reached_first_says_so():
    data = tune(_runner([36, 45] * 10), modes=MODES, remeasure=True).to_dict()
    data.update(speedup_within_out_of_reach=False, speedup_within_pairs_needed=None)
    assert ("after 3 pairs: the round bound or the time budget came first" in _report(data))


def test_nothing_asked_nothing_reported():
    data = tune(_runner([30, 50] * 10), modes=MODES, remeasure=True, speedup_within=0).to_dict()
    assert (data["speedup_within"], data["speedup_within_met"], data["speedup_within_out_of_reach"]) == (None,) * 3
    assert "wider than" not in _report(data)


def _symmetric(centre: float, half_spread: float, n: int) -> list[float]:
    """``n`` (3 or 4) log ratios about ``centre`` whose sample variance is ``half_spread`` squared."""
    if n == 3:
        return [centre - half_spread, centre, centre + half_spread]
    a = half_spread * math.sqrt(3) / 2
    return [centre - a, centre - a, centre + a, centre + a]


def _gap_of(logs: list[float]):
    return paired_gap([math.exp(x) for x in logs], [1.0] * len(logs))


def test_the_projection_names_the_pairs_at_which_the_same_scatter_gets_that_precise():
    three, four = _gap_of(_symmetric(0.3, 0.05, 3)), _gap_of(_symmetric(0.3, 0.05, 4))
    assert math.log(three.high / three.ratio) > math.log1p(0.1) >= math.log(four.high / four.ratio)
    assert three.pairs_for(0.1, PAIRING_ROUNDS) == 4
    assert three.pairs_for(0.1, 3) is None  # not within the pairs allowed
    assert four.pairs_for(0.1, PAIRING_ROUNDS) == 4  # already that precise
    assert _gap_of([0.3]).pairs_for(0.1, PAIRING_ROUNDS) is None  # one pair: no scatter to tell


def test_its_help_names_the_round_bound():
    (option,) = [o for o in option_info() if o.name == "speedup_within"]
    assert f"up to {PAIRING_ROUNDS} re-measurement rounds" in option.help
    assert option.flag == "--speedup-within"


@pytest.mark.parametrize("value", [-0.1, 1, 1.5, True, "10%", None])
def test_a_value_that_is_no_fraction_is_refused(value):
    with pytest.raises(UsageError, match=r"--speedup-within .* is not allowed; expected a fraction"):
        TuneOptions(speedup_within=value)


def test_a_daemon_job_takes_it_below_one_only():
    from pydantic import ValidationError

    from advisor.daemon._requests import JobRequest

    job = JobRequest.model_validate({"script": "/x", "options": {"speedup_within": 0.05}})
    assert TuneOptions.from_dict(job.options.model_dump()).speedup_within == 0.05
    with pytest.raises(ValidationError):
        JobRequest.model_validate({"script": "/x", "options": {"speedup_within": 1.0}})


def test_the_command_refuses_it_in_one_line(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('never run')\n")
    out = CliRunner().invoke(app, ["tune", str(script), "--speedup-within", "2"])
    assert out.exit_code == 2
    assert "--speedup-within" in out.output and "Traceback" not in out.output


def test_a_round_that_unsettles_the_lead_while_chasing_precision_is_settled_again():
    # Two pairs resolve bf16-mixed's lead (2.0x, 1.96x); the pair run for a 10% interval is one a
    # neighbour disturbed (0.4x), which leaves the lead unresolved at three pairs (about 0.12x to
    # 12x), and the precision out of reach. Giving up the precision once gave up the decision too:
    # the tie went to fp32, written for a workload twice as fast in bf16 (the disturbed-reference
    # test, on a loaded machine). The rounds now go on until the lead is settled again.
    runner = _runner([50, 51, 250] + [50, 51] * 8)
    result = tune(runner, modes=MODES, remeasure=True)
    assert result.winner == Candidate("bf16-mixed")
    assert result.speedup.pairs > 3 and result.speedup.low > 1.0
    assert max(r for r, _ in remeasured(runner)) == result.speedup.pairs < PAIRING_ROUNDS
