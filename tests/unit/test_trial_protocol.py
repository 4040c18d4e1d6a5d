"""The trial protocol's one schema: the stages, the result file's declared fields, and the
spec, each rejecting what it does not declare."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest

from advisor.trial import (
    RESULT_FIELDS,
    FrameworkRecorder,
    ResultWriter,
    Stage,
    TrialResult,
    TrialSpec,
    _timeline,
    classify,
)
from advisor.trial._child import TrialRecorder
from advisor.trial._step_window import result_payload
from probes import MpadviseError

SPEC = TrialSpec(policy={"schema": 1, "mode": "fp32"}, result_path="unused.json", warmup_steps=1, measure_steps=2)
# What the parent sets on a TrialResult itself, beside what the result file carries.
PARENT_FIELDS = {"outcome", "reason", "label", "policy", "exit_code", "stderr_tail", "wall_s", "threads"}


def judge(data, *, exit_code=0):
    return classify(data, exit_code=exit_code, timed_out=False, stderr_tail="", spec=SPEC, timeout=60.0)


def done(**changes):
    data = {"stage": "done", "complete": True, "losses": [1.0, 0.9, 0.8], "step_times": [0.1, 0.1, 0.1],
            "loss_scale": [None] * 3, "skipped": [False] * 3, "underflow": [None] * 3, "samples": [8] * 3,
            "warmup_steps": 1, "peak_memory": 100, "memory_kind": "cpu-peak-rss", "notes": [], "fsdp": False}
    data.update(changes)
    return data


def test_a_stage_is_written_as_its_plain_string() -> None:
    assert json.dumps({"stage": Stage.NO_STEP}) == '{"stage": "no-step"}'
    assert f"{Stage.DONE}" == str(Stage.DONE) == "done"
    assert Stage("stepping") is Stage.STEPPING


def test_a_finished_result_is_ok() -> None:
    result = judge(done())
    assert result.outcome == "ok" and result.losses == (1.0, 0.9, 0.8)


def test_a_result_with_an_unknown_field_is_a_crash_that_names_it() -> None:
    result = judge(done(step_time_ms=[100, 100, 100]))
    assert result.outcome == "crash"
    assert "step_time_ms" in result.reason and "RESULT_FIELDS" in result.reason
    assert result.label == SPEC.label and result.policy == SPEC.policy


def test_a_script_that_ends_after_load_policy_never_stepped() -> None:
    assert judge({"stage": "loaded", "pid": 1}).outcome == "no-step"


def test_every_field_the_result_keeps_is_a_trial_result_field() -> None:
    names = {f.name for f in dataclasses.fields(TrialResult)}
    kept = {f.name for f in RESULT_FIELDS if f.kept}
    assert kept <= names
    assert names - kept == PARENT_FIELDS
    assert len({f.name for f in RESULT_FIELDS}) == len(RESULT_FIELDS)


def test_a_trial_result_reads_back_what_it_wrote() -> None:
    result = TrialResult(outcome="ok", losses=(float("nan"),))
    assert TrialResult.from_dict(result.to_dict()).outcome == "ok"


def test_the_writer_refuses_an_undeclared_field(tmp_path) -> None:
    _timeline.clear()  # marks an earlier test's recorder took in this process are not this file's
    writer = ResultWriter(str(tmp_path / "result.json"))
    writer.write(stage=Stage.LOADED, pid=1)
    with pytest.raises(ValueError, match="losss"):
        writer.write(losss=[1.0])
    assert json.loads((tmp_path / "result.json").read_text()) == {"stage": "loaded", "pid": 1, "timeline": {}}


def test_the_spec_refuses_an_unknown_field() -> None:
    text = json.dumps({**json.loads(SPEC.to_json()), "warmup": 3})
    with pytest.raises(MpadviseError, match="warmup"):
        TrialSpec.from_json(text)
    assert TrialSpec.from_json(SPEC.to_json()) == SPEC


def _framework_recorder(tmp_path) -> FrameworkRecorder:
    recorder = FrameworkRecorder(SPEC, ResultWriter(str(tmp_path / "framework.json")))
    recorder.begin(user_batch=8, micro_batch=8, grad_accum_steps=1)
    recorder.workload_fingerprint, recorder.model_signature = "ab" * 8, "cd" * 8
    recorder.marks[:] = [0.0]  # begin() marked the host clock; the test's marks are its own
    return recorder


def _loop_recorder(tmp_path) -> TrialRecorder:
    recorder = TrialRecorder(SPEC, ResultWriter(str(tmp_path / "loop.json")))
    recorder.applied = SimpleNamespace(
        notes=["kept the head in fp32"], workload_fingerprint="ab" * 8, model_signature="cd" * 8, fsdp=False,
        user_batch=8, policy=SimpleNamespace(micro_batch_size=None), grad_accum_steps=1, global_batch=8,
        device="cpu",
    )
    recorder.marks.append(0.0)
    return recorder


@pytest.mark.parametrize("make", [_framework_recorder, _loop_recorder])
def test_both_recorders_write_the_declared_payload(tmp_path, make) -> None:
    recorder = make(tmp_path)
    for step, loss in enumerate([1.0, float("nan")], start=1):
        recorder.losses.append(loss)
        recorder.loss_scale.append(None)
        recorder.skipped.append(False)
        recorder.samples.append(8)
        if isinstance(recorder, TrialRecorder):
            recorder.underflow.append(None)
            recorder.pauses.append(None)
        recorder.marks.append(0.1 * step)
    payload = result_payload(recorder, complete=False)
    assert payload["stage"] == Stage.DONE and payload["complete"] is False
    assert payload["losses"] == [1.0, "nan"] and payload["underflow"] == [None, None]
    assert payload["step_times"] == pytest.approx([0.1, 0.1])
    assert payload["global_batch"] == 8 and payload["device"] == "cpu"
    assert set(payload) == {f.name for f in RESULT_FIELDS} - {"pid", "reason", "exception", "ranks", "rank_progress", "rank_waiting", "timeline"}  # timeline: the writer adds it to every write
    assert judge(json.loads(json.dumps(payload))).outcome == "ok"


def test_a_policy_refused_once_training_began_ends_unsupported_not_crashed(tmp_path) -> None:
    """A mode that finds mid-run that it cannot run here (TE's delayed recipe inside a compiled
    step) raises UnsupportedHere: the trial is unsupported, with the mode's own reason."""
    import subprocess
    import sys

    from advisor.trial import run_in_process
    from policies import Policy
    from probes import HardwareProfile, UnsupportedHere

    def train(mp):
        raise UnsupportedHere("fp8-te's delayed recipe cannot run inside torch.compile; set recipe = \"current\"")

    spec = TrialSpec(policy=Policy(mode="fp32").to_dict(), result_path=str(tmp_path / "r.json"), device="cpu")
    data, error = run_in_process(train, spec, profile=HardwareProfile(kind="cpu", name="cpu", cores=2))
    assert error is None
    assert judge(data).outcome == "unsupported" and "torch.compile" in judge(data).reason

    # In a child process the excepthook writes the same stage.
    result = tmp_path / "child.json"
    code = (
        "import sys\n"
        "from advisor.trial import ResultWriter, install_excepthook\n"
        "from probes import UnsupportedHere\n"
        f"install_excepthook(ResultWriter({str(result)!r}))\n"
        "raise UnsupportedHere('not here')\n"
    )
    subprocess.run([sys.executable, "-c", code], capture_output=True, check=False)
    written = json.loads(result.read_text())
    assert written["stage"] == "unsupported" and written["reason"] == "not here"
