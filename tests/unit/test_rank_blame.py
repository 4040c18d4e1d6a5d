"""Which rank a failed multi-process trial blames, from the ranks' result files and the rank
launcher's record of how each rank ended (``advisor.trial._ranks``): the rank that ended first
with a failure of its own, not the healthy peer that lost its connection to it afterwards."""

from __future__ import annotations

import math
import signal

import pytest

from advisor.trial import TrialSpec, classify, merge_rank_results

SPEC = TrialSpec(policy={"mode": "fp32"}, result_path="/tmp/trial.json", warmup_steps=1, measure_steps=3,
                 nproc_per_node=2)
SIGKILL = -int(getattr(signal, "SIGKILL", 9))
APPLIED = {"launched": 1000.0, "policy_applied": 1010.0}
RESET = {"type": "RuntimeError", "message": "[gloo] Connection reset by peer", "at": 30.0}


def stepping(**changes):
    return {"stage": "stepping", "timeline": dict(APPLIED), **changes}


def raised(exception):
    return {"stage": "exception", "timeline": dict(APPLIED), "exception": exception}


def ended(*entries):
    """The launcher's record: ``(rank, status, stopped)`` in the order the ranks ended."""
    rows = []
    for rank, status, stopped in entries:
        name = signal.Signals(-status).name if status < 0 else None
        rows.append({"rank": rank, "pid": 100 + rank, "status": status, "signal": name, "at": 0.0, "stopped": stopped})
    return {"nproc": 2, "ended": rows}


def judged(ranks, exits, *, exit_code, oom_kills=None, timed_out=False):
    return classify(merge_rank_results(ranks, exits=exits), exit_code=exit_code, timed_out=timed_out, stderr_tail="",
                    spec=SPEC, timeout=60, oom_kills=oom_kills)


@pytest.mark.parametrize("faulty", [0, 1])
def test_a_rank_killed_by_a_signal_is_blamed_not_its_peer_that_lost_the_connection(faulty):
    healthy = 1 - faulty
    ranks = [None, None]
    ranks[faulty], ranks[healthy] = stepping(), raised(RESET)
    exits = ended((faulty, SIGKILL, False), (healthy, 1, False))
    result = judged(ranks, exits, exit_code=SIGKILL, oom_kills=0)
    assert result.outcome == "crash"
    assert f"rank {faulty} was killed by SIGKILL after its first step() without an error of its own" in result.reason
    assert f"rank {healthy}" not in result.reason and "Connection reset" not in result.reason


def test_a_rank_the_oom_killer_ended_is_out_of_memory_naming_it():
    exits = ended((1, SIGKILL, False), (0, 1, False))
    result = judged([raised(RESET), stepping()], exits, exit_code=SIGKILL, oom_kills=1)
    assert result.outcome == "oom"
    assert result.reason.startswith("out of memory: the kernel's OOM killer ended the script on rank 1")
    # Another signal is no OOM kill, whatever the count says.
    segv = -int(signal.SIGSEGV)
    result = judged([raised(RESET), stepping()], ended((1, segv, False), (0, 1, False)), exit_code=segv, oom_kills=1)
    assert result.outcome == "crash" and "rank 1 was killed by SIGSEGV" in result.reason


def test_a_rank_that_called_os_exit_is_blamed_with_its_status():
    exits = ended((1, 3, False), (0, 1, False))
    result = judged([raised(RESET), stepping()], exits, exit_code=3)
    assert result.outcome == "crash"
    assert "rank 1 exited with status 3 after its first step() without an error of its own" in result.reason
    assert "rank 0" not in result.reason


def test_the_first_rank_to_end_with_its_own_exception_is_blamed_whatever_the_clocks_say():
    own = {"type": "ValueError", "message": "bad batch at step 3", "at": 40.0}  # a later clock than its peer's
    exits = ended((1, 1, False), (0, 1, False))
    result = judged([raised(RESET), raised(own)], exits, exit_code=1)
    assert result.reason == "the script crashed on rank 1 (exit 1): ValueError: bad batch at step 3"


def test_ranks_the_launcher_stopped_are_never_blamed():
    exits = ended((1, 3, False), (0, -int(signal.SIGTERM), True))
    result = judged([stepping(), stepping()], exits, exit_code=3)
    assert "rank 1 exited with status 3" in result.reason


def test_a_rank_killed_before_applying_the_candidate_makes_the_trial_lost():
    # Rank 1 was killed before load_policy() (no result file); rank 0 had applied the candidate
    # and waited for it. Nothing says anything of the candidate: the tune runs it again.
    loaded = {"stage": "loaded", "timeline": dict(APPLIED)}
    result = judged([loaded, None], ended((1, SIGKILL, False), (0, -int(signal.SIGTERM), True)), exit_code=SIGKILL)
    assert result.outcome == "lost", result.reason
    assert "killed by signal SIGKILL, rank 1" in result.reason and "rank 1, before load_policy()" in result.reason


def test_a_timeout_while_a_rank_had_not_applied_the_candidate_is_lost_naming_it():
    result = judged([stepping(), None], None, exit_code=SIGKILL, timed_out=True)
    assert result.outcome == "lost", result.reason
    assert "no result within 60 s, rank 1, before load_policy()" in result.reason


def test_a_timeout_after_every_rank_applied_the_candidate_says_how_far_each_got():
    result = judged([stepping(), {"stage": "loaded", "timeline": dict(APPLIED)}], None, exit_code=SIGKILL,
                    timed_out=True)
    assert result.outcome == "timeout"
    assert "rank 0 after its first step(); rank 1 after load_policy(), before any step()" in result.reason


def test_a_nan_names_the_rank_where_it_came_first():
    def finished(losses):
        return {"stage": "done", "complete": True, "losses": losses, "step_times": [0.1] * 4, "samples": [8] * 4,
                "skipped": [False] * 4, "loss_scale": [None] * 4, "underflow": [None] * 4, "timeline": dict(APPLIED)}

    merged = merge_rank_results([finished([1.0, 0.9, "nan", "nan"]), finished([1.0, "nan", "nan", "nan"])])
    assert math.isnan(float(merged["losses"][1]))
    assert "the first non-finite loss came at step 1 on rank 1" in merged["notes"]
