"""Every row of the search carries the spread of its own step times, and the tune table shows it
as ± beside every ratio it prints."""

from __future__ import annotations

import dataclasses
import functools
import io
import json

import pytest
from rich.console import Console
from test_search import FakeRunner, tune

from advisor.cli._report import render_tune
from advisor.cli._report_cells import candidate_spread
from advisor.trial import TrialResult
from advisor.tune._timing import step_time_range
from policies import Policy

# The whole report (mpadvise tune --verbose): it holds every figure these tests read.
render_verbose = functools.partial(render_tune, verbose=True)

SPEEDS = {"fp32": 10.0, "bf16-mixed": 4.0, "fp16-mixed": 4.2, "bf16-true": 3.0}
MODES = ("bf16-mixed", "fp16-mixed", "bf16-true")


class ScatteredRunner(FakeRunner):
    """A FakeRunner whose step times scatter, each mode by its own amount (±5% to ±20%)."""

    def __call__(self, policy: Policy, label: str) -> TrialResult:
        result = super().__call__(policy, label)
        width = {"fp32": 0.05, "bf16-mixed": 0.1, "fp16-mixed": 0.2, "bf16-true": 0.15}[policy.mode]
        times = tuple(t * (1 + width * (((i * 7) % 11) / 10 - 0.5)) for i, t in enumerate(result.step_times))
        return dataclasses.replace(result, step_times=times)


@pytest.mark.parametrize("remeasure", [False, True])
def test_every_measured_row_has_its_step_time_spread_and_the_table_shows_it(remeasure):
    result = tune(ScatteredRunner(SPEEDS), modes=MODES, trials=5, no_priors=True, remeasure=remeasure)
    data = json.loads(json.dumps(result.to_dict(), default=str))
    rows = [row for row in data["candidates"] if row["goodput"]]
    assert len(rows) >= 4
    for row in rows:
        cand = next(c for c in result.evaluations if c.label == row["label"])
        ev = result.evaluations[cand]
        assert (row["step_time_p10"], row["step_time_p90"]) == pytest.approx(
            step_time_range(ev.result.step_times, ev.result.warmup_steps))
        assert 0 < row["step_time_p10"] < row["step_time_p90"]
        assert candidate_spread(data, row) is not None
    console = Console(record=True, width=200, file=io.StringIO())
    render_verbose(data, console)
    table = console.export_text().split("×fp32: goodput")[0]
    for row in rows:
        line = next(ln for ln in table.splitlines() if f"│ {row['label']} " in ln)
        assert "x" in line and "±" in line, line


def test_a_search_rows_spread_is_half_its_p90_over_p10():
    row = {"label": "bf16-mixed", "goodput": 1.0, "step_time_p10": 0.010, "step_time_p90": 0.012}
    assert candidate_spread({"candidates": [row]}, row) == pytest.approx(0.1)


def test_step_time_range_needs_two_measured_steps():
    assert step_time_range([1.0, 2.0, 3.0], 2) is None
    low, high = step_time_range([9.0] * 3 + [1.0 + i / 10 for i in range(11)], 3)
    assert (low, high) == pytest.approx((1.1, 1.9))
