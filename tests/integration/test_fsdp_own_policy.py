"""Two-process FSDP2 trials on this CPU (gloo): a script that shards with a MixedPrecisionPolicy
of its own ends its trial with the refusal as the reason (without the check, the "fp32"
reference trained in bf16 and nothing said so); with the policy's own it trains, and the
workload it records counts both processes: world size 2 and a global batch of twice the
per-process batch, a key that a one-process run of the same script misses, naming both."""

from __future__ import annotations

from pathlib import Path

import pytest
from torch import nn

from advisor.runtime import Workload
from advisor.runtime._workload import workload_mismatch
from advisor.tune._run import ScriptRunner, TrialSettings
from policies import Policy, TunedOn

SCRIPT = Path(__file__).resolve().parent / "scripts" / "fsdp2_own_policy.py"
PER_PROCESS = 16  # the script's micro_batch_size(16)

pytestmark = pytest.mark.slow

REFUSAL = (
    "fully_shard(model) was given mp_policy=MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16), but the "
    "fp32 policy needs MixedPrecisionPolicy(), so FSDP2 would train in the script's dtypes instead; pass "
    "mp_policy=mp.fsdp_mixed_precision() to every fully_shard"
)


def the_scripts_workload(world_size: int) -> Workload:
    """The workload the script trains, as its trial should record it on ``world_size`` processes."""
    model = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 2))
    # The script calls mp.setup(model) alone: FSDP2's optimizer is built on the sharded parameters after it.
    return Workload.of(model, None, global_batch=PER_PROCESS * world_size, script=SCRIPT, args=["policy"],
                       world_size=world_size)


def test_a_scripts_own_fsdp_policy_ends_the_trial_with_the_fix(isolated_home, cli):
    proc = cli("trial", str(SCRIPT), "--nproc-per-node", "2", "--mode", "bf16-mixed", "--steps", "4", "--warmup", "1",
               "--", "own")
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == f"error: the fp32 reference trial failed (crash): {REFUSAL}"
    assert "Traceback" not in proc.stderr


def test_a_two_process_trial_records_both_processes_in_its_workload(isolated_home):
    settings = TrialSettings(warmup_steps=1, measure_steps=4, nproc_per_node=2, timeout=240)
    with ScriptRunner(SCRIPT, ["policy"], settings) as runner:
        two = runner(Policy(mode="fp32"), "fp32")
    assert two.outcome == "ok", two.reason
    assert two.ranks == 2 and two.fsdp  # sharded with the policy's own MixedPrecisionPolicy
    assert two.user_batch == PER_PROCESS and two.global_batch == 2 * PER_PROCESS
    assert two.workload_fingerprint == the_scripts_workload(2).fingerprint()

    with ScriptRunner(SCRIPT, ["policy"], TrialSettings(warmup_steps=1, measure_steps=4, timeout=240)) as runner:
        one = runner(Policy(mode="fp32"), "fp32")
    assert one.outcome == "ok", one.reason
    assert one.global_batch == PER_PROCESS and one.workload_fingerprint == the_scripts_workload(1).fingerprint()
    assert one.workload_fingerprint != two.workload_fingerprint

    # A tune on two processes records the script's batch per process; one process misses it, naming both counts.
    tuned = TunedOn(workload_fingerprint=two.workload_fingerprint, model_signature=two.model_signature,
                    global_batch=two.user_batch)
    mismatch = workload_mismatch(tuned, the_scripts_workload(1))
    assert mismatch is not None
    assert mismatch.reason() == "workload changed since tuning (world size 2 -> 1; global batch 32 -> 16)"
