"""Trials of real scripts in subprocesses: every outcome class, and the stability verdicts on a
real stall (pure bf16) and a real NaN (pure fp16)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from advisor.tune._trials import ScriptRunner, TrialSettings, run_comparison
from policies import Policy
from probes._trial import TrialSpec, parse_memory, run_trial

SCRIPTS = Path(__file__).resolve().parent / "scripts"


def trial(tmp_path, script: str, *args: str, mode: str = "fp32", timeout: float = 120, **spec_fields):
    spec = TrialSpec(policy=Policy(mode=mode).to_dict(), result_path=str(tmp_path / "result.json"), **spec_fields)
    return run_trial(SCRIPTS / script, list(args), spec, timeout=timeout)


def test_ok_trial_records_every_step(tmp_path, isolated_home):
    result = trial(tmp_path, "tiny_ok.py", warmup_steps=2, measure_steps=10)
    assert result.outcome == "ok", result.reason + result.stderr_tail
    assert len(result.losses) == len(result.step_times) == len(result.skipped) == 12
    assert all(t > 0 for t in result.step_times)
    assert result.user_batch == 32 and result.global_batch == 32 and set(result.samples) == {32}
    assert result.peak_memory and result.peak_memory > 10 * 2**20 and result.memory_kind == "cpu-peak-rss"
    assert result.workload_fingerprint and result.model_signature


def test_same_seed_gives_identical_fp32_curves(tmp_path, isolated_home):
    a = trial(tmp_path, "tiny_ok.py", warmup_steps=1, measure_steps=8, seed=3)
    b = trial(tmp_path, "tiny_ok.py", warmup_steps=1, measure_steps=8, seed=3)
    assert a.losses == b.losses


def test_fp16_mixed_records_scale_and_underflow(tmp_path, isolated_home):
    result = trial(tmp_path, "tiny_ok.py", mode="fp16-mixed", warmup_steps=1, measure_steps=6)
    assert result.outcome == "ok"
    assert all(s is not None and s > 0 for s in result.loss_scale)
    assert all(u is None or 0.0 <= u <= 1.0 for u in result.underflow)
    assert any(u is not None for u in result.underflow)


@pytest.mark.parametrize(
    ("script", "args", "fields", "outcome", "needle"),
    [
        ("syntax_error.py", [], {}, "no-policy", "SyntaxError"),
        ("fails_before_policy.py", [], {}, "no-policy", "cannot open the data set"),
        ("never_loads_policy.py", [], {}, "no-policy", "without calling advisor.load_policy()"),
        ("no_step_loop.py", [], {"no_step_timeout": 3.0}, "no-step", "never called step() within 3 s"),
        ("ends_without_step.py", [], {}, "no-step", "ended without calling step()"),
        ("crashes_midway.py", [], {}, "crash", "KeyError"),
        ("crashes_midway.py", ["segv"], {}, "crash", "SIGSEGV"),
        ("cpu_oom.py", [], {}, "oom", "out of memory"),
        ("tiny_ok.py", [], {"memory_limit": 8 * 2**20, "measure_steps": 5}, "oom", "exceeds the limit 8 MiB"),
    ],
)
def test_outcome_classes(tmp_path, isolated_home, script, args, fields, outcome, needle):
    result = trial(tmp_path, script, *args, **fields)
    assert result.outcome == outcome, (result.outcome, result.reason, result.stderr_tail)
    assert needle in result.reason
    if outcome in ("crash", "no-policy") and script != "never_loads_policy.py":
        assert result.stderr_tail  # the tail of stderr travels with the outcome


def test_hanging_script_times_out(tmp_path, isolated_home):
    result = trial(tmp_path, "hangs.py", timeout=12)
    assert result.outcome == "timeout"
    assert "no result within 12 s" in result.reason


def test_mode_the_hardware_lacks_is_unsupported(tmp_path, isolated_home):
    result = trial(tmp_path, "tiny_ok.py", mode="fp8-te")
    assert result.outcome == "unsupported"
    assert "fp8-te cannot run on" in result.reason


def test_parse_memory():
    assert parse_memory("4GiB") == 4 * 2**30
    assert parse_memory("512MiB") == 512 * 2**20
    assert parse_memory("2G") == 2 * 10**9
    assert parse_memory("1500") == 1500


@pytest.mark.slow
def test_real_stall_and_real_nan_at_small_learning_rate(isolated_home):
    """AdamW at lr 1e-5: pure bf16 stalls and pure fp16 gives NaN; the mixed modes track fp32."""
    runner = ScriptRunner(SCRIPTS / "regression_small_lr.py", [], TrialSettings(warmup_steps=5, measure_steps=295))
    modes = ["bf16-mixed", "fp16-mixed", "bf16-true", "fp16-true"]
    reference, evaluations = run_comparison(runner, [(Policy(mode=m), m) for m in modes])
    by_mode = {ev.label: ev for ev in evaluations}
    assert reference.result.losses[-1] < 0.6 * reference.result.losses[0]
    assert by_mode["bf16-mixed"].verdict.kind == "ok"
    assert by_mode["fp16-mixed"].verdict.kind == "ok"
    stall = by_mode["bf16-true"].verdict
    assert stall.kind == "stalled" and "use bf16-mixed" in stall.reason
    assert stall.metrics["progress_ratio"] < 0.5
    nan = by_mode["fp16-true"].verdict
    assert nan.kind == "diverged" and "NaN" in nan.reason


# ---- the CLI: bad input gets one clear line and a documented exit code ------------------------


def _one_line_error(proc) -> str:
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, proc.stderr
    return lines[0]


@pytest.mark.parametrize(
    ("args", "code", "needle"),
    [
        (["trial", "no/such/train.py"], 1, "script no/such/train.py does not exist"),
        (["trial", str(SCRIPTS / "syntax_error.py")], 1, "has a syntax error at line 3"),
        (["trial", str(SCRIPTS / "tiny_ok.py"), "--mode", "fp64"], 2, "unknown mode 'fp64'"),
        (["trial", str(SCRIPTS / "tiny_ok.py"), "--mode", "tf32"], 1, "available here: fp32"),
        (["trial", str(SCRIPTS / "tiny_ok.py"), "--memory-limit", "lots"], 1, "is not a size"),
        (["trial", str(SCRIPTS / "crashes_midway.py"), "--mode", "bf16-mixed"], 1, "the fp32 reference trial failed (crash)"),
        (["trial", str(SCRIPTS / "ends_without_step.py"), "--mode", "bf16-mixed"], 1, "ended without calling step()"),
        (["trial", str(SCRIPTS / "diverges_fp32.py"), "--mode", "bf16-mixed"], 1, "no verdict is possible: the fp32 reference itself is not finite"),
    ],
)
def test_cli_bad_input(args, code, needle, isolated_home, cli):
    proc = cli(*args)
    assert proc.returncode == code, proc.stderr
    assert needle in _one_line_error(proc)


def test_cli_trial_table_json_and_plot(tmp_path, isolated_home, cli):
    plot = tmp_path / "curves.png"
    proc = cli("trial", str(SCRIPTS / "tiny_ok.py"), "--mode", "bf16-mixed", "--steps", "32", "--warmup", "2",
                   "--json", "--plot", str(plot), "--", "60")
    assert proc.returncode in (0, 3), proc.stderr
    payload = json.loads(proc.stdout)
    assert payload["reference"]["mode"] == "fp32"
    (cand,) = payload["candidates"]
    assert cand["mode"] == "bf16-mixed" and cand["steps"] == 34
    assert cand["outcome"] in ("ok", "unstable") and cand["speedup_vs_fp32"] > 0
    assert plot.stat().st_size > 10_000 and plot.read_bytes()[:4] == b"\x89PNG"
