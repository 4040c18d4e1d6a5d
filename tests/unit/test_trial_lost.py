"""A trial that timed out or was killed by a signal before its candidate was applied is ``lost``:
no verdict on the candidate. A script that exited by itself without applying it stays
``no-policy`` (or the crash it was), and one that was applied is judged as before."""

from __future__ import annotations

import signal

import pytest

from advisor.trial import OUTCOMES, TrialResult, TrialSpec, classify, merge_rank_results

SPEC = TrialSpec(policy={"schema": 1, "mode": "fp32"}, result_path="unused.json", label="fp32")
LIGHTNING = TrialSpec(policy={"schema": 1, "mode": "bf16-mixed"}, result_path="unused.json", framework="lightning")
SIGKILL, SIGSEGV = -int(getattr(signal, "SIGKILL", 9)), -int(signal.SIGSEGV)
STARTED = {"launched": 1000.0, "torch_imported": 1031.5}  # lightning's import alone took 29 s under load


def judge(data, *, spec=SPEC, exit_code=None, timed_out=False, timeline=None, oom_kills=None):
    return classify(data, exit_code=exit_code, timed_out=timed_out, stderr_tail="", spec=spec, timeout=120.0,
                    timeline=timeline, oom_kills=oom_kills)


def test_lost_is_an_outcome():
    assert "lost" in OUTCOMES and "no-policy" in OUTCOMES


def test_a_timeout_before_load_policy_is_lost():
    result = judge(None, exit_code=SIGKILL, timed_out=True, timeline={"launched": 1000.0})
    assert result.outcome == "lost" and not result.applied
    assert result.reason.startswith("lost before the candidate was applied (no result within 120 s, before load_policy()")
    assert result.reason.endswith("a failure of the machine or the script's start-up, not of the candidate")


def test_a_framework_trial_that_timed_out_before_its_trainer_existed_is_lost_and_says_where():
    loaded = {"stage": "loaded", "pid": 7, "timeline": {"torch_imported": 1031.5}}
    result = judge(loaded, spec=LIGHTNING, exit_code=SIGKILL, timed_out=True, timeline={"launched": 1000.0})
    assert result.outcome == "lost"
    assert "before the script built its lightning trainer with the candidate" in result.reason
    assert "last mark: torch imported, 31.5 s after launch" in result.reason


@pytest.mark.parametrize("code", [SIGKILL, SIGSEGV])
def test_a_signal_before_the_candidate_was_applied_is_lost(code):
    result = judge(None, exit_code=code, timeline=STARTED)
    assert result.outcome == "lost"
    assert f"killed by signal {signal.Signals(-code).name}" in result.reason


def test_a_loop_api_child_killed_inside_load_policy_is_lost():
    result = judge({"stage": "loaded", "pid": 7}, exit_code=SIGKILL)
    assert result.outcome == "lost" and "inside load_policy()" in result.reason


def test_an_oom_kill_before_the_application_says_so_and_is_still_lost():
    result = judge(None, exit_code=SIGKILL, oom_kills=1)
    assert result.outcome == "lost" and "OOM killer ended 1 process" in result.reason


def test_a_script_that_exited_by_itself_without_load_policy_stays_no_policy():
    assert judge(None, exit_code=0).outcome == "no-policy"
    failed = judge(None, exit_code=1, timeline=STARTED)
    assert failed.outcome == "no-policy" and "failed before load_policy()" in failed.reason


def test_a_framework_scripts_own_error_before_its_trainer_is_a_crash_not_lost():
    raised = {"stage": "exception", "exception": {"type": "FileNotFoundError", "message": "no data", "at": 1.0}}
    assert judge(raised, spec=LIGHTNING, exit_code=1).outcome == "crash"


def test_a_timeout_after_the_candidate_was_applied_is_a_timeout():
    loaded = {"stage": "loaded", "timeline": {"policy_applied": 1040.0}}
    result = judge(loaded, spec=LIGHTNING, exit_code=SIGKILL, timed_out=True, timeline={"launched": 1000.0})
    assert result.outcome == "timeout" and result.applied


def test_a_signal_after_the_candidate_was_applied_is_judged_as_before():
    stepping = {"stage": "stepping", "losses": [1.0, 0.9], "timeline": {"policy_applied": 1040.0}}
    assert judge(stepping, exit_code=SIGSEGV).outcome == "crash"
    assert judge(stepping, exit_code=SIGKILL, oom_kills=1).outcome == "oom"


def test_a_result_from_before_timelines_that_stepped_was_applied():
    # No timeline at all, but a stage only an applied candidate reaches.
    assert judge({"stage": "stepping"}, exit_code=SIGKILL, timed_out=True).outcome == "timeout"
    assert judge({"stage": "no-step"}, exit_code=97).outcome == "no-step"


def test_the_no_step_reason_counts_from_the_policys_application():
    spec = TrialSpec(policy={"schema": 1, "mode": "fp32"}, result_path="unused.json", first_step_timeout=45.0)
    result = judge({"stage": "no-step", "timeline": {"policy_applied": 1.0}}, spec=spec, exit_code=97)
    assert "within 45 s of the policy's application" in result.reason
    framework = judge({"stage": "no-step"}, spec=LIGHTNING, exit_code=97)
    assert "within 120 s of the policy's application" in framework.reason


def test_applied_reads_the_timeline_or_the_steps():
    assert TrialResult(outcome="ok", timeline={"policy_applied": 1.0}).applied
    assert TrialResult(outcome="ok", losses=(1.0,)).applied
    assert not TrialResult(outcome="lost", timeline={"launched": 1.0}).applied


def test_a_multi_process_trial_lost_before_any_rank_applied_the_candidate():
    merged = merge_rank_results([None, None])
    assert judge(merged, exit_code=SIGKILL, timed_out=True).outcome == "lost"


def test_the_node_flops_are_the_sum_of_the_ranks():
    def rank(flops):
        return {"stage": "done", "complete": True, "losses": [1.0], "step_times": [0.1], "skipped": [False],
                "samples": [8], "flops_per_step": flops, "flops_basis": "counted"}

    merged = merge_rank_results([rank(3e9), rank(3e9)])
    assert merged["flops_per_step"] == 6e9 and merged["flops_basis"] == "counted"
    assert merge_rank_results([rank(3e9), rank(None)])["flops_per_step"] is None
