"""Trials of two processes through the rank launcher (``advisor.trial._ranks``) on this CPU (gloo): a DDP script tuned through the
CLI, an FSDP2 script whose tune searches the gradient reduction dtype, and a rank that crashes
(a rank that hangs: test_rank_faults.py). Each trial starts three interpreters, so the windows
are short."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from advisor.tune._engine import tune_policy
from advisor.tune._options import TuneOptions
from advisor.tune._run import ScriptRunner, TrialSettings
from advisor.tune._space import SpaceLimits
from probes import profile_for

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent / "scripts"
EXAMPLES = ROOT / "examples"

pytestmark = pytest.mark.slow


def alive(pid: int) -> bool:
    """Whether a process runs (a zombie, dead but not yet reaped by its new parent, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def processes_where(name: str, holds: Callable[[bytes], bool]) -> list[int]:
    """Live processes whose ``/proc/PID/NAME`` (``cmdline``, ``environ``) ``holds``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            content = (entry / name).read_bytes()
        except OSError:
            continue
        if holds(content) and alive(int(entry.name)):
            found.append(int(entry.name))
    return found


def processes_running(path: Path) -> list[int]:
    """Live processes whose command line names ``path``."""
    return processes_where("cmdline", lambda cmdline: str(path) in cmdline.decode(errors="replace"))


def test_a_crash_on_one_rank_stops_the_tune_naming_that_rank(tmp_path, isolated_home, cli):
    proc = cli("tune", str(SCRIPTS / "ddp_rank_fails.py"), "--nproc-per-node", "2", "--steps", "31", "--warmup", "1",
               "--no-priors", "--no-cache", "--", "1", "3", "raise")
    assert proc.returncode == 1, proc.stderr
    # One line: rank 0 failed too (its peer closed the connection), later; rank 1's error is the cause.
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: the fp32 reference trial failed (crash): the script crashed on rank 1 (exit 1): "
        "ValueError: bad batch at step 3")
    assert "Traceback" not in proc.stderr


def test_a_ddp_script_is_tuned(tmp_path, isolated_home):
    """Through the tuner with real two-rank trials; re-measurement is off, since a close race on
    a loaded 2-core machine can take twenty more trials to settle."""
    settings = TrialSettings(warmup_steps=2, measure_steps=32, nproc_per_node=2, timeout=180)
    runner = ScriptRunner(EXAMPLES / "ddp_mlp.py", ["--steps", "1000", "--batch-size", "32", "--width", "256"], settings)
    options = TuneOptions(trials=1, modes=("bf16-mixed",), steps=32, warmup=2, no_priors=True)
    result = tune_policy(runner, profile_for("cpu"), options, dtype_ratio={}, remeasure=False,
                         limits=SpaceLimits(micro_batch=False))
    reference = result.reference.result
    assert reference.outcome == "ok" and reference.ranks == 2 and not reference.fsdp
    assert reference.user_batch == 32 and set(reference.samples) == {64}  # 32 per rank, summed
    assert not result.space.fsdp
    assert result.replicate is not None and not result.replicate.note
    ran = [ev for cand, ev in result.evaluations.items() if cand.mode == "bf16-mixed"]
    assert len(ran) == 1 and ran[0].outcome in ("ok", "unstable") and ran[0].policy.reduce_dtype is None
    assert result.policy is not None and result.policy.tuned_on.workload_fingerprint == reference.workload_fingerprint


def test_an_fsdp2_script_searches_the_gradient_reduction_dtype(tmp_path, isolated_home):
    """Through the tuner with real two-rank trials; re-measurement is off, since two reduction
    dtypes of a small model on one CPU tie, and settling a tie costs up to twenty trials."""
    settings = TrialSettings(warmup_steps=2, measure_steps=32, nproc_per_node=2, timeout=180)
    runner = ScriptRunner(EXAMPLES / "fsdp2_mlp.py", ["--steps", "1000", "--batch-size", "32", "--width", "256"], settings)
    options = TuneOptions(trials=2, modes=("bf16-mixed",), steps=32, warmup=2, no_priors=True)
    result = tune_policy(runner, profile_for("cpu"), options, dtype_ratio={}, remeasure=False,
                         limits=SpaceLimits(micro_batch=False))  # the script's own batch only: two candidates
    reference = result.reference.result
    assert reference.outcome == "ok" and reference.fsdp and reference.ranks == 2
    assert result.space.fsdp
    ran = {cand.reduce_dtype: ev for cand, ev in result.evaluations.items() if cand.mode == "bf16-mixed"}
    assert set(ran) == {"fp32", "bf16"}
    for reduce, ev in ran.items():
        assert ev.outcome in ("ok", "unstable"), ev.reason
        assert ev.policy.reduce_dtype == reduce and ev.result.ranks == 2
        assert ev.result.samples and set(ev.result.samples) == {64}  # 32 per rank, summed
    assert result.policy is not None
    if result.policy.mode == "bf16-mixed":
        assert result.policy.reduce_dtype in ("fp32", "bf16")


def test_trial_refuses_one_gpu_for_several_processes(tmp_path, isolated_home, cli):
    proc = cli("trial", str(SCRIPTS / "ddp_rank_fails.py"), "--nproc-per-node", "2", "--device", "cuda:1")
    assert proc.returncode == 2  # two options that cannot go together: a usage error
    assert "--device cuda:1 cannot be used with --nproc-per-node 2" in proc.stderr
