"""The tuner's search logic against a fake trial runner: milliseconds, no processes."""

from __future__ import annotations

import dataclasses
import math

import pytest

from advisor.trial import TrialResult
from advisor.tune._engine import tune_policy
from advisor.tune._options import TuneOptions, option_info
from advisor.tune._space import Candidate, Measured, space_for, upper_bound
from advisor.tune._steady import CpuTiming, DisturbanceWatch
from policies import Policy, supported_modes
from probes import HardwareProfile

GPU = HardwareProfile(kind="cuda", name="NVIDIA A100-SXM4-80GB", index=0, compute_capability=(8, 0),
                      memory_total=80 * 2**30, torch_version="2.13.0", libraries=(("torchao", "0.18.0"),))
V100 = HardwareProfile(kind="cuda", name="Tesla V100-SXM2-16GB", index=0, compute_capability=(7, 0),
                       memory_total=16 * 2**30, torch_version="2.13.0")
RATIOS = {"fp32": 1.0, "tf32": 6.0, "fp16": 12.0, "bf16": 12.0, "fp8": 20.0}
USER_BATCH = 64
N_STEPS = 40


class FakeRunner:
    """Pretends to run a trial: step time from a per-mode table, a loss curve that is fp32's
    unless the mode is listed as unstable, and peak memory proportional to the micro-batch."""

    def __init__(self, step_ms: dict[str, float], *, unstable=(), memory_per_sample=None, interrupt_after=None):
        self.step_ms = step_ms
        self.unstable = set(unstable)
        self.memory_per_sample = memory_per_sample
        self.calls: list[Policy] = []
        self.labels: list[str] = []
        self.interrupt_after = interrupt_after

    def __call__(self, policy: Policy, label: str) -> TrialResult:
        if self.interrupt_after is not None and len(self.calls) >= self.interrupt_after:
            raise KeyboardInterrupt
        self.calls.append(policy)
        self.labels.append(label)
        micro = policy.micro_batch_size or USER_BATCH
        accum = policy.grad_accum_steps or 1
        # A micro-batch split costs a little per micro-step (launches, optimizer unchanged).
        ms = self.step_ms[policy.mode] * (micro * accum / USER_BATCH) * (1 + 0.05 * (accum - 1))
        losses = [2.0 * math.exp(-i / 20) for i in range(N_STEPS)]
        if policy.mode in self.unstable:
            losses = losses[:10] + [float("nan")] * (N_STEPS - 10)
        peak = None if self.memory_per_sample is None else 100 * 2**20 + micro * self.memory_per_sample
        return TrialResult(
            outcome="ok", label=label, policy=policy.to_dict(), losses=tuple(losses),
            step_times=tuple([ms / 1e3] * N_STEPS), samples=tuple([micro * accum] * N_STEPS),
            skipped=tuple([False] * N_STEPS), warmup_steps=3, user_batch=USER_BATCH,
            global_batch=micro * accum, peak_memory=peak, workload_fingerprint="ab" * 8, model_signature="cd" * 8,
        )


def tune(runner, profile=GPU, **kwargs):
    """A tune of fake trials; their scatter is a shared CPU host's, so the CPU timing measures it
    (the GPU's fixed rounds have their own tests)."""
    kwargs.setdefault("dtype_ratio", RATIOS)
    kwargs.setdefault("trials", 30)
    kwargs.setdefault("timing", CpuTiming(DisturbanceWatch(profile=profile)))
    names = {option.name for option in option_info()}
    options = TuneOptions(**{k: kwargs.pop(k) for k in list(kwargs) if k in names})
    return tune_policy(runner, profile, options, **kwargs)


def test_best_stable_candidate_wins():
    runner = FakeRunner({"fp32": 100, "tf32": 40, "bf16-mixed": 20, "fp16-mixed": 21, "bf16-true": 15,
                         "fp16-true": 16, "fp8-torchao": 30})
    result = tune(runner, remeasure=False)
    assert result.winner == Candidate("bf16-true")  # pure bf16 is fastest and (here) stable
    assert result.policy.mode == "bf16-true"
    assert result.policy.tuned_on.speedup_vs_fp32 == pytest.approx(100 / 15, rel=1e-3)


def test_unstable_candidates_are_constraints_not_winners():
    runner = FakeRunner({"fp32": 100, "tf32": 40, "bf16-mixed": 20, "fp16-mixed": 21, "bf16-true": 15,
                         "fp16-true": 14, "fp8-torchao": 30}, unstable={"bf16-true", "fp16-true"})
    result = tune(runner, remeasure=False)
    assert result.winner.mode == "bf16-mixed"
    for cand, m in result.search.measured.items():
        if cand.mode in ("bf16-true", "fp16-true"):
            assert not m.stable and m.outcome == "unstable" and "diverged" in m.reason


def test_optuna_sees_constraints_and_no_failed_trials(tmp_path):
    import optuna

    storage = f"sqlite:///{tmp_path / 'study.db'}"
    runner = FakeRunner({"fp32": 100, "tf32": 40, "bf16-mixed": 20, "fp16-mixed": 21, "bf16-true": 15,
                         "fp16-true": 14, "fp8-torchao": 30}, unstable={"fp16-true"})
    tune(runner, storage=storage, study_name="s", remeasure=False, no_priors=True, trials=12)
    study = optuna.load_study(study_name="s", storage=storage)
    states = {t.state for t in study.trials}
    assert states == {optuna.trial.TrialState.COMPLETE}
    flagged = [t for t in study.trials if t.constraints.get("unstable", 0) > 0]
    assert flagged and all(t.params["mode"] == "fp16-true" for t in flagged)


def test_ties_go_to_the_safer_policy():
    # bf16-true is 1% faster than bf16-mixed: inside the noise, so the safer mixed mode wins.
    runner = FakeRunner({"fp32": 100, "tf32": 60, "bf16-mixed": 20.2, "fp16-mixed": 25, "bf16-true": 20.0,
                         "fp16-true": 26, "fp8-torchao": 40})
    result = tune(runner, remeasure=True)
    assert result.winner.mode == "bf16-mixed"
    assert "wins the tie" in result.tie_note


def test_unsupported_modes_are_never_asked_for():
    # A V100 has no bf16 tensor cores and no TF32: those modes must never run.
    runner = FakeRunner({"fp32": 100, "fp16-mixed": 30, "fp16-true": 28})
    result = tune(runner, profile=V100, remeasure=False, no_priors=True)
    asked = {p.mode for p in runner.calls}
    assert asked <= {"fp32", "fp16-mixed", "fp16-true"}
    assert "bf16-mixed" not in result.space.modes and "tf32" not in result.space.modes


def test_fp8_emulation_on_cpu_excluded_unless_asked():
    cpu = HardwareProfile(kind="cpu", name="cpu", cores=2, cpu_flags=("amx_bf16", "avx512_bf16"),
                          libraries=(("torchao", "0.18.0"),), torch_version="2.13.0")
    support = supported_modes(cpu)
    assert "fp8-torchao" not in space_for(support, 64).modes
    assert "fp8-torchao" in space_for(support, 64, include_emulated=True).modes


def test_memory_limit_makes_large_micro_batches_infeasible_and_accumulation_keeps_global_batch():
    # 100 MiB + 20 MiB per sample: the user's 64 needs 1.35 GiB; a 1 GiB limit fits 32 and 16.
    runner = FakeRunner({"fp32": 100, "tf32": 40, "bf16-mixed": 20, "fp16-mixed": 21, "bf16-true": 15,
                         "fp16-true": 14, "fp8-torchao": 30}, memory_per_sample=20 * 2**20)
    result = tune(runner, memory_limit=int(1.0 * 2**30), remeasure=False, no_priors=True, trials=60)
    assert result.winner is not None and result.winner.micro_batch == 32
    assert result.policy.micro_batch_size == 32 and result.policy.grad_accum_steps == 2
    assert any(m.oom for m in result.search.measured.values())


def test_priors_stop_early_when_nothing_left_can_win():
    # On a CPU without bf16 units the 16-bit dtypes run matmuls at ~2% of fp32: no trial needed.
    cpu = HardwareProfile(kind="cpu", name="cpu", cores=2, torch_version="2.13.0")
    runner = FakeRunner({"fp32": 10, "bf16-mixed": 200, "fp16-mixed": 300, "bf16-true": 190, "fp16-true": 290})
    result = tune(runner, profile=cpu, dtype_ratio={"fp32": 1.0, "bf16": 0.02, "fp16": 0.02}, remeasure=False)
    assert result.winner.mode == "fp32"
    assert len(runner.calls) == 1  # the reference only
    assert "no untried candidate can beat the best" in result.search.stop_reason


def test_search_costs_far_less_than_the_grid_and_finds_its_winner():
    speeds = {"fp32": 100, "tf32": 40, "bf16-mixed": 20, "fp16-mixed": 19, "bf16-true": 15, "fp16-true": 14,
              "fp8-torchao": 12}
    grid = tune(FakeRunner(speeds, unstable={"bf16-true", "fp16-true"}), no_priors=True, trials=500, remeasure=False)
    runner = FakeRunner(speeds, unstable={"bf16-true", "fp16-true"})
    tuned = tune(runner, remeasure=False)
    grid_best = grid.search.measured[grid.winner].goodput
    tuned_best = tuned.search.measured[tuned.winner].goodput
    assert tuned.winner.mode == grid.winner.mode
    assert 1 - tuned_best / grid_best <= 0.03  # regret
    assert len(runner.calls) <= 0.25 * len(grid.space.grid())


def test_resume_after_interruption_runs_nothing_twice(tmp_path):
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    speeds = {"fp32": 100, "tf32": 40, "bf16-mixed": 20, "fp16-mixed": 21, "bf16-true": 15, "fp16-true": 14,
              "fp8-torchao": 30}
    first = FakeRunner(speeds, interrupt_after=4)
    with pytest.raises(KeyboardInterrupt):
        tune(first, storage=storage, study_name="resume", no_priors=True, remeasure=False, trials=10)
    second = FakeRunner(speeds)
    result = tune(second, storage=storage, study_name="resume", resume=True, no_priors=True, remeasure=False, trials=10)
    ran_before = {p for p in first.calls[1:]}  # the reference is always re-run: it is the yardstick
    assert result.search.resumed == len(ran_before)
    assert not ran_before & set(second.calls[1:])


def test_upper_bound_priors():
    measured = {
        Candidate("fp32"): Measured(Candidate("fp32"), 100.0, True, True),
        Candidate("bf16-mixed", 64): Measured(Candidate("bf16-mixed", 64), 0.0, False, False, oom=True),
        Candidate("tf32"): Measured(Candidate("tf32"), 300.0, True, True),
    }
    kw = {"user_batch": 64, "reference_goodput": 100.0, "dtype_ratio": RATIOS}
    assert upper_bound(Candidate("bf16-mixed", 128), measured, **kw) == 0.0  # larger than an OOM
    assert upper_bound(Candidate("tf32", 32), measured, **kw) == pytest.approx(300.0)  # split of a measured mode
    assert upper_bound(Candidate("fp16-mixed"), measured, **kw) == pytest.approx(100 * 12 * 1.25)
    slow = {"fp32": 1.0, "bf16": 0.1}
    assert upper_bound(Candidate("bf16-true"), measured, user_batch=64, reference_goodput=100.0, dtype_ratio=slow) == 100.0


def test_a_script_whose_batch_is_unknown_still_has_its_modes_searched():
    # A script that never calls micro_batch_size() reports no batch: its modes are candidates at
    # its own batch, not an empty grid that leaves fp32 the winner untried.
    space = space_for(supported_modes(GPU), None)
    assert {c.mode for c in space.grid()} >= {"bf16-mixed", "fp16-mixed", "bf16-true"}
    assert all(c.micro_batch is None for c in space.grid())

    class Unbatched(FakeRunner):
        def __call__(self, policy, label):
            result = super().__call__(policy, label)
            return dataclasses.replace(result, user_batch=None)  # samples still counted (to_device)

    result = tune(Unbatched({"fp32": 100, "tf32": 40, "bf16-mixed": 20, "fp16-mixed": 21, "bf16-true": 15,
                             "fp16-true": 16, "fp8-torchao": 30}), remeasure=False)
    assert result.winner.mode == "bf16-true"
