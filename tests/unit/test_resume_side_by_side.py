"""After ``--resume``, the figure that decides the winner is measured side by side in this run.

The earlier run stored every candidate's goodput in a real SQLite study while the machine ran
five times faster; this run's fresh fp32 is slow. Compared raw, a resumed candidate would look
about 5x faster than fp32 (a winner once jumped from 0.85x to 4.77x so); the winner's figure must
stay the paired one of this run, and the report must say that it is.
"""

from __future__ import annotations

import functools
import io
import json

import pytest
from rich.console import Console
from test_search import GPU, FakeRunner, tune

from advisor.cli._report import render_tune
from advisor.tune import TuneOptions, TuneRequest, tune_script
from advisor.tune._engine import LOCAL_PAIRS

# The whole report (mpadvise tune --verbose): it holds every figure these tests read.
render_verbose = functools.partial(render_tune, verbose=True)

EARLIER = {"fp32": 2.0, "bf16-mixed": 2.1, "fp16-mixed": 2.2}  # the earlier run: everything 5x faster
MODES = ["bf16-mixed", "fp16-mixed"]


def _resumed_tune(tmp_path, here: dict[str, float], **option_values):
    script = tmp_path / "train.py"
    script.write_text("import advisor\nmp = advisor.load_policy()\n")
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    options = TuneOptions(trials=3, modes=MODES, no_priors=True, storage=storage, no_cache=True)
    tune_script(TuneRequest(script, (), options), profile=GPU, runner=FakeRunner(EARLIER))
    runner = FakeRunner(here)
    done = tune_script(TuneRequest(script, (), options.with_(resume=True, **option_values)), profile=GPU, runner=runner)
    assert done.result.search.resumed >= 2  # the candidates' search figures are the earlier run's
    data = json.loads(json.dumps(done.to_dict(), default=str))
    console = Console(record=True, width=200, file=io.StringIO())
    render_verbose(data, console)
    return done, data, console.export_text(), runner


def test_a_resumed_candidate_slower_here_loses_to_fp32(tmp_path, cache_home):
    # Here bf16 runs at 0.83x fp32: raw, its stored figure would read 10 / 2.1 = 4.76x.
    done, data, report, runner = _resumed_tune(tmp_path, {"fp32": 10.0, "bf16-mixed": 12.0, "fp16-mixed": 12.5})
    assert data["winner_label"] == "fp32" and data["speedup_vs_fp32"] == 1.0
    assert any("bf16-mixed" in label and "re-measure" in label for label in runner.labels)
    for row in data["candidates"]:
        assert row["speedup_vs_fp32"] is None or row["speedup_vs_fp32"] < 1.5, row
    assert "4.76x" not in report and "4.77x" not in report
    assert "winner: fp32" in report


def test_a_resumed_winners_figure_is_its_pairs_with_fp32_in_this_run(tmp_path, cache_home):
    done, data, report, runner = _resumed_tune(tmp_path, {"fp32": 10.0, "bf16-mixed": 8.0, "fp16-mixed": 8.4})
    assert data["winner_label"].startswith("bf16-mixed") or data["winner_label"].startswith("fp16-mixed")
    speedup = data["speedup"]
    assert speedup["pairs"] >= LOCAL_PAIRS and speedup["basis"].startswith("paired re-measurement")
    assert 1.1 < data["speedup_vs_fp32"] < 1.35  # this run's 1.19x to 1.25x, never the earlier run's 5x
    assert done.result.policy.tuned_on.speedup_vs_fp32 == data["speedup_vs_fp32"]
    # The rows from the study carry no ratio against this run's fp32 unless they ran beside it here.
    for row in data["candidates"]:
        if row["resumed"] and not row["winner"]:
            assert row["search_speedup_vs_fp32"] is None
            assert row["paired_speedup"] is None or row["paired_speedup"]["ratio"] < 1.5
    # The report says where the figure comes from.
    said = " ".join(" ".join(report.split("resumed: ", 1)[1].split("\n")[:2]).split())
    assert "never compared with this run's fp32" in said and "side by side in this run" in said
    assert f"{data['speedup_vs_fp32']:.2f}x fp32 goodput (paired re-measurement" in report


def test_without_remeasurement_a_resumed_winner_is_still_paired_here(tmp_path):
    # The Python API's remeasure=False: the search's single runs decide, but a winner whose
    # figure is an earlier run's is run beside this run's fp32 before it is reported.
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    tune(FakeRunner(EARLIER), storage=storage, study_name="s", no_priors=True, modes=MODES, remeasure=False, trials=4)
    runner = FakeRunner({"fp32": 10.0, "bf16-mixed": 8.0, "fp16-mixed": 8.4})
    result = tune(runner, storage=storage, study_name="s", resume=True, no_priors=True, modes=MODES, remeasure=False,
                  trials=4)
    assert result.search.resumed >= 2
    assert result.winner is not None and result.resumed(result.winner)
    assert result.speedup.pairs >= LOCAL_PAIRS and result.speedup.basis.startswith("paired re-measurement")
    assert result.speedup.ratio == pytest.approx(10.0 / runner.step_ms[result.winner.mode], rel=1e-3)
