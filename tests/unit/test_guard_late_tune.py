"""The next tune heeds the guard: a mode that a long run's guard caught is read back from the
cache, judged ``unstable late (step N)``, not run, and named so in the JSON and the report;
clearing the cache forgets it. tests/integration/test_guard_next_tune.py does the same through
real runs, in the slow set."""

from __future__ import annotations

from rich.console import Console
from test_search import GPU, FakeRunner, tune

from advisor.cache._recommend import guard_events_for, record_guard_event
from advisor.cache._store import open_store
from advisor.cli._report import render_tune
from advisor.tune._plan import late_unstable

STALL = {"signal": "stall", "step": 120, "tripped_at": 131, "policy": "bf16-true", "fallback": "bf16-mixed",
         "action": "fell back", "detail": "the loss stopped falling"}


def test_a_mode_the_guard_caught_is_not_run_again_and_is_named_late(tmp_path, cache_home):
    script = tmp_path / "train.py"
    script.write_text("")
    assert record_guard_event(STALL, profile=GPU, workload_fp=None, script=script)
    assert guard_events_for(GPU, tmp_path / "other.py") == []  # another script's run says nothing here
    late = late_unstable(guard_events_for(GPU, script))
    assert list(late) == ["bf16-true"]
    assert late["bf16-true"].startswith("unstable late (step 120): the guard saw stall under bf16-true in a run on ")

    # bf16-true would be the fastest: the guard's verdict, not its speed, keeps it out.
    runner = FakeRunner({"fp32": 100, "tf32": 40, "bf16-mixed": 20, "fp16-mixed": 21, "bf16-true": 15,
                         "fp16-true": 16})
    result = tune(runner, remeasure=False, late=late)
    assert "bf16-true" not in result.space.modes and all(p.mode != "bf16-true" for p in runner.calls)
    assert result.winner.mode != "bf16-true"
    data = result.to_dict()
    (row,) = data["late"]
    assert (row["mode"], row["outcome"]) == ("bf16-true", "unstable") and row["reason"] == late["bf16-true"]
    console = Console(record=True, width=200)
    render_tune(data, console)
    assert "not run: bf16-true, unstable late (step 120)" in console.export_text()

    with open_store() as store:  # what `mpadvise cache clear` runs: the events go with the entries
        store.clear()
    assert guard_events_for(GPU, script) == []


def test_fp32_and_repeated_events_give_one_verdict_per_mode():
    events = [{**STALL, "step": 300, "created_at": "2026-12-02T10:00:00"}, STALL,
              {**STALL, "policy": "fp32"}, {**STALL, "policy": ""}]
    assert late_unstable(events) == {"bf16-true": "unstable late (step 300): the guard saw stall under bf16-true "
                                                  "in a run on 2026-12-02; mpadvise cache clear forgets it"}
