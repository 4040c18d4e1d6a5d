"""`mpadvise trial` streams each finished trial to MPADVISE_TRIAL_STREAM as one JSON line, so a
run stopped part-way keeps every verdict reached; `--json`'s own output is unchanged."""

from __future__ import annotations

import io
import json
import math

import pytest
from rich.console import Console

import advisor.cli._trial as trial_cli
from advisor.cli._trial import STREAM_ENV, TrialStream, run_trial_command
from advisor.trial import TrialResult
from advisor.tune import TuneOptions
from probes import HardwareProfile, MpadviseError, UsageError

CPU = HardwareProfile(kind="cpu", name="test cpu")


def _result(policy, label: str) -> TrialResult:
    steps = 40
    losses = [2.0 * math.exp(-i / 20) for i in range(steps)]
    ms = {"fp32": 10.0, "bf16-mixed": 6.0}.get(policy.mode, 8.0)
    return TrialResult(
        outcome="ok", label=label, policy=policy.to_dict(), losses=tuple(losses), step_times=(ms / 1e3,) * steps,
        samples=(64,) * steps, skipped=(False,) * steps, warmup_steps=3, user_batch=64, global_batch=64,
        peak_memory=300 * 2**20, workload_fingerprint="ab" * 8, model_signature="cd" * 8,
    )


class FakeRunner:
    """Stands in for ScriptRunner: every trial returns at once; ``stop_at`` interrupts one."""

    stop_at: str | None = None
    ran: list[str] = []

    def __init__(self, path, script_args, settings, *, launch=None, warm=None) -> None:
        pass

    def __call__(self, policy, label):
        FakeRunner.ran.append(label)
        if label == FakeRunner.stop_at:
            raise KeyboardInterrupt  # Ctrl-C, or the wrapper's SIGINT, while this trial runs
        return _result(policy, label)


@pytest.fixture
def script(tmp_path, monkeypatch):
    monkeypatch.setattr(trial_cli, "ScriptRunner", FakeRunner)
    monkeypatch.setattr(trial_cli.probes, "profile_for", lambda device=None: CPU)
    FakeRunner.stop_at, FakeRunner.ran = None, []
    path = tmp_path / "train.py"
    path.write_text("import advisor\n")
    return path


def _run(script, stream_path=None, json_output=True):
    out = io.StringIO()
    console = Console(file=out, width=200)
    stream = None if stream_path is None else TrialStream(stream_path)
    options = TuneOptions(modes=["bf16-mixed", "bf16-true"], device="cpu")
    code = run_trial_command(script, [], options, plot=None, json_output=json_output, console=console, stream=stream)
    return code, out.getvalue()


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_each_trial_is_one_line_as_it_finishes_then_the_comparison(script, tmp_path, capsys):
    stream = tmp_path / "trial.jsonl"
    code, _ = _run(script, stream)
    printed = json.loads(capsys.readouterr().out)  # --json: still one document
    lines = _lines(stream)
    assert code == 0
    assert [line["event"] for line in lines] == ["trial"] * 3 + ["comparison"]
    assert [(line["index"], line["role"], line["mode"]) for line in lines[:3]] == [
        (0, "reference", "fp32"), (1, "candidate", "bf16-mixed"), (2, "candidate", "bf16-true")]
    assert lines[1]["step_time"]["median"] == pytest.approx(0.006) and lines[1]["outcome"] == "ok"
    comparison = {k: v for k, v in lines[-1].items() if k != "event"}
    assert comparison == json.loads(json.dumps(printed, default=str))
    assert [c["mode"] for c in printed["candidates"]] == ["bf16-mixed", "bf16-true"]


def test_a_run_stopped_in_a_trial_keeps_every_trial_finished_before_it(script, tmp_path):
    stream = tmp_path / "trial.jsonl"
    FakeRunner.stop_at = "bf16-true"
    with pytest.raises(KeyboardInterrupt):
        _run(script, stream)
    lines = _lines(stream)
    assert [(line["event"], line["mode"]) for line in lines] == [("trial", "fp32"), ("trial", "bf16-mixed")]
    assert lines[1]["stable"] is True


def test_the_stream_comes_from_the_environment_and_appends(script, tmp_path, monkeypatch):
    stream = tmp_path / "trial.jsonl"
    stream.write_text('{"event": "earlier"}\n')
    monkeypatch.setenv(STREAM_ENV, str(stream))
    _run(script, json_output=False)
    events = [line["event"] for line in _lines(stream)]
    assert events == ["earlier", "trial", "trial", "trial", "comparison"]


def test_without_the_variable_nothing_is_written(script, tmp_path, monkeypatch):
    monkeypatch.delenv(STREAM_ENV, raising=False)
    code, text = _run(script, json_output=False)
    assert code == 0 and "bf16-true" in text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train.py"]


def test_an_unwritable_stream_fails_before_any_trial_runs(script, tmp_path):
    # Named by --stream: a bad option value (exit 2), and the message names the flag.
    target = tmp_path / "missing" / "trial.jsonl"
    with pytest.raises(UsageError) as refused:
        _run(script, target)
    assert str(refused.value).startswith(f"--stream {target}: cannot write there")
    assert STREAM_ENV not in str(refused.value)
    assert FakeRunner.ran == []


def test_an_unwritable_stream_from_the_environment_names_the_variable(script, tmp_path, monkeypatch):
    # Named by the environment, not the command line: an error of this run (exit 1).
    monkeypatch.setenv(STREAM_ENV, str(tmp_path / "missing" / "trial.jsonl"))
    with pytest.raises(MpadviseError, match=f"^{STREAM_ENV}=.*cannot write there.*or unset it$") as refused:
        _run(script)
    assert not isinstance(refused.value, UsageError)
    assert FakeRunner.ran == []
