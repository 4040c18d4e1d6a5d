"""A trial's timeline: the marks both recorders take (the candidate applied, the first step, the
end of the warm-up and of the measured window), the first-step watchdog that starts at the
candidate's application, and the pure functions that turn marks into a breakdown."""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from advisor.trial import (
    EXIT_NO_STEP,
    PHASES,
    TIMELINE_MARKS,
    TrialSpec,
    _child,
    _timeline,
    breakdown,
    recorder_for,
    startup_seconds,
)
from advisor.trial._timeline import merge_timelines
from policies import Policy
from probes import HardwareProfile

CPU = HardwareProfile(kind="cpu", name="test CPU", cores=2)
CHILD_MARKS = ("policy_applied", "first_step", "warmup_done", "measured_done")


@pytest.fixture(autouse=True)
def fresh_marks():
    """Marks are this process's: each test starts with none, and leaves none behind."""
    _timeline.clear()
    yield
    _timeline.clear()


def _spec(tmp_path, **fields) -> TrialSpec:
    spec = TrialSpec(policy=Policy(mode="fp32").to_dict(), result_path=str(tmp_path / "result.json"),
                     warmup_steps=2, measure_steps=3, device="cpu")
    return dataclasses.replace(spec, **fields)


def _wait_for(codes: list[int], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not codes and time.monotonic() < deadline:
        time.sleep(0.02)


def _train(mp) -> None:
    net = nn.Linear(4, 1)
    model, optimizer = mp.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    while True:
        loss = model(mp.to_device(torch.randn(8, 4))).pow(2).mean()
        mp.step(loss, optimizer)


# ---- marks -----------------------------------------------------------------------------------


def test_the_first_record_of_a_mark_stands_and_clear_forgets():
    _timeline.mark("first_step")
    first = _timeline.marks()["first_step"]
    _timeline.mark("first_step")
    assert _timeline.marks() == {"first_step": first}
    _timeline.clear()
    assert _timeline.marks() == {}


# ---- the loop API's recorder ----------------------------------------------------------------------


def test_a_loop_api_trial_marks_every_edge_in_order(tmp_path):
    data, error = _child.run_in_process(_train, _spec(tmp_path), profile=CPU)
    assert error is None and data["complete"], data
    timeline = data["timeline"]
    assert set(CHILD_MARKS) <= set(timeline)
    assert [timeline[m] for m in CHILD_MARKS] == sorted(timeline[m] for m in CHILD_MARKS)
    phases = breakdown(timeline)
    assert phases["to_first_step"] is not None and phases["warmup"] is not None and phases["measured"] is not None


def test_an_in_process_trial_starts_from_a_clean_timeline(tmp_path):
    _timeline._marks["first_step"] = 1.0  # an earlier trial of this process
    data, _ = _child.run_in_process(_train, _spec(tmp_path), profile=CPU)
    assert data["timeline"]["first_step"] > 1.0


def test_without_a_warm_up_the_measured_window_opens_at_the_first_step(tmp_path):
    data, _ = _child.run_in_process(_train, _spec(tmp_path, warmup_steps=0), profile=CPU)
    timeline = data["timeline"]
    assert timeline["policy_applied"] <= timeline["warmup_done"] <= timeline["first_step"] <= timeline["measured_done"]


def test_a_short_run_has_no_measured_done(tmp_path):
    def three_steps(mp) -> None:
        net = nn.Linear(4, 1)
        model, optimizer = mp.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
        for _ in range(3):
            mp.step(model(torch.randn(8, 4)).pow(2).mean(), optimizer)

    data, _ = _child.run_in_process(three_steps, _spec(tmp_path, warmup_steps=2, measure_steps=5), profile=CPU)
    assert data["complete"] is False
    assert {"policy_applied", "first_step", "warmup_done"} <= set(data["timeline"])
    assert "measured_done" not in data["timeline"]


def test_the_loop_api_watchdog_starts_with_load_policy(tmp_path, exits):
    spec = _spec(tmp_path, first_step_timeout=0.3)
    applied = _child._build(spec, _child.ResultWriter(spec.result_path), profile=CPU, device="cpu", in_process=False)
    recorder = applied._observer
    try:
        assert "policy_applied" in _timeline.marks() and recorder._watchdog is not None
        _wait_for(exits, 5.0)
        assert exits == [EXIT_NO_STEP]
    finally:
        recorder._watchdog.cancel()


# ---- a framework's recorder ---------------------------------------------------------------------


def test_a_framework_trial_marks_every_edge_in_order(tmp_path, exits):
    spec = _spec(tmp_path, warmup_steps=2, measure_steps=2, framework="lightning")
    recorder = recorder_for(spec)
    recorder.start()
    recorder.policy_applied()
    recorder.begin(user_batch=8, micro_batch=8, grad_accum_steps=1)
    for step in range(4):
        recorder.step(loss=torch.tensor(1.0 - step / 10))
    assert exits == [0]  # the window is full: the trial ends
    timeline = json.loads(Path(spec.result_path).read_text())["timeline"]
    assert [timeline[m] for m in CHILD_MARKS] == sorted(timeline[m] for m in CHILD_MARKS)


def test_the_framework_watchdog_waits_for_the_candidates_application(tmp_path, exits):
    # Imports, data preparation and the framework's own set-up come before the Trainer exists:
    # none of it counts against the first step.
    recorder = recorder_for(_spec(tmp_path, first_step_timeout=0.3, framework="lightning"))
    recorder.start()
    assert recorder._watchdog is None
    time.sleep(1.0)
    assert exits == [] and "policy_applied" not in _timeline.marks()
    recorder.policy_applied()
    try:
        _wait_for(exits, 5.0)
        assert exits == [EXIT_NO_STEP]
        assert json.loads(Path(recorder.spec.result_path).read_text())["stage"] == "no-step"
    finally:
        recorder._watchdog.cancel()


def test_a_second_trainer_does_not_restart_the_watchdog(tmp_path, exits):
    recorder = recorder_for(_spec(tmp_path, framework="lightning"))
    recorder.policy_applied()
    first, applied_at = recorder._watchdog, _timeline.marks()["policy_applied"]
    recorder.policy_applied()
    try:
        assert recorder._watchdog is first and _timeline.marks()["policy_applied"] == applied_at
    finally:
        first.cancel()


def test_a_first_step_the_adapter_did_not_announce_still_marks_the_application(tmp_path, exits):
    recorder = recorder_for(_spec(tmp_path, framework="accelerate"))
    recorder.begin(user_batch=8, micro_batch=8, grad_accum_steps=1)
    assert "policy_applied" in _timeline.marks() and recorder._watchdog is None


# ---- the pure functions -----------------------------------------------------------------------------

FULL = {"launched": 100.0, "torch_imported": 103.0, "policy_applied": 104.5, "first_step": 110.0,
        "warmup_done": 111.0, "measured_done": 121.0, "exited": 121.5}


def test_the_breakdown_has_every_phase_in_order():
    assert list(breakdown(FULL)) == [name for name, _, _ in PHASES]
    assert breakdown(FULL) == {"startup": 3.0, "script_setup": 1.5, "to_first_step": 5.5, "warmup": 1.0,
                               "measured": 10.0, "exit": 0.5}
    assert [begin for _, begin, _ in PHASES] == list(TIMELINE_MARKS[:-1])


def test_a_phase_missing_a_mark_or_out_of_order_is_unknown():
    lost = {"launched": 100.0, "torch_imported": 130.0, "exited": 700.0}
    assert breakdown(lost) == {"startup": 30.0, "script_setup": None, "to_first_step": None, "warmup": None,
                               "measured": None, "exit": None}
    backwards = {**FULL, "warmup_done": 109.0}
    assert breakdown(backwards)["warmup"] is None and breakdown(backwards)["measured"] == 12.0
    assert breakdown({**FULL, "exited": math.nan})["exit"] is None
    assert breakdown({**FULL, "first_step": "soon"})["to_first_step"] is None


def test_startup_seconds_runs_from_launch_to_the_first_step():
    assert startup_seconds(FULL) == pytest.approx(10.0)
    assert startup_seconds({"launched": 100.0}) is None
    assert startup_seconds({"launched": 100.0, "first_step": 90.0}) is None


def test_merged_timelines_take_each_mark_at_the_latest_rank():
    rank0 = {"launched": 100.0, "policy_applied": 104.0, "first_step": 110.0}
    rank1 = {"launched": 100.0, "policy_applied": 106.0, "first_step": 109.0, "measured_done": 120.0}
    merged = merge_timelines([rank0, rank1, {"bogus": 1.0, "exited": "late"}])
    assert merged == {"launched": 100.0, "policy_applied": 106.0, "first_step": 110.0, "measured_done": 120.0}
    assert merge_timelines([]) == {}
