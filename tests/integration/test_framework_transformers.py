"""Unmodified Hugging Face Trainer scripts under mpadvise: tune, trial and run through the real
Trainer and Accelerate, in subprocesses, on a wide MLP built from its config (nothing is
downloaded). Single trials run through the same launch a tune uses (``run_trial`` with the
adapter's boot), so each check costs one process.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest

from advisor.frameworks import detect_framework
from advisor.frameworks._plan import launch_argv
from advisor.trial import TrialResult, TrialSpec, run_trial
from policies import Policy, load_config

SCRIPTS = Path(__file__).resolve().parent / "scripts"
SCRIPT = SCRIPTS / "hf_wide_mlp.py"
# A small, quick model for the checks that do not time anything.
SMALL = ["--width", "128", "--batch", "32", "--max-steps", "100"]

pytestmark = pytest.mark.slow


@pytest.fixture
def hf_env(isolated_home, monkeypatch):
    """Nothing from the Hub; one thread per trial, so that OpenMP does not spin against the
    other processes on a shared two-core machine (two threads there made step times swing
    tenfold, which no noise band survives)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)


def trial(tmp_path: Path, policy: Policy, args: list[str], *, seed: int = 0, warmup: int = 1,
          steps: int = 6) -> TrialResult:
    """One trial of the wide-MLP script through the Trainer adapter, as a tune launches it."""
    spec = TrialSpec(policy=policy.to_dict(), result_path=str(tmp_path / f"{policy.mode}-{seed}.json"), seed=seed,
                     warmup_steps=warmup, measure_steps=steps, device="cpu", framework="transformers")
    return run_trial(SCRIPT, args, spec, timeout=240, launch=launch_argv("transformers"))


# What ``hf-run`` prints (Accelerate's mixed precision, TrainingArguments' bf16 and fp16) under
# each mode the tune below can pick, where the script itself passes bf16=False, fp16=False.
_RAN = {"fp32": ("no", "False", "False"), "bf16-mixed": ("bf16", "True", "False")}


def _hf_run(stdout: str) -> re.Match[str]:
    ran = re.search(r"hf-run mixed_precision=(\S+) bf16=(\S+) fp16=(\S+) per_device_train_batch_size=(\d+) "
                    r"gradient_accumulation_steps=(\d+)", stdout)
    assert ran is not None, stdout
    return ran


def test_tune_picks_by_measurement_and_run_applies_the_winner(tmp_path, hf_env, cli, tuned_winner):
    script = tmp_path / "train.py"
    shutil.copy(SCRIPT, script)
    # Wide layers on a large batch: on a CPU with AMX-BF16, bf16 matmuls are about 3x fp32's
    # (without it, about 0.06x), and the script itself asks TrainingArguments for fp32
    # (bf16=False, fp16=False). fp16-mixed is left out: under the HF Trainer it needs a GPU
    # (its trial on a CPU ends unsupported, tested below).
    workload = ["--precision", "fp32", "--width", "512", "--batch", "1024", "--max-steps", "200"]
    proc = cli("tune", str(script), "-m", "bf16-mixed", "--trials", "1", "--steps", "30", "--warmup", "3",
               "--no-priors", "--json", "--", *workload, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    winner = tuned_winner(result)
    assert result["user_batch"] == 1024
    # Which mode wins is a speed figure, for scripts/bench_agreement.py: on a loaded machine a tie goes to
    # the safer fp32. tuned_winner checks the winner against the tune's own figures, under any load.
    assert winner["mode"] in _RAN, winner
    config = script.with_name("train.mpadvise.toml")
    policy = load_config(config)
    assert policy.mode == winner["mode"]

    # The tuned answer applies to the arguments it was tuned with (other ones get the safe
    # default): the run is the tuned workload itself, its 200 steps.
    run = cli("run", str(script), "--", *workload, timeout=400)
    assert run.returncode == 0, run.stderr[-3000:]
    ran = _hf_run(run.stdout)
    # The script still passes bf16=False, fp16=False: the winner is applied over them.
    assert ran.groups()[:3] == _RAN[winner["mode"]]
    assert int(ran.group(4)) * int(ran.group(5)) == 1024  # a tuned split keeps the script's global batch
    expected = f"mpadvise: policy {policy.describe()} through transformers (from config file {config})"
    assert expected in run.stderr.splitlines(), run.stderr[-2000:]


def test_run_applies_a_bf16_mixed_config_over_the_scripts_fp32(tmp_path, hf_env, cli):
    config = Policy(mode="bf16-mixed").save(tmp_path / "bf16.mpadvise.toml")
    run = cli("run", str(SCRIPT), "--config", str(config), "--", "--precision", "fp32", *SMALL[:4],
              "--max-steps", "2", timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    ran = _hf_run(run.stdout)
    assert ran.groups()[:3] == _RAN["bf16-mixed"] and ran.group(4) == "32"
    expected = f"mpadvise: policy bf16-mixed through transformers (from config file {config})"
    assert expected in run.stderr.splitlines(), run.stderr[-2000:]


def test_trial_with_the_framework_flag_sees_a_nan_that_hf_logging_would_hide(hf_env, cli):
    indirect = SCRIPTS / "hf_indirect.py"
    assert detect_framework(indirect.read_text()) is None  # only --framework says how it trains
    # The 12th forward under autocast yields NaN; fp32 stays finite.
    proc = cli("trial", str(indirect), "--framework", "transformers", "-m", "bf16-mixed", "--steps", "30",
               "--warmup", "2", "--json", "--", *SMALL, "--nan-at", "12")
    assert proc.returncode == 3, proc.stderr[-3000:]
    data = json.loads(proc.stdout)
    assert data["framework"] == "transformers"
    reference, (bf16,) = data["reference"], data["candidates"]
    assert reference["outcome"] == "ok" and all(math.isfinite(float(v)) for v in reference["losses"])
    losses = [float(v) for v in bf16["losses"]]
    assert all(math.isfinite(v) for v in losses[:11]) and math.isnan(losses[11])
    assert not bf16["stable"] and bf16["outcome"] == "unstable"
    assert "the first forward ran under cpu autocast to bfloat16" in bf16["notes"]
    # The replicate's initial weights were perturbed, although the script and its Trainer seed 42
    # themselves: it trained apart from the reference.
    assert data["replicate"]["losses"] != reference["losses"]


def test_fp16_skipped_steps_and_loss_scale_are_recorded(tmp_path, hf_env):
    # A huge loss overflows fp16 gradients: the GradScaler skips and halves its scale.
    result = trial(tmp_path, Policy(mode="fp16-mixed"),
                   [*SMALL, "--emulate-gpu-fp16", "--loss-multiplier", "1e6", "--precision", "bf16"], steps=8)
    assert result.outcome == "ok", result.stderr_tail
    assert sum(result.skipped) >= 3
    scales = list(result.loss_scale)
    assert scales[0] == 65536.0
    for i, skipped in enumerate(result.skipped[:-1]):
        if skipped:
            assert scales[i + 1] == scales[i] / 2
    assert "TrainingArguments(fp16=True, bf16=False, tf32=False) for fp16-mixed where the script's arguments had fp16=False, bf16=True" in result.notes
    assert "the first forward ran under cpu autocast to float16" in result.notes


def test_fp16_on_a_cpu_is_unsupported_rather_than_fp32_under_its_name(tmp_path, hf_env):
    result = trial(tmp_path, Policy(mode="fp16-mixed"), SMALL)
    assert result.outcome == "unsupported"
    assert "cannot run fp16-mixed on cpu" in result.reason and "trains in fp32" in result.reason


def test_a_micro_batch_split_keeps_the_global_batch_and_the_step_loss(tmp_path, hf_env):
    script_batch = [*SMALL[:2], "--batch", "32", "--accum", "2", "--max-steps", "100"]
    split = trial(tmp_path, Policy(mode="fp32", micro_batch_size=16, grad_accum_steps=4), script_batch)
    whole = trial(tmp_path, Policy(mode="fp32"), script_batch, seed=0, warmup=1)
    assert split.outcome == whole.outcome == "ok", split.stderr_tail + whole.stderr_tail
    assert (split.micro_batch, split.grad_accum_steps, split.global_batch, split.user_batch) == (16, 4, 64, 64)
    assert (whole.micro_batch, whole.grad_accum_steps, whole.global_batch) == (32, 2, 64)
    assert set(split.samples) == {64}
    # Same samples per step in the same order: the step's loss is the mean over its
    # micro-batches however it is split (not divided by the accumulation count).
    assert split.losses[0] == pytest.approx(math.log(8), abs=0.05)
    assert split.losses == pytest.approx(whole.losses, abs=1e-5)
