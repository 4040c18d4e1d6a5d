"""Unmodified Lightning scripts (Trainer and Fabric) tuned, trialled and run through mpadvise:
the candidate wins over the precision the script passes, steps are recorded through
Lightning's hooks (skipped fp16 steps included), and ``mpadvise run`` applies the policy.

Every test starts Python processes that import Lightning (a few seconds each on 2 cores).
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

import pytest

from advisor.frameworks import plan_for
from advisor.trial import TrialResult, TrialSpec, run_trial
from policies import LossScale, Policy

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent / "scripts"
EXAMPLES = ROOT / "examples"

pytestmark = pytest.mark.slow


def one_thread_env() -> dict[str, str]:
    """This environment with one intra-op thread per process, for the tunes' timings.

    With two threads on two cores, another process on either core stalls every parallel region
    of a step (whole trials ran 40x slower on the shared 2-core build machine), and a tune calls
    such noise a tie; with one thread, it only takes its share.
    """
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def winner_text(result: dict) -> str:
    return f"winner {result['winner']['mode']}: {result['tie_note']} finalists {result['finalists']}"


def framework_trial(tmp_path: Path, script: Path, framework: str, policy: Policy, *args: str,
                    seed: int = 0, steps: int = 10) -> TrialResult:
    """One trial of ``script`` under ``policy``, launched as ``mpadvise tune`` launches it."""
    plan = plan_for(script, framework)
    spec = TrialSpec(policy=policy.to_dict(), result_path=str(tmp_path / "result.json"), seed=seed,
                     warmup_steps=2, measure_steps=steps, framework=framework)
    result = run_trial(script, list(args), spec, timeout=180, launch=plan.launch)
    assert result.outcome == "ok", result.reason + result.stderr_tail
    return result


# Lightning's precision string for each mode the tunes below can pick.
_PRECISION = {"fp32": "32-true", "bf16-mixed": "bf16-mixed"}


def test_trainer_script_is_tuned_and_run_applies_the_winner(tmp_path, isolated_home, cli, tuned_winner):
    # Width 512 and batch 512: on an AMX CPU a bf16-mixed step takes ~5 ms under the Trainer,
    # an fp32 step ~13 ms (one thread: ~4 and ~10 ms), a gap re-measurement settles quickly.
    # Without AMX-BF16 bf16 is the slower by far, and fp32 wins.
    out = tmp_path / "lightning_mlp.mpadvise.toml"
    workload = ["--max-steps", "200", "--batch-size", "512"]
    proc = cli("tune", str(EXAMPLES / "lightning_mlp.py"), "--trials", "1", "-m", "bf16-mixed", "--steps", "30",
               "--warmup", "2", "--timeout", "180", "--out", str(out), "--json", "--", *workload,
               timeout=900, env=one_thread_env())  # a loaded machine's noise makes the tune re-measure
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["framework"] == "lightning"
    winner = tuned_winner(result)
    # Which mode wins is a speed figure, for scripts/bench_agreement.py: on a loaded machine a tie goes to
    # the safer fp32. tuned_winner checks the winner against the tune's own figures, under any load.
    assert winner["mode"] in _PRECISION, winner_text(result)
    assert f'mode = "{winner["mode"]}"' in out.read_text()
    # The search's priors (matmul speed per dtype here) choose what its one trial measures: on a
    # CPU without AMX-BF16 that need not be bf16-mixed. Whatever it measured in these two modes
    # trained stably.
    by_label = {c["label"]: c for c in result["candidates"]}
    assert by_label["fp32"]["stable"]
    assert all(c["stable"] for c in result["candidates"] if c["label"] in _PRECISION), winner_text(result)

    # The tune cached the winner for this machine, script and arguments: `mpadvise run` of the
    # same workload applies it (other arguments would get the safe default).
    run = cli("run", str(EXAMPLES / "lightning_mlp.py"), "--", *workload, timeout=400, env=one_thread_env())
    assert run.returncode == 0, run.stderr
    assert f"trained 200 steps with precision {_PRECISION[winner['mode']]}" in run.stdout
    lines = [line for line in run.stderr.splitlines() if line.startswith("mpadvise: policy")]
    policy = Policy.from_dict(result["winner"])
    assert len(lines) == 1 and lines[0].startswith(f"mpadvise: policy {policy.describe()} through lightning (from cache entry")


def test_run_applies_a_bf16_mixed_config_over_the_trainers_precision(tmp_path, isolated_home, cli):
    config = Policy(mode="bf16-mixed").save(tmp_path / "bf16.mpadvise.toml")
    run = cli("run", str(EXAMPLES / "lightning_mlp.py"), "--config", str(config), "--", "--max-steps", "3")
    assert run.returncode == 0, run.stderr
    # The script passes precision="32-true" to its Trainer: the config's mode is applied over it.
    assert "trained 3 steps with precision bf16-mixed" in run.stdout
    lines = [line for line in run.stderr.splitlines() if line.startswith("mpadvise: policy")]
    assert lines == [f"mpadvise: policy bf16-mixed through lightning (from config file {config})"]


def test_trainer_trial_overrides_the_scripts_precision_and_shifts_its_seed(tmp_path, isolated_home, cli):
    dtypes = tmp_path / "dtypes.txt"
    script = SCRIPTS / "lightning_knobs.py"  # its Trainer import is not detected: --framework says it
    proc = cli("trial", str(script), "--mode", "bf16-mixed", "--framework", "lightning", "--steps", "30",
               "--warmup", "2", "--json", "--", "--precision", "32-true", "--dtype-file", str(dtypes))
    assert proc.returncode in (0, 3), proc.stderr
    payload = json.loads(proc.stdout)
    assert payload["framework"] == "lightning"
    (candidate,) = payload["candidates"]
    assert candidate["outcome"] in ("ok", "unstable") and candidate["steps"] == 32
    assert "Lightning Trainer: precision='bf16-mixed' (the script asked for '32-true')" in candidate["notes"]
    # The fp32 reference, its replicate and the candidate: the candidate's forward ran in bf16. On
    # a busy machine, each run again (a disturbed trial) and fp32 timed on the candidate's threads
    # add a run of its kind.
    reruns = Counter(event["label"] for event in payload["disturbed"] if event["rerun"])
    timed_apart = candidate["threads"] != payload["reference"]["threads"]
    fp32_runs = 2 + timed_apart + sum(n for label, n in reruns.items() if label.startswith("fp32"))
    expected = {"torch.float32": fp32_runs, "torch.bfloat16": 1 + reruns["bf16-mixed"]}
    assert Counter(dtypes.read_text().split()) == expected, payload["disturbed"]
    # The replicate's initial weights were perturbed where the adapter first saw the model, after
    # the script's L.seed_everything(42): it trained apart from the reference.
    assert payload["replicate"]["losses"] != payload["reference"]["losses"]


def test_trainer_records_skipped_fp16_steps_and_undivided_accumulated_loss(tmp_path, isolated_home):
    # A loss multiplied by 1e6 overflows fp16 at every scale the window reaches: each step is
    # skipped and the dynamic scale halves.
    result = framework_trial(tmp_path, SCRIPTS / "lightning_knobs.py", "lightning", Policy(mode="fp16-mixed"),
                             "--loss-mult", "1e6", "--accumulate", "2", steps=6)
    assert result.skipped == (True,) * 8
    assert result.loss_scale == tuple(65536.0 / 2**i for i in range(8))
    assert result.grad_accum_steps == 2 and result.micro_batch == 32 and set(result.samples) == {64}
    # Lightning divides each micro-batch's loss by the accumulation count; the record does not.
    assert all(1e6 < loss < 3e6 for loss in result.losses)
    assert any("MixedPrecision('16-mixed') with a dynamic GradScaler" in note for note in result.notes)


def test_trainer_manual_optimization_records_the_unscaled_loss(tmp_path, isolated_home):
    result = framework_trial(tmp_path, SCRIPTS / "lightning_knobs.py", "lightning", Policy(mode="fp16-mixed"),
                             "--manual", steps=4)
    assert not any(result.skipped) and set(result.loss_scale) == {65536.0}
    assert all(1.0 < loss < 2.0 for loss in result.losses)  # cross-entropy over 4 classes, not x 65536


def test_fabric_script_is_tuned(tmp_path, isolated_home, cli, tuned_winner):
    # Width 512 and batch 512: a bf16-mixed step ~5 ms on an AMX CPU, an fp32 step ~8 ms;
    # without AMX-BF16, bf16 is the slower by far.
    out = tmp_path / "fabric_mlp.mpadvise.toml"
    proc = cli("tune", str(EXAMPLES / "fabric_mlp.py"), "--trials", "1", "-m", "bf16-mixed", "--steps", "30",
               "--warmup", "2", "--timeout", "180", "--out", str(out), "--json",
               "--", "--max-steps", "200", "--batch-size", "512", timeout=900, env=one_thread_env())
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["framework"] == "fabric" and result["user_batch"] == 512
    winner = tuned_winner(result)
    # Which mode wins is a speed figure, for scripts/bench_agreement.py: on a loaded machine a tie goes to
    # the safer fp32. tuned_winner checks the winner against the tune's own figures, under any load.
    assert f'mode = "{winner["mode"]}"' in out.read_text()


def test_fabric_trial_applies_bf16_over_the_scripts_precision(tmp_path, isolated_home):
    dtypes = tmp_path / "dtypes.txt"
    result = framework_trial(tmp_path, SCRIPTS / "fabric_knobs.py", "fabric", Policy(mode="bf16-mixed"),
                             "--precision", "32-true", "--accumulate", "2", "--dtype-file", str(dtypes), seed=1, steps=4)
    assert dtypes.read_text().split() == ["torch.bfloat16"]
    assert "Lightning Fabric: precision='bf16-mixed' (the script asked for '32-true')" in result.notes
    assert "the script's seed_everything(42) ran as seed_everything(43) (trial seed 1)" in result.notes
    assert len(result.losses) == 6 and result.device == "cpu"
    # Two backward passes per optimizer step: the script's own accumulation.
    assert result.grad_accum_steps == 2 and result.global_batch == 64 and set(result.samples) == {64}
    assert result.workload_fingerprint and result.model_signature


def test_fabric_static_loss_scale_stays_fixed_and_skips_overflowing_steps(tmp_path, isolated_home):
    policy = Policy(mode="fp16-mixed", loss_scale=LossScale(kind="static", init_scale=2.0**20))
    result = framework_trial(tmp_path, SCRIPTS / "fabric_knobs.py", "fabric", policy, "--loss-mult", "1e4", steps=4)
    assert result.skipped == (True,) * 6
    assert set(result.loss_scale) == {2.0**20}


def test_mpadvise_run_applies_a_static_loss_scale_through_fabric(tmp_path, isolated_home, cli):
    config = Policy(mode="fp16-mixed", loss_scale=LossScale(kind="static", init_scale=1024.0)).save(
        tmp_path / "static.mpadvise.toml")
    proc = cli("run", str(SCRIPTS / "fabric_knobs.py"), "--config", str(config), "--", "--max-steps", "5")
    assert proc.returncode == 0, proc.stderr
    # The script asked for 32-true: Fabric ended up with fp16 autocast and the policy's scaler.
    assert "precision=16-mixed scaler=PolicyGradScaler scale=1024.0 steps=5" in proc.stdout
    lines = [line for line in proc.stderr.splitlines() if line.startswith("mpadvise: policy")]
    assert lines == [f"mpadvise: policy fp16-mixed (static loss scale 1024) through fabric (from config file {config})"]
