"""One tune, one speed-up figure: every view of a tune (the report, its JSON, its progress lines,
the daemon's progress lines and status, the cache) shows the winner's paired figure, and any
other ratio it prints says what it is.

The fake runner makes the search's single runs far faster than the re-measurement (a machine
that slowed down while the tune ran), so a view that shows a search ratio as the winner's, or an
unlabelled ``x fp32`` number, shows a different number from the figure.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import json
import re
from contextlib import contextmanager

import pytest
from rich.console import Console
from test_search import GPU, N_STEPS, FakeRunner

from advisor.cache._store import open_store
from advisor.cli._daemon import render_status
from advisor.cli._report import render_tune, tune_progress
from advisor.trial import TrialResult
from advisor.tune import TuneOptions, TuneRequest, tune_script
from advisor.tune import job as tune_job
from policies import Policy

# The whole report (mpadvise tune --verbose): it holds every figure these tests read.
render_verbose = functools.partial(render_tune, verbose=True)

SEARCH_MS = {"fp32": 10.0, "bf16-mixed": 4.0, "fp16-mixed": 4.2}  # the search's runs: bf16 2.5x fp32
REMEASURE_MS = {"fp32": 10.0, "bf16-mixed": 8.0, "fp16-mixed": 8.4}  # side by side later: 1.25x
OPTIONS = TuneOptions(trials=3, modes=["bf16-mixed", "fp16-mixed"], no_priors=True)
FIGURE_X = re.compile(r"(\d+\.\d+)x fp32")


class SlowingRunner(FakeRunner):
    """A FakeRunner whose re-measurements run at other speeds than the search's runs, with a
    little scatter in the step times (so that every row has a spread)."""

    def __call__(self, policy: Policy, label: str) -> TrialResult:
        result = super().__call__(policy, label)
        ms = (REMEASURE_MS if "re-measure" in label else SEARCH_MS)[policy.mode]
        ms *= (policy.micro_batch_size or 64) * (policy.grad_accum_steps or 1) / 64
        times = tuple(ms / 1e3 * (1 + 0.04 * ((i * 7) % 5) / 4) for i in range(N_STEPS))
        return dataclasses.replace(result, step_times=times)


@pytest.fixture
def tuned(tmp_path, cache_home, capsys):
    """One tune through the service, with its progress lines as ``mpadvise tune`` and the
    daemon's job print them."""
    script = tmp_path / "train.py"
    script.write_text("import advisor\nmp = advisor.load_policy()\n")
    console = Console(record=True, width=200, file=io.StringIO())

    @contextmanager
    def both(total):  # the CLI's bar and the daemon job's lines, fed by the same tune
        with tune_progress(console, total) as (start, done, round_), tune_job.progress_lines(total) as job:
            def on_done(label, ev, m):
                done(label, ev, m)
                job[1](label, ev, m)
            yield start, on_done, round_

    runner = SlowingRunner(SEARCH_MS)
    done = tune_script(TuneRequest(script, (), OPTIONS), profile=GPU, runner=runner, progress=both)
    return done, console.export_text(), capsys.readouterr().err


def test_every_view_shows_the_winners_one_figure(tuned):
    done, progress_text, job_text = tuned
    data = json.loads(json.dumps(done.to_dict(), default=str))
    figure = data["speedup_vs_fp32"]
    shown = f"{figure:.2f}x"
    assert data["speedup"]["pairs"] >= 2 and data["speedup"]["ratio"] == figure == done.result.winner_speedup
    winner = next(row for row in data["candidates"] if row["winner"])
    # The setting: the search saw the winner about twice as fast as its figure.
    assert winner["search_speedup_vs_fp32"] > 1.5 * figure
    assert winner["speedup_vs_fp32"] == figure

    # The report: its only "x fp32" numbers are the figure; the winner's row shows it, marked.
    console = Console(record=True, width=200, file=io.StringIO())
    render_verbose(data, console)
    report = console.export_text()
    assert set(FIGURE_X.findall(report)) == {f"{figure:.2f}"}, report
    row_line = next(line for line in report.splitlines() if line.lstrip().startswith("→"))
    assert f"{shown}†" in row_line and f"{winner['search_speedup_vs_fp32']:.2f}x" not in report
    assert "the tune's one figure" in report
    # The table reads true: no row above the rule shows more than the winner without a tie.
    above = report.split("──┼")[0]
    ratios = [float(x) for x in re.findall(r"(\d+\.\d\d)x", above)]
    assert ratios and ratios[0] == float(f"{figure:.2f}")

    # Progress lines, of the CLI and of a daemon job: one run's ratio, named as such.
    for text in (progress_text, job_text):
        assert "re-measure" in text and not FIGURE_X.findall(text), text
        assert re.search(r"bf16-mixed \(re-measure 1\): ok, this run \d+\.\d\dx the fp32 reference run", text), text

    # `mpadvise daemon status`: the figure, with what it rests on.
    health = {"version": "0", "pid": 1, "uptime_s": 5.0, "jobs": {"done": 1}, "slots": []}
    job = {"id": "a" * 32, "state": "done", "script": data["script"], "created_at": "2026-01-01T00:00:00",
           "result": {"tune": data}}
    console = Console(record=True, width=300, file=io.StringIO())
    render_status({"health": health, "where": "127.0.0.1:1", "jobs": [job]}, console)
    status = console.export_text()
    assert FIGURE_X.findall(status) == [f"{figure:.2f}"]
    assert f"{shown} fp32 goodput ({data['speedup']['basis']})" in status

    # The cache: the recommendation and the winner's trial row hold the figure.
    with open_store() as store:
        (cached,) = store.find_recommendations(with_trials=True)
    assert cached["speedup_vs_fp32"] == figure
    metrics = next(t["metrics"] for t in cached["trials"] if t["metrics"]["label"] == data["winner_label"])
    assert metrics["speedup_ratio"] == figure and metrics["speedup_basis"] == data["speedup"]["basis"]
    # Its goodput is the search's single run, and says so: the entry's own is the re-measured one.
    assert metrics["goodput_basis"] == "search run"


def test_a_gap_between_finalists_says_it_is_no_speed_up():
    tune = {"gap": {"between": ["bf16-true", "bf16-mixed"], "ratio": 1.16, "low": 1.1, "high": 1.2, "pairs": 4,
                    "verdict": "faster"}, "reference": {"label": "fp32"}, "candidates": [], "winner": None}
    console = Console(record=True, width=300, file=io.StringIO())
    render_verbose(tune, console)
    gap = next(line for line in console.export_text().splitlines() if line.startswith("gap: "))
    assert "bf16-true runs 1.16x the goodput of bf16-mixed" in gap and "not a speed-up over fp32" in gap
