"""Plain PyTorch scripts, unmodified, under ``mpadvise trial``, ``tune``, ``run`` and ``export``.

The three plain examples (their own autocast, GradScaler and ``dtype`` variable; no precision
code; updates by hand without an optimizer) run through the plain-torch adapter. What the
script prints is compared with what the trial records, and what ran inside the model's forward
is observed by a probe of the test's own: a script that registers a forward pre-hook on every
``nn.Linear`` (after the adapter's hooks, so inside the candidate's forward context), writes
what it sees on the first training forward, then runs the example as ``__main__``.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from advisor.frameworks import plan_for
from advisor.trial import TRIAL_SPEC_ENV, TrialSpec, run_trial, trial_environment
from policies import Policy

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
SCRIPTS = Path(__file__).resolve().parent / "scripts"
LOSS_LINE = re.compile(r"^(?:iter|step) (\d+):? loss ([-+0-9.eE]+|nan|inf)$", re.MULTILINE)

PROBE = """
import json, runpy, sys, torch
from torch.nn.modules.module import register_module_forward_pre_hook
seen = {}
def probe(module, args):
    if torch.is_grad_enabled() and not seen and isinstance(module, torch.nn.Linear):
        seen.update(autocast=torch.is_autocast_enabled("cpu"), dtype=str(torch.get_autocast_dtype("cpu")),
                    weight=str(module.weight.dtype), input=str(args[0].dtype))
        open(OUT, "w").write(json.dumps(seen))
register_module_forward_pre_hook(probe)
sys.argv = [EXAMPLE, *sys.argv[1:]]
runpy.run_path(EXAMPLE, run_name="__main__")
"""


def child(tmp: Path, script: Path, mode: str, *args: str, **fields) -> tuple[dict, str, str]:
    """One trial child of ``script`` under ``mode`` through its plan's launch: the result file,
    the script's stdout and stderr."""
    spec = TrialSpec(policy=Policy(mode=mode).to_dict(), result_path=str(tmp / f"{mode}.json"), warmup_steps=2,
                     measure_steps=6, framework="torch", **fields)
    spec_file = tmp / f"{mode}.spec.json"
    spec_file.write_text(spec.to_json())
    env = trial_environment(None)
    env[TRIAL_SPEC_ENV] = str(spec_file)
    env["OMP_NUM_THREADS"] = "1"
    launch = plan_for(script).launch
    proc = subprocess.run([sys.executable, *launch, str(script), *args], env=env, capture_output=True, text=True,
                          timeout=300, cwd=tmp)
    return json.loads(Path(spec.result_path).read_text()), proc.stdout, proc.stderr


def probed(tmp: Path, example: Path, mode: str, *args: str, **fields) -> tuple[dict, dict]:
    """The trial's result and what the probe saw inside the first training forward."""
    out = tmp / f"seen-{mode}.json"
    probe = tmp / f"probe_{example.stem}.py"
    probe.write_text(f"OUT = {str(out)!r}\nEXAMPLE = {str(example)!r}\n" + PROBE)
    result, _, stderr = child(tmp, probe, mode, *args, **fields)
    assert result["stage"] == "done", (result, stderr[-2000:])
    return result, json.loads(out.read_text())


def printed(stdout: str) -> dict[int, float]:
    return {int(step): float(value) for step, value in LOSS_LINE.findall(stdout)}


# fp16-mixed is not expressible without an optimizer: test_fp16_mixed_without_a_scaler_or_an_optimizer.
@pytest.mark.parametrize(("example", "mode"), [
    (example, mode) for example in ("plain_gpt.py", "plain_mlp.py", "plain_manual.py")
    for mode in ("fp32", "bf16-mixed", "fp16-mixed") if (example, mode) != ("plain_manual.py", "fp16-mixed")])
def test_the_recorded_loss_is_what_the_script_prints(tmp_path, example, mode):
    script = tmp_path / example
    shutil.copy(EXAMPLES / example, script)  # unmodified, and its plan is read from it
    assert plan_for(script).framework == "torch"
    result, stdout, stderr = child(tmp_path, script, mode)
    assert result["stage"] == "done", (result, stderr[-2000:])
    losses, shown = result["losses"], printed(stdout)
    common = [step for step in range(len(losses)) if step in shown]
    # The window ends the script inside its last step, before it prints that step's loss.
    assert len(common) >= len(losses) - 1 >= 7, (len(losses), sorted(shown)[:10])
    for step in common:
        assert losses[step] == pytest.approx(shown[step], rel=1e-5, abs=1e-6), (step, losses[step], shown[step])
    assert all(s == result["samples"][0] for s in result["samples"])


def test_the_candidates_autocast_runs_inside_the_forward_over_the_scripts_own(tmp_path):
    # The script asks for fp16 autocast and an enabled GradScaler; fp32 runs with neither.
    fp32, seen = probed(tmp_path, EXAMPLES / "plain_gpt.py", "fp32", "--dtype=float16")
    assert seen["autocast"] is False and seen["weight"] == "torch.float32"
    assert all(scale is None for scale in fp32["loss_scale"])
    assert any("--dtype (given float16)" in note and "--dtype=float32" in note for note in fp32["notes"]), fp32["notes"]
    # The script asks for fp32 (no autocast, a disabled GradScaler); fp16-mixed runs with both.
    fp16, seen = probed(tmp_path, EXAMPLES / "plain_gpt.py", "fp16-mixed", "--dtype=float32")
    assert seen["autocast"] is True and seen["dtype"] == "torch.float16" and seen["weight"] == "torch.float32"
    assert fp16["loss_scale"][0] == 65536.0
    bf16, seen = probed(tmp_path, EXAMPLES / "plain_mlp.py", "bf16-mixed")
    assert seen["autocast"] is True and seen["dtype"] == "torch.bfloat16"


@pytest.mark.parametrize("example", ["plain_gpt.py", "plain_mlp.py", "plain_manual.py"])
def test_pure_bf16_casts_the_parameters_and_the_floating_inputs(tmp_path, example):
    result, seen = probed(tmp_path, EXAMPLES / example, "bf16-true")
    assert seen["weight"] == "torch.bfloat16" and seen["input"] == "torch.bfloat16" and seen["autocast"] is False
    assert all(math.isfinite(v) for v in result["losses"])


def test_fp8_swaps_the_linear_layers_the_scripts_optimizer_then_trains(tmp_path):
    # torchao's Float8Linear takes each Linear's place at the first training forward and keeps
    # its Parameter, which the optimizer the script built before that forward still holds.
    out = tmp_path / "fp8.json"
    probe = tmp_path / "probe_fp8.py"
    probe.write_text(f"OUT = {str(out)!r}\nEXAMPLE = {str(EXAMPLES / 'plain_mlp.py')!r}\n"
                     + PROBE.replace("input=str(args[0].dtype)", "input=str(args[0].dtype), kind=type(module).__name__"))
    fp8, _, stderr = child(tmp_path, probe, "fp8-torchao", "--epochs", "3")
    assert fp8["stage"] == "done", stderr[-2000:]
    assert json.loads(out.read_text())["kind"] == "Float8Linear"
    assert "fp8-torchao: emulated on CPU (FP8 numerics, no speedup)" in fp8["notes"]
    assert any("kept in high precision" in note and "256->10" in note for note in fp8["notes"]), fp8["notes"]
    fp32, _, _ = child(tmp_path, EXAMPLES / "plain_mlp.py", "fp32", "--epochs", "3")
    assert fp8["losses"][-1] < fp8["losses"][0]  # the optimizer steps the swapped layers' weights
    assert fp8["losses"][1:] != fp32["losses"][1:]  # in FP8's numerics, not fp32's
    assert fp8["losses"][-1] == pytest.approx(fp32["losses"][-1], rel=0.05)


def test_a_compiled_model_runs_each_candidate(tmp_path):
    script = SCRIPTS / "plain_compiled.py"
    runs = {mode: child(tmp_path, script, mode) for mode in ("fp32", "bf16-mixed", "bf16-true")}
    for mode, (result, _, stderr) in runs.items():
        assert result["stage"] == "done", (mode, stderr[-2000:])
        assert all(math.isfinite(v) for v in result["losses"]), mode
    assert "the first training forward ran under cpu autocast to bfloat16" in runs["bf16-mixed"][0]["notes"]
    fp32 = runs["fp32"][0]["losses"]
    assert runs["bf16-true"][0]["losses"][1:] != fp32[1:]  # bf16 weights: other numerics than fp32's


def test_integer_tokens_stay_integers_in_pure_modes(tmp_path):
    out = tmp_path / "tokens.json"
    probe = tmp_path / "probe_tokens.py"
    probe.write_text(PROBE.replace("isinstance(module, torch.nn.Linear)", "isinstance(module, torch.nn.Embedding)")
                     .replace("EXAMPLE", repr(str(EXAMPLES / "plain_gpt.py"))).replace("OUT", repr(str(out))))
    result, _, stderr = child(tmp_path, probe, "bf16-true")
    assert result["stage"] == "done", stderr[-2000:]
    seen = json.loads(out.read_text())
    assert seen["input"] == "torch.int64" and seen["weight"] == "torch.bfloat16"


def test_a_nan_is_seen_and_skipped_fp16_steps_are_counted(tmp_path):
    # torch.cuda.amp.GradScaler(enabled=False) on a CPU becomes fp16-mixed's enabled scaler.
    result, stdout, stderr = child(tmp_path, SCRIPTS / "plain_overflow.py", "fp16-mixed", "--gain", "1e5",
                                   "--nan-at", "5")
    assert result["stage"] == "done", stderr[-2000:]
    assert result["skipped"][0] is True and result["loss_scale"][0] == 65536.0  # 1e5 overflows at 65536
    assert result["loss_scale"][1] < 65536.0
    assert result["losses"][5] == "nan" and math.isnan(float(result["losses"][5]))  # recorded as seen
    assert printed(stdout)[5] != printed(stdout)[5]  # the script printed nan at that step too
    assert result["skipped"][5] is True  # the NaN's gradients are not applied
    assert printed(stdout)[4] == pytest.approx(float(result["losses"][4]), rel=1e-5)
    fp32, _, _ = child(tmp_path, SCRIPTS / "plain_overflow.py", "fp32", "--nan-at", "3")
    assert not any(fp32["skipped"]) and all(s is None for s in fp32["loss_scale"])


def test_fp16_mixed_without_a_scaler_or_an_optimizer(tmp_path):
    injected, _, stderr = child(tmp_path, EXAMPLES / "plain_mlp.py", "fp16-mixed")
    assert injected["stage"] == "done", stderr[-2000:]
    assert injected["loss_scale"][0] == 65536.0
    assert any("builds no GradScaler" in note for note in injected["notes"])
    spec = TrialSpec(policy={"mode": "fp16-mixed"}, result_path=str(tmp_path / "manual.json"), framework="torch")
    manual = run_trial(EXAMPLES / "plain_manual.py", [], spec, timeout=120, launch=plan_for(EXAMPLES / "plain_manual.py").launch)
    assert manual.outcome == "unsupported" and "not expressible for this script" in manual.reason


def test_a_script_that_never_trains_ends_with_one_line_within_the_bound(tmp_path):
    script = SCRIPTS / "plain_never_trains.py"
    spec = TrialSpec(policy={"mode": "fp32"}, result_path=str(tmp_path / "never.json"), framework="torch",
                     first_step_timeout=10.0)  # a loaded machine may take seconds to the first forward
    started = time.monotonic()
    result = run_trial(script, [], spec, timeout=120, launch=plan_for(script).launch)
    assert time.monotonic() - started < 60
    assert result.outcome == "no-step", (result.outcome, result.reason)
    assert result.reason.startswith("the script reached no backward within 10 s: it ran ")
    assert "forwards of Sequential, no backward, no optimizer step" in result.reason
    ended = run_trial(script, ["--exit"], spec, timeout=120, launch=plan_for(script).launch)
    assert ended.outcome == "no-step" and "ended before any backward: it ran 1 forward of Sequential" in ended.reason


def test_sigterm_prints_what_the_script_reached(tmp_path):
    spec = TrialSpec(policy={"mode": "fp32"}, result_path=str(tmp_path / "r.json"), framework="torch")
    (tmp_path / "spec.json").write_text(spec.to_json())
    env = {**trial_environment(None), TRIAL_SPEC_ENV: str(tmp_path / "spec.json")}
    script = SCRIPTS / "plain_never_trains.py"
    proc = subprocess.Popen([sys.executable, *plan_for(script).launch, str(script)], env=env,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and '"policy_applied"' not in _read(tmp_path / "r.json"):
        time.sleep(0.2)
    time.sleep(1.0)
    proc.terminate()
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 128 + 15
    assert "mpadvise: the script was stopped by SIGTERM: it ran " in stderr and "no backward" in stderr


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


@pytest.mark.slow
def test_tune_run_and_export_on_an_unmodified_script(tmp_path, isolated_home, cli):
    script = tmp_path / "plain_gpt.py"
    shutil.copy(EXAMPLES / "plain_gpt.py", script)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # --no-priors: on a CPU without a bf16 fast path the matmul priors rule bf16-mixed out
    # before it runs, and this test needs both modes measured.
    tune = cli("tune", str(script), "-m", "fp32", "-m", "bf16-mixed", "--no-priors", "--json", "--", "--max_iters=400",
               env=env, timeout=600)
    assert tune.returncode in (0, 3), tune.stderr[-3000:]
    report = json.loads(tune.stdout)
    assert {c["mode"] for c in report["candidates"]} >= {"fp32", "bf16-mixed"}
    assert (tmp_path / "plain_gpt.mpadvise.toml").is_file()
    run = cli("run", str(script), "--", "--max_iters=400", env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"through torch (from config file {tmp_path / 'plain_gpt.mpadvise.toml'}" in run.stderr
    assert "iter 399: loss" in run.stdout  # the script's own loop and output, to its own end
    export = cli("export", str(script), "--to", "torch", env=env)
    assert export.returncode == 0, export.stderr
    assert export.stdout.startswith(f"--- {script}\n+++ {script}\n")
    assert "+import advisor" in export.stdout and "+mp = advisor.load_policy()" in export.stdout
    assert "+model, optimizer = mp.setup(model, optimizer)" in export.stdout
    assert "-        scaler.scale(loss).backward()" in export.stdout and "+        mp.step(loss, optimizer)" in export.stdout
    manual = tmp_path / "plain_manual.py"
    shutil.copy(EXAMPLES / "plain_manual.py", manual)
    Policy(mode="bf16-mixed").save(tmp_path / "plain_manual.mpadvise.toml")
    refused = cli("export", str(manual), "--to", "torch", env=env)
    assert refused.returncode == 1 and "builds no torch.optim optimizer" in refused.stderr


@pytest.mark.slow
def test_a_plain_ddp_script_trials_under_torchrun(tmp_path, isolated_home, cli):
    """gloo DDP with no_sync-style accumulation (require_backward_grad_sync), two ranks: the
    candidate runs on both, pure bf16 cast before DDP builds its buckets."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = cli("trial", "--nproc-per-node", "2", str(SCRIPTS / "plain_ddp.py"), "-m", "bf16-mixed", "-m", "bf16-true",
               "--json", env=env, timeout=900)
    assert proc.returncode in (0, 3), proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    rows = {row["mode"]: row for row in report["candidates"]}
    assert {"bf16-mixed", "bf16-true"} <= set(rows), list(rows)
    assert report["reference"]["outcome"] == "ok", report["reference"]
    for mode in ("bf16-mixed", "bf16-true"):
        assert rows[mode]["outcome"] in ("ok", "unstable"), rows[mode]
