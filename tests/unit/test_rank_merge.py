"""A multi-process trial, parent side: merging its ranks' results (pure), the launch through
the rank launcher, each rank's own result file, and the process tree a timeout kills."""

from __future__ import annotations

import math

import pytest

from advisor.trial import TrialSpec, classify, merge_rank_results, rank_result_path, spec_from_env
from advisor.trial._launch import _tail
from advisor.trial._proctree import descendants
from advisor.tune._options import TuneOptions
from advisor.tune._run import TrialSettings
from policies import Policy
from probes import MpadviseError

SPEC = TrialSpec(policy={"mode": "bf16-mixed"}, result_path="/tmp/trial.json", warmup_steps=1, measure_steps=3,
                 nproc_per_node=2)


def done(**changes):
    """One rank's finished result, as the recorder writes it."""
    data = {
        "stage": "done", "complete": True, "losses": [2.0, 1.5, 1.2, 1.0], "step_times": [0.3, 0.2, 0.2, 0.2],
        "loss_scale": [None] * 4, "skipped": [False] * 4, "underflow": [None] * 4, "samples": [32] * 4,
        "warmup_steps": 1, "peak_memory": 100, "memory_kind": "cpu-peak-rss", "notes": [], "user_batch": 32,
        "micro_batch": 32, "grad_accum_steps": 1, "global_batch": 32, "device": "cpu", "fsdp": False,
        "workload_fingerprint": "ab" * 8, "model_signature": "cd" * 8,
    }
    data.update(changes)
    return data


def judged(ranks, *, exit_code=0):
    return classify(merge_rank_results(ranks), exit_code=exit_code, timed_out=False, stderr_tail="", spec=SPEC,
                    timeout=60)


# ---- merging finished ranks ------------------------------------------------------------------


def test_finished_ranks_merge_step_by_step():
    rank0 = done(step_times=[0.3, 0.2, 0.25, 0.2], losses=[2.0, 1.6, 1.2, 1.0], peak_memory=100, notes=["kept fp32 head"])
    rank1 = done(step_times=[0.2, 0.4, 0.2, 0.21], losses=[1.0, 1.2, 1.0, 0.8], peak_memory=300, samples=[32, 32, 32, 96],
                 notes=["kept fp32 head", "rank 1 note"], fsdp=True)
    merged = merge_rank_results([rank0, rank1])
    assert merged["ranks"] == 2
    # The slowest rank's time per step: a synchronous step waits for it.
    assert merged["step_times"] == [0.3, 0.4, 0.25, 0.21]
    # The global batch's loss: the mean weighted by each rank's samples.
    assert merged["losses"][:3] == pytest.approx([1.5, 1.4, 1.1])
    assert merged["losses"][3] == pytest.approx((1.0 * 32 + 0.8 * 96) / 128)
    assert merged["samples"] == [64, 64, 64, 128]
    assert merged["peak_memory"] == 300
    assert merged["notes"] == ["kept fp32 head", "rank 1 note"]
    assert merged["fsdp"] is True and merged["complete"] is True
    result = judged([rank0, rank1])
    assert result.outcome == "ok" and result.ranks == 2 and result.fsdp


def test_a_nan_on_any_rank_is_a_nan_and_inf_stays_inf():
    merged = merge_rank_results([done(losses=[2.0, 1.5, float("inf"), 1.0]), done(losses=[2.0, float("nan"), 1.0, 1.0])])
    losses = [float(v) for v in merged["losses"]]
    assert math.isnan(losses[1]) and losses[2] == math.inf and losses[3] == 1.0
    # Strict JSON: the non-finite values are written as strings that float() reads.
    assert merged["losses"][1] == "nan"


def test_ranks_that_disagree_on_a_skipped_step_crash_the_trial_naming_them():
    rank1 = done(skipped=[False, False, True, False])
    result = judged([done(), rank1])
    assert result.outcome == "crash"
    assert "disagree on skipped steps" in result.reason
    assert "step 2 was skipped on rank 1 but taken on rank 0" in result.reason


def test_agreeing_skips_are_kept():
    skipped = [True, False, False, False]
    merged = merge_rank_results([done(skipped=skipped, loss_scale=[65536.0] * 4), done(skipped=skipped)])
    assert merged["skipped"] == skipped and merged["stage"] == "done"
    assert merged["loss_scale"] == [65536.0] * 4  # rank 0's


def test_a_rank_that_ended_early_shortens_the_curves():
    merged = merge_rank_results([done(), done(losses=[2.0, 1.5, 1.2], step_times=[0.3, 0.2, 0.2], complete=False)])
    assert len(merged["losses"]) == 3 and len(merged["step_times"]) == 3
    assert merged["complete"] is False


# ---- failures --------------------------------------------------------------------------------


def test_the_rank_that_failed_first_is_the_cause():
    # Rank 1 raised; rank 0 then lost its peer in the all-reduce and raised a later error.
    rank0 = {"stage": "exception", "exception": {"type": "RuntimeError", "message": "[gloo] Connection closed by peer", "at": 20.0}}
    rank1 = {"stage": "exception", "exception": {"type": "ValueError", "message": "bad batch on this rank", "at": 10.0}}
    result = judged([rank0, rank1], exit_code=1)
    assert result.outcome == "crash"
    assert result.reason == "the script crashed on rank 1 (exit 1): ValueError: bad batch on this rank"


def test_out_of_memory_on_one_rank_names_it():
    rank1 = {"stage": "exception", "exception": {"type": "OutOfMemoryError", "message": "CUDA out of memory", "at": 1.0}}
    result = judged([{"stage": "stepping"}, rank1], exit_code=1)
    assert result.outcome == "oom" and "on rank 1" in result.reason


def test_a_rank_without_a_result_file_is_a_crash_naming_it():
    result = judged([done(), None], exit_code=1)
    assert result.outcome == "crash"
    assert "rank 1 wrote no result" in result.reason and "load_policy()" in result.reason


def test_a_rank_killed_while_another_finished_is_a_crash_naming_it():
    result = judged([done(), {"stage": "stepping"}], exit_code=1)
    assert result.outcome == "crash"
    assert "rank 1 stopped after its first step() without an error of its own" in result.reason


def test_a_rank_the_oom_killer_ended_is_out_of_memory_naming_it():
    merged = merge_rank_results([done(), {"stage": "stepping"}])
    result = classify(merged, exit_code=1, timed_out=False, stderr_tail="", spec=SPEC, timeout=60, oom_kills=1)
    assert result.outcome == "oom"
    assert result.reason.startswith("out of memory: the kernel's OOM killer ended the script on rank 1")
    # A Python error on a rank stays that error, whatever else the OOM killer did meanwhile.
    raised = {"stage": "exception", "exception": {"type": "ValueError", "message": "bad", "at": 1.0}}
    result = classify(merge_rank_results([done(), raised]), exit_code=1, timed_out=False, stderr_tail="", spec=SPEC,
                      timeout=60, oom_kills=1)
    assert result.outcome == "crash"


def test_unsupported_and_no_step_ranks_decide_the_outcome():
    unsupported = {"stage": "unsupported", "reason": "fp8-te cannot run on this CPU"}
    assert judged([unsupported, unsupported], exit_code=98).outcome == "unsupported"
    assert judged([{"stage": "no-step"}, {"stage": "stepping"}], exit_code=97).outcome == "no-step"


def test_no_rank_file_at_all_is_no_result():
    assert merge_rank_results([None, None]) is None
    result = classify(None, exit_code=1, timed_out=False, stderr_tail="SyntaxError: invalid syntax", spec=SPEC, timeout=60)
    assert result.outcome == "no-policy"


def test_a_timeout_is_judged_on_the_merged_stage():
    merged = merge_rank_results([{"stage": "stepping"}, {"stage": "stepping"}])
    result = classify(merged, exit_code=-9, timed_out=True, stderr_tail="", spec=SPEC, timeout=30)
    assert result.outcome == "timeout" and "no result within 30 s" in result.reason


# ---- launch and result files ------------------------------------------------------------------


def test_one_process_keeps_the_plain_launch():
    settings = TrialSettings()
    assert settings.nproc_per_node == 1
    assert settings.launch("/usr/bin/python3") == ()
    boot = ("-P", "-m", "advisor.frameworks._boot", "lightning")
    assert settings.launch("/usr/bin/python3", boot) == boot
    spec = settings.spec(Policy(mode="fp32"), "/tmp/r.json", "fp32")
    assert spec.nproc_per_node == 1 and spec.result_path == "/tmp/r.json"


def test_several_processes_launch_through_the_rank_launcher_with_the_same_command_per_rank():
    settings = TrialSettings(nproc_per_node=2)
    boot = ("-P", "-m", "advisor.frameworks._boot", "lightning")
    argv = settings.launch("/venv/bin/python", boot)
    assert "torch.distributed.run" not in argv  # no elastic agent, no TCP store
    assert argv[:2] == ("-I", "-S") and argv[2].endswith("_ranks.py")
    assert argv[argv.index("--nproc") + 1] == "2"
    # Each rank runs `python -P -m advisor.trial._run LAUNCH SCRIPT ARGS`: a cold one-process
    # trial's command line, which points torch's env:// rendezvous at the trial's file store.
    assert argv[argv.index("--") + 1:] == ("/venv/bin/python", "-P", "-m", "advisor.trial._run", *boot)
    assert settings.spec(Policy(mode="fp32"), "/tmp/r.json", "fp32").nproc_per_node == 2


def test_a_numbered_gpu_is_refused_with_several_processes():
    with pytest.raises(MpadviseError, match="--device cuda:1 cannot be used with --nproc-per-node 2"):
        TrialSettings(nproc_per_node=2, device="cuda:1")
    with pytest.raises(MpadviseError, match="nproc-per-node: 0 is not allowed"):
        TrialSettings(nproc_per_node=0)
    assert TrialSettings(nproc_per_node=2, device="cuda").device == "cuda"
    with pytest.raises(MpadviseError, match="--device cuda:0 cannot be used with --nproc-per-node 4"):
        TuneOptions(nproc_per_node=4, device="cuda:0")
    assert TrialSettings.for_tune(TuneOptions(nproc_per_node=2)).nproc_per_node == 2


def test_a_function_cannot_be_tuned_in_several_processes():
    import advisor

    with pytest.raises(MpadviseError, match="nproc_per_node=2: a function is tuned in this one process"):
        advisor.tune(lambda mp: None, nproc_per_node=2)


def test_each_rank_writes_its_own_result_file(tmp_path, monkeypatch):
    spec_file = tmp_path / "spec.json"
    monkeypatch.setenv("MPADVISE_TRIAL_SPEC", str(spec_file))
    monkeypatch.setenv("RANK", "1")
    spec_file.write_text(TrialSpec(policy={"mode": "fp32"}, result_path=str(tmp_path / "r.json"), nproc_per_node=2).to_json())
    assert spec_from_env().result_path == rank_result_path(tmp_path / "r.json", 1) == f"{tmp_path / 'r.json'}.rank1"
    # One process: the path stays, whatever RANK says.
    spec_file.write_text(TrialSpec(policy={"mode": "fp32"}, result_path=str(tmp_path / "r.json")).to_json())
    assert spec_from_env().result_path == str(tmp_path / "r.json")


def test_descendants_follow_the_tree_through_new_sessions():
    # torchrun (10) -> workers 11, 12 (their own sessions) -> a data loader worker 13 under 12.
    parents = {1: 0, 10: 9, 11: 10, 12: 10, 13: 12, 20: 1}
    assert descendants(parents, 10) == [11, 12, 13]
    assert descendants(parents, 13) == []


def test_the_stderr_tail_keeps_the_last_lines_that_say_something():
    assert _tail(b"a\n\n  \nKeyError: 'labels'\n", max_lines=1) == "KeyError: 'labels'"
    assert _tail(b"KeyError: 'labels'\n") == "KeyError: 'labels'"
