"""Trials of real scripts in subprocesses: every outcome class, and the stability verdicts on a
real stall (pure bf16), a real NaN (pure fp16), a real loss floor (every bf16 mode, where fp32
drives the loss towards zero) and a small, noisy fall that stays within fp32's own spread."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from advisor.trial import TrialSpec, parse_memory, run_trial
from advisor.tune._run import ScriptRunner, TrialSettings
from advisor.tune._trials import run_comparison
from policies import Policy

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
        ("no_step_loop.py", [], {"first_step_timeout": 3.0}, "no-step", "never called step() within 3 s of the policy's application"),
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
    reference, evaluations, replicate, *_ = run_comparison(runner, [(Policy(mode=m), m) for m in modes])
    by_mode = {ev.label: ev for ev in evaluations}
    assert reference.result.losses[-1] < 0.6 * reference.result.losses[0]
    assert replicate is not None and replicate.curve is not None  # the spread widened the limits
    assert "progress_limit" in reference.verdict.metrics
    assert by_mode["bf16-mixed"].verdict.kind == "ok"
    assert by_mode["fp16-mixed"].verdict.kind == "ok"
    stall = by_mode["bf16-true"].verdict
    assert stall.kind == "stalled" and "use bf16-mixed" in stall.reason
    assert stall.metrics["progress_ratio"] < 0.5
    nan = by_mode["fp16-true"].verdict
    assert nan.kind == "diverged" and "NaN" in nan.reason


def test_real_loss_floor_in_every_bf16_mode(isolated_home):
    """fp32 drives a noiseless regression's loss down eight orders of magnitude; bf16 rounds each
    prediction to 8 significant bits, so bf16-mixed and pure bf16 stop thousands of times above."""
    runner = ScriptRunner(SCRIPTS / "regression_to_zero.py", [], TrialSettings(warmup_steps=5, measure_steps=200))
    modes = ["bf16-mixed", "bf16-true"]
    reference, evaluations, replicate, *_ = run_comparison(runner, [(Policy(mode=m), m) for m in modes])
    ref = reference.verdict.metrics
    assert ref["reference_end"] < 1e-6 * ref["reference_start"]  # fp32 heads towards zero
    assert replicate is not None and replicate.seed == 0 and replicate.perturb == "bf16"
    assert ref["replicate_end"] < 1e-6 * ref["reference_start"]  # ... perturbed by one rounding too
    for ev in evaluations:
        verdict = ev.verdict
        assert verdict.kind == "stalled", verdict.reason
        assert verdict.metrics["progress_ratio"] > 0.9  # the fall alone hides the floor
        assert verdict.metrics["final_gap"] > 100 * verdict.metrics["final_gap_limit"]
        assert "times as high" in verdict.reason


# At seed 0 fp32's loss falls 4% and where a run ends is chaotic. On a 2-core Xeon with AMX-BF16
# (torch 2.13.0+cpu), five draws of the replicate's perturbation fell 89% to 104% as far as fp32
# (differing by 3.6%, 11.1%, 6.9%, 4.2% and 3.3%), while bf16-mixed fell 85.7% as far and fp16-mixed
# 120%: a mode that rounds at every step strays more than fp32 perturbed once. Against the 90%
# floor and twice a draw's spread, bf16-mixed is stable only against a draw of 7.2% or more (there,
# the second); on another machine both draws came out below that and it was judged stalled. What
# must hold on any machine: fp16-mixed, which strays upwards, is stable; bf16-mixed is stable, or
# a stall judged again against the second draw, never on one draw alone; and both keep fp32's level.
def test_small_noisy_fall_within_the_spread_stays_stable(isolated_home):
    """Labels that are 40% noise: fp32's loss falls a few percent, noisily. The mixed modes track
    fp32 (the replicate, perturbed by one rounding, shows how closely; a second one where a mode
    falls just short of the first's limits)."""
    runner = ScriptRunner(SCRIPTS / "noisy_small_drop.py", [], TrialSettings(warmup_steps=5, measure_steps=200))
    modes = ["bf16-mixed", "fp16-mixed"]
    reference, evaluations, replicate, *_ = run_comparison(runner, [(Policy(mode=m), m) for m in modes])
    ref = reference.verdict.metrics
    assert replicate is not None and replicate.curve is not None
    assert ref["reference_drop"] < 0.1  # a small fall
    assert "progress_spread" in ref and not replicate.identical  # the perturbation reached the weights
    by_mode = {ev.label: ev for ev in evaluations}
    assert by_mode["fp16-mixed"].verdict.kind == "ok", by_mode["fp16-mixed"].verdict.reason
    bf16 = by_mode["bf16-mixed"].verdict
    assert bf16.kind == "ok" or (bf16.kind == "stalled" and bf16.metrics["replicates"] == 2), bf16.reason
    for ev in evaluations:
        assert abs(ev.verdict.metrics["final_gap"]) < ref["final_gap_limit"]


# ---- the CLI: bad input gets one clear line and a documented exit code ------------------------


def _one_line_error(proc) -> str:
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, proc.stderr
    return lines[0]


@pytest.mark.parametrize(
    ("args", "code", "needle"),
    [
        (["trial", "no/such/train.py"], 2, "script no/such/train.py does not exist"),
        (["trial", str(SCRIPTS / "syntax_error.py")], 1, "has a syntax error at line 3"),
        (["trial", str(SCRIPTS / "tiny_ok.py"), "--mode", "fp64"], 2, "unknown mode 'fp64'"),
        (["trial", str(SCRIPTS / "tiny_ok.py"), "--mode", "tf32"], 1, "available here: fp32"),
        (["trial", str(SCRIPTS / "tiny_ok.py"), "--memory-limit", "lots"], 2, "is not a size"),
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
    assert payload["replicate"]["seed"] == 0 and payload["replicate"]["perturb"] == "bf16"
    assert len(payload["replicate"]["losses"]) == 34 and not payload["replicate"]["identical"]
    (cand,) = payload["candidates"]
    assert cand["mode"] == "bf16-mixed" and cand["steps"] == 34
    assert cand["outcome"] in ("ok", "unstable") and cand["speedup_vs_fp32"] > 0
    assert plot.stat().st_size > 10_000 and plot.read_bytes()[:4] == b"\x89PNG"


def test_cli_trial_pairs_gives_a_paired_speedup(isolated_home, cli):
    proc = cli("trial", str(SCRIPTS / "tiny_ok.py"), "--mode", "bf16-mixed", "--steps", "32", "--warmup", "2",
               "--pairs", "2", "--json", "--", "60")
    assert proc.returncode in (0, 3), proc.stderr
    payload = json.loads(proc.stdout)
    assert payload["pairs"]["rounds"] == 2
    (cand,) = payload["candidates"]
    if not cand["stable"]:  # nothing to pair: nothing more ran
        assert payload["pairs"]["candidates"] == []
        return
    (paired,) = payload["pairs"]["candidates"]
    assert paired["mode"] == "bf16-mixed" and len(paired["goodputs"]) == len(paired["fp32_goodputs"]) == 2
    if paired["dropped"] is None and None not in paired["goodputs"] + paired["fp32_goodputs"]:
        speedup = paired["speedup_vs_fp32"]
        assert speedup["pairs"] == 2 and 0 < speedup["low"] <= speedup["ratio"] <= speedup["high"]


# ---- the kernel's OOM killer ---------------------------------------------------------------------

OOM_CGROUP_LIMIT = 1 * 2**30


@pytest.fixture
def memory_cgroup():
    """A child of this process's memory cgroup, limited to 1 GiB; skips where none can be made."""
    import os
    import time

    from advisor.trial._launch import memory_cgroup_dirs

    try:
        dirs = memory_cgroup_dirs(Path("/proc/self/cgroup").read_text(), Path("/proc/self/mountinfo").read_text())
    except OSError as exc:
        pytest.skip(f"no /proc/self/cgroup to find a memory cgroup in ({exc})")
    for version, parent in dirs:
        limit_file = "memory.max" if version == 2 else "memory.limit_in_bytes"
        if not (parent / "cgroup.procs").exists():
            continue
        path = parent / f"mpadvise-oom-test-{os.getpid()}"
        try:
            path.mkdir()
        except OSError:
            continue
        try:
            (path / limit_file).write_text(str(OOM_CGROUP_LIMIT))
            if int((path / limit_file).read_text().split()[0]) != OOM_CGROUP_LIMIT:
                raise OSError(f"{limit_file} did not take the limit")
            if version == 2 and (path / "memory.swap.max").exists():
                (path / "memory.swap.max").write_text("0")  # killed, not swapped out
        except (OSError, ValueError):
            path.rmdir()
            continue
        yield path
        for _ in range(50):  # the killed child leaves the cgroup a moment after it is reaped
            try:
                path.rmdir()
                break
            except OSError:
                time.sleep(0.1)
        return
    pytest.skip("cannot create a memory cgroup with a limit here (no write access, or no memory controller)")


def test_oom_killer_is_oom(tmp_path, isolated_home, memory_cgroup):
    """A trial killed by the kernel's OOM killer (its cgroup over memory.max) is ``oom``."""
    import subprocess
    import sys

    # run_trial itself runs in the small cgroup, so the child starts there and the counter it
    # reads is that cgroup's; the child (over 1 GiB) is the one the kernel picks.
    runner = (
        "import json, sys\n"
        "from advisor.trial import TrialSpec, run_trial\n"
        "spec = TrialSpec(policy=json.loads(sys.argv[1]), result_path=sys.argv[2], warmup_steps=0, measure_steps=100)\n"
        "r = run_trial(sys.argv[3], [], spec, timeout=240)\n"
        "print(json.dumps({'outcome': r.outcome, 'reason': r.reason, 'exit_code': r.exit_code}))\n"
    )
    policy = json.dumps(Policy(mode="fp32").to_dict())
    proc = subprocess.run(
        ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(memory_cgroup / "cgroup.procs"),
         sys.executable, "-c", runner, policy, str(tmp_path / "result.json"), str(SCRIPTS / "oom_killed.py")],
        capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[2],
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["exit_code"] == -9, result
    assert result["outcome"] == "oom", result
    assert "OOM killer" in result["reason"]
