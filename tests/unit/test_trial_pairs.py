"""`mpadvise trial --pairs N`: fp32 and each stable candidate run again in N interleaved rounds,
and the speed-up is the paired figure with its interval, not one run of each. Fake runners, no
processes; the real command runs in tests/integration/test_trials.py."""

from __future__ import annotations

import io
import json
import math

import pytest
from rich.console import Console
from typer.testing import CliRunner

import advisor.cli._trial as trial_cli
from advisor.cli import app
from advisor.cli._trial import run_trial_command
from advisor.trial import TrialResult
from advisor.tune import TuneOptions, pairs_runs, run_comparison, run_pairs
from policies import Policy
from probes import HardwareProfile

CPU = HardwareProfile(kind="cpu", name="test cpu")
STEPS = 40
# Milliseconds per step of each mode, run by run: the machine's pace drifts between rounds,
# and each pair sees the drift alike (bf16-mixed stays 1.5x fp32 within 2%).
PACE = {"fp32": [10.0, 13.0, 9.0, 12.0, 11.0, 10.0], "bf16-mixed": [6.6, 8.8, 6.0, 8.0, 7.3, 6.7]}


def _result(policy: Policy, label: str, ms: float, *, losses: list[float] | None = None,
            threads: int | None = None) -> TrialResult:
    losses = losses or [2.0 * math.exp(-i / 20) for i in range(STEPS)]
    return TrialResult(
        outcome="ok", label=label, policy=policy.to_dict(), losses=tuple(losses), step_times=(ms / 1e3,) * STEPS,
        samples=(64,) * STEPS, skipped=(False,) * STEPS, warmup_steps=3, user_batch=64, global_batch=64,
        peak_memory=300 * 2**20, workload_fingerprint="ab" * 8, model_signature="cd" * 8, threads=threads)


class Runner:
    """Each mode runs at its pace of the round; ``nan_at`` gives a mode's run of that number (its
    comparison runs first) a NaN loss, ``threads_at`` a run of that number one thread."""

    def __init__(self, *, nan_at: dict[str, int] | None = None, threads_at: dict[str, int] | None = None) -> None:
        self.seed, self.measure_steps = 0, STEPS
        self.calls: list[str] = []
        self.runs = {mode: 0 for mode in PACE}
        self.nan_at, self.threads_at = nan_at or {}, threads_at or {}

    def perturbed(self, perturb: str, draw: int = 0) -> Runner:
        return self  # the replicate runs as fp32 does: same curve, no spread

    def __call__(self, policy: Policy, label: str) -> TrialResult:
        mode = policy.mode
        n = self.runs[mode]
        self.runs[mode] += 1
        self.calls.append(label)
        losses = None
        if self.nan_at.get(mode) == n:
            losses = [2.0] * (STEPS - 1) + [math.nan]
        threads = 1 if self.threads_at.get(mode) == n else None
        # The machine's pace in round k (the comparison's runs: round 0) holds for both modes.
        round_ = int(label.rpartition("(pair ")[2].rstrip(")")) if "(pair " in label else 0
        return _result(policy, label, PACE[mode][round_ % len(PACE[mode])], losses=losses, threads=threads)


def _compared(runner: Runner):
    return run_comparison(runner, [(Policy(mode="bf16-mixed"), "bf16-mixed")])


def test_rounds_alternate_and_the_speedup_is_paired_with_an_interval():
    runner = Runner()
    comparison = _compared(runner)
    runner.calls.clear()
    assert pairs_runs(comparison, 4) == 8
    (paired,) = run_pairs(runner, comparison, 4)
    assert runner.calls == ["fp32 (pair 1)", "bf16-mixed (pair 1)", "bf16-mixed (pair 2)", "fp32 (pair 2)",
                            "fp32 (pair 3)", "bf16-mixed (pair 3)", "bf16-mixed (pair 4)", "fp32 (pair 4)"]
    speedup = paired.speedup()
    assert speedup.pairs == 4 and not paired.dropped
    # The runs' own paces swing by 40% between rounds; paired, the figure stays near 1.5x.
    assert 1.45 < speedup.ratio < 1.56
    assert speedup.low is not None and speedup.high is not None and speedup.low < speedup.ratio < speedup.high
    assert speedup.high / speedup.low < 1.1


def test_a_candidate_unstable_in_a_round_leaves_the_rounds_with_the_reason():
    runner = Runner(nan_at={"bf16-mixed": 2})  # its comparison run and first pair are fine
    comparison = _compared(runner)
    (paired,) = run_pairs(runner, comparison, 4)
    assert paired.dropped.startswith("unstable in pair 2: bf16-mixed diverged: loss became NaN")
    assert paired.goodputs[1] is None and len(paired.goodputs) == 2
    assert runner.runs["bf16-mixed"] == 3  # the comparison's run, then two rounds: none after
    assert paired.speedup().pairs == 1 and paired.speedup().low is None


def test_no_stable_candidate_runs_no_round():
    runner = Runner(nan_at={"bf16-mixed": 0})
    comparison = _compared(runner)
    runner.calls.clear()
    assert pairs_runs(comparison, 3) == 0
    assert run_pairs(runner, comparison, 3) == [] and runner.calls == []


class FakeScriptRunner:
    def __init__(self, path, script_args, settings, *, launch=None, warm=None) -> None:
        self.runner = Runner()
        self.seed, self.measure_steps = 0, STEPS

    def perturbed(self, perturb: str, draw: int = 0):
        return self

    def __call__(self, policy, label):
        return self.runner(policy, label)


@pytest.fixture
def script(tmp_path, monkeypatch):
    monkeypatch.setattr(trial_cli, "ScriptRunner", FakeScriptRunner)
    monkeypatch.setattr(trial_cli.probes, "profile_for", lambda device=None: CPU)
    path = tmp_path / "train.py"
    path.write_text("import advisor\n")
    return path


def _run(script, *, pairs: int, json_output: bool) -> tuple[int, str]:
    out = io.StringIO()
    options = TuneOptions(modes=["bf16-mixed"], device="cpu")
    code = run_trial_command(script, [], options, plot=None, json_output=json_output,
                             console=Console(file=out, width=200), pairs=pairs)
    return code, out.getvalue()


def test_the_command_reports_the_paired_figure_in_json_and_text(script, capsys):
    code, _ = _run(script, pairs=3, json_output=True)
    printed = json.loads(capsys.readouterr().out)
    assert code == 0
    assert printed["pairs"]["rounds"] == 3
    (cand,) = printed["pairs"]["candidates"]
    assert cand["mode"] == "bf16-mixed" and cand["dropped"] is None and len(cand["goodputs"]) == 3
    speedup = cand["speedup_vs_fp32"]
    assert speedup["pairs"] == 3 and speedup["basis"].startswith("paired re-measurement, 3 pairs")
    assert speedup["low"] < speedup["ratio"] < speedup["high"]

    code, text = _run(script, pairs=3, json_output=False)
    assert code == 0
    assert "Paired with fp32 over 3 interleaved rounds:" in text
    assert f"bf16-mixed: {speedup['ratio']:.2f}x fp32, 95% interval" in text


def test_each_run_of_the_rounds_streams_as_it_finishes(script, tmp_path, capsys):
    stream = tmp_path / "trial.jsonl"
    out = io.StringIO()
    options = TuneOptions(modes=["bf16-mixed"], device="cpu")
    run_trial_command(script, [], options, plot=None, json_output=True, console=Console(file=out, width=200),
                      stream=trial_cli.TrialStream(stream), pairs=2)
    lines = [json.loads(line) for line in stream.read_text().splitlines()]
    assert [(ln.get("index"), ln.get("role"), ln.get("label")) for ln in lines[3:-1]] == [
        (3, "pair", "fp32 (pair 1)"), (4, "pair", "bf16-mixed (pair 1)"),
        (5, "pair", "bf16-mixed (pair 2)"), (6, "pair", "fp32 (pair 2)")]
    assert lines[-1]["event"] == "comparison" and lines[-1]["pairs"]["rounds"] == 2


def test_without_pairs_nothing_more_runs(script, capsys):
    code, _ = _run(script, pairs=0, json_output=True)
    assert code == 0 and json.loads(capsys.readouterr().out)["pairs"] is None


@pytest.mark.parametrize("value", ["-1", "51", "many"])
def test_a_bad_pairs_value_is_one_line_and_exit_2(tmp_path, value):
    path = tmp_path / "train.py"
    path.write_text("import advisor\n")
    result = CliRunner().invoke(app, ["trial", str(path), "--pairs", value])
    assert result.exit_code == 2
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and "--pairs" in lines[0] and "Traceback" not in result.output
