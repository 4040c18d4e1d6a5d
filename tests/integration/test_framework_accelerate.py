"""An unmodified Accelerate script under ``mpadvise trial``, ``tune`` and ``run``: the candidate
wins over the script's own ``mixed_precision="no"``, fp16's skipped steps and FP8's swapped
layers are seen, a tune picks by its measurements (bf16-mixed on a CPU with AMX-BF16, fp32 on
one without), and ``run`` applies the winner or a bf16-mixed config file.

The script (``scripts/accelerate_wide_mlp.py``) writes what its first step ran in to
``--report DIR/<mixed precision>.json`` and prints the same line.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from policies import Policy, load_config

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent / "scripts"

pytestmark = pytest.mark.slow

# One thread per trial process: on a shared 2-core machine, OpenMP's spinning worker threads
# make step times swing tenfold whenever another process runs, which hides any real speed-up.
_ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def _env(home: Path, **extra: str) -> dict[str, str]:
    """This process's environment with a cache directory of the test's own."""
    env = {k: v for k, v in os.environ.items() if k != "MPADVISE_POLICY"}
    env.update(MPADVISE_HOME=str(home), COLUMNS="200", **extra)
    return env


def mpadvise(*args: str, env: dict[str, str], timeout: float = 400) -> subprocess.CompletedProcess[str]:
    """``mpadvise ARGS`` in a subprocess, as a user runs it."""
    return subprocess.run([sys.executable, "-m", "advisor.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)


@pytest.fixture(scope="module")
def small_trial(tmp_path_factory):
    """One ``mpadvise trial`` of bf16-mixed, fp16-mixed and emulated fp8-torchao against fp32.

    The script is started through a file that imports nothing of Accelerate, so
    ``--framework accelerate`` is what makes it an Accelerate trial. A loss multiplied by 1e4
    overflows fp16 under the GradScaler's initial scale of 65536. ``accelerate launch``'s
    environment asks for fp16 too, and loses to each candidate as the script's argument does.
    """
    tmp = tmp_path_factory.mktemp("accelerate-trial")
    report = tmp / "report"
    report.mkdir()
    proc = mpadvise(
        "trial", str(SCRIPTS / "accelerate_indirect.py"), "--framework", "accelerate",
        "-m", "bf16-mixed", "-m", "fp16-mixed", "-m", "fp8-torchao",
        "--steps", "29", "--warmup", "3", "--timeout", "120", "--json",
        "--", "--width", "64", "--batch", "32", "--loss-mult", "1e4", "--report", str(report),
        env=_env(tmp / "home", ACCELERATE_MIXED_PRECISION="fp16"),
    )
    assert proc.returncode in (0, 3), proc.stderr
    data = json.loads(proc.stdout)
    candidates = {c["mode"]: c for c in data["candidates"]}
    reports = {path.stem: json.loads(path.read_text()) for path in report.glob("*.json")}
    return data, candidates, reports


def test_framework_flag_makes_a_script_without_imports_an_accelerate_trial(small_trial):
    data, candidates, _ = small_trial
    assert data["framework"] == "accelerate"
    assert data["reference"]["outcome"] == "ok"
    assert set(candidates) == {"bf16-mixed", "fp16-mixed", "fp8-torchao"}
    # fp32's replicate runs fp32's seed with its initial weights perturbed once, where the
    # adapter first sees the model (after the script's own set_seed(42)): its first loss differs.
    replicate = data["replicate"]
    assert (replicate["seed"], replicate["perturb"]) == (data["settings"]["seed"], "bf16")
    assert not replicate["identical"] and replicate["losses"][0] != data["reference"]["losses"][0]


def test_bf16_mixed_overrides_the_scripts_mixed_precision_no(small_trial):
    _, candidates, reports = small_trial
    bf16 = candidates["bf16-mixed"]
    assert bf16["outcome"] == "ok", bf16["stderr_tail"]
    assert "Accelerator: mixed_precision='bf16' (the script asked for 'no')" in bf16["notes"]
    # What the script itself saw: Accelerate's setting and a bf16 hidden activation.
    assert reports["bf16"] == {"mixed_precision": "bf16", "hidden_dtype": "torch.bfloat16", "loss_scale": None}
    assert reports["no"]["hidden_dtype"] == "torch.float32"
    assert bf16["micro_batch"] == 32 and bf16["grad_accum_steps"] == 1 and bf16["global_batch"] == 32
    assert bf16["steps"] == 32


def test_fp16_runs_with_a_grad_scaler_on_the_cpu_and_its_skipped_steps_are_recorded(small_trial):
    _, candidates, reports = small_trial
    fp16 = candidates["fp16-mixed"]
    # It ran to the end; with a third of its steps skipped it may trail fp32 enough to be judged
    # a stall, which is the verdict's business, not this test's.
    assert fp16["outcome"] in ("ok", "unstable") and fp16["steps"] == 32, fp16["stderr_tail"]
    # Accelerate alone would train in fp32 on a CPU; the trial ran fp16 autocast with a scaler.
    assert any("GradScaler('cpu')" in note for note in fp16["notes"])
    assert reports["fp16"]["hidden_dtype"] == "torch.float16"
    # The first step overflowed at 65536 and was skipped; its backoff halved the scale.
    assert reports["fp16"]["loss_scale"] == 32768.0
    assert fp16["skipped_steps"] >= 1


def test_fp8_torchao_runs_emulated_through_accelerates_ao_recipe(small_trial):
    _, candidates, reports = small_trial
    fp8 = candidates["fp8-torchao"]
    assert fp8["outcome"] == "ok", fp8["stderr_tail"]
    notes = " | ".join(fp8["notes"])
    assert "Accelerate swapped 2 Linear layers for torchao's Float8Linear" in notes
    assert "kept in high precision (dimensions not divisible by 16): 4 (64->8)" in notes
    assert reports["fp8"]["mixed_precision"] == "fp8"
    # The swapped layers train (their Parameters are the optimizer's): the loss follows fp32's.
    reference = small_trial[0]["reference"]["losses"]
    assert fp8["stable"], fp8["reason"]
    assert abs(fp8["losses"][-1] - reference[-1]) < 0.05 * abs(reference[-1])


# What the script's first step reports under each mode the tune below can pick.
_REPORTED = {
    "fp32": {"mixed_precision": "no", "hidden_dtype": "torch.float32", "loss_scale": None},
    "bf16-mixed": {"mixed_precision": "bf16", "hidden_dtype": "torch.bfloat16", "loss_scale": None},
}


def test_tune_picks_by_measurement_and_run_applies_the_winner(tmp_path, tuned_winner):
    script = tmp_path / "train.py"
    shutil.copy(SCRIPTS / "accelerate_wide_mlp.py", script)
    env = _env(tmp_path / "home", **_ONE_THREAD)
    workload = ["--width", "1024", "--batch", "512"]
    proc = mpadvise("tune", str(script), "--trials", "2", "--steps", "30", "--warmup", "3", "--no-priors",
                    "-m", "bf16-mixed", "--timeout", "120", "--json", "--", *workload, env=env)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    winner = tuned_winner(result)
    # Which mode wins is a speed figure, for scripts/bench_agreement.py: on a loaded machine a tie goes to
    # the safer fp32. tuned_winner checks the winner against the tune's own figures, under any load.
    assert winner["mode"] in _REPORTED, winner
    config = script.with_name("train.mpadvise.toml")
    policy = load_config(config)
    assert policy.mode == winner["mode"]

    # The tuned answer applies to the arguments it was tuned with (other ones get the safe
    # default): the run is the tuned workload itself, its 200 steps.
    run = mpadvise("run", str(script), "--", *workload, env=env, timeout=300)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout.strip().splitlines()[0]) == _REPORTED[winner["mode"]]
    lines = [line for line in run.stderr.splitlines() if line.startswith("mpadvise: policy")]
    assert lines == [f"mpadvise: policy {policy.describe()} through accelerate (from config file {config})"]


def test_run_applies_a_bf16_mixed_config_over_the_scripts_mixed_precision_no(tmp_path):
    config = Policy(mode="bf16-mixed").save(tmp_path / "bf16.mpadvise.toml")
    run = mpadvise("run", str(SCRIPTS / "accelerate_wide_mlp.py"), "--config", str(config),
                   "--", "--steps", "1", "--width", "64", env=_env(tmp_path / "home"), timeout=120)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout.strip().splitlines()[0]) == _REPORTED["bf16-mixed"]
    lines = [line for line in run.stderr.splitlines() if line.startswith("mpadvise: policy")]
    assert lines == [f"mpadvise: policy bf16-mixed through accelerate (from config file {config})"]


def test_run_applies_fp16_with_the_policys_loss_scale(tmp_path):
    config = Policy(mode="fp16-mixed").save(tmp_path / "fp16.mpadvise.toml")
    run = mpadvise("run", str(SCRIPTS / "accelerate_wide_mlp.py"), "--config", str(config),
                   "--", "--steps", "1", "--width", "64", "--loss-mult", "1e4", env=_env(tmp_path / "home"), timeout=120)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout.strip().splitlines()[0]) == {
        "mixed_precision": "fp16", "hidden_dtype": "torch.float16", "loss_scale": 32768.0}
