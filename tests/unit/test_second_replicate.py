"""A narrow stall is judged again against a second replicate of fp32, perturbed by another draw.

One replicate is one draw of how far a chaotic run strays from fp32. Where it comes out small, a
stable candidate falls just short of the limit it sets and is called stalled. A stall that eight
times the measured spread would forgive runs a second replicate (once per window, shared by every
candidate) and is stable if either replicate's spread allows it. A stall far beyond the spread
runs nothing more. Fake runners, no processes.
"""

from __future__ import annotations

import pytest

from advisor.trial import TrialResult
from advisor.trial._step_window import perturbation_seed
from advisor.tune._engine import tune_policy
from advisor.tune._options import TuneOptions
from advisor.tune._trials import Replicate, run_comparison
from policies import Policy
from probes import HardwareProfile

STEPS = 60
CPU = HardwareProfile(kind="cpu", name="cpu", cores=2, cpu_flags=("avx2",), torch_version="2.13.0")

# fp32 falls 2.0 -> 1.9. The first replicate's fall differs by 0.005 (a progress spread of 5%: the
# limit stays at the fixed 90%), the second's by 0.02 (20%: the limit widens to 60%).
REPLICATE_END = {0: 1.905, 1: 1.92}


def _result(policy: Policy, label: str, losses: list[float]) -> TrialResult:
    n = len(losses)
    return TrialResult(
        outcome="ok", reason="", label=label, policy=policy.to_dict(), losses=tuple(losses),
        step_times=(0.01,) * n, samples=(64,) * n, skipped=(False,) * n, warmup_steps=3, user_batch=64,
        global_batch=64, workload_fingerprint="ab" * 8, model_signature="cd" * 8, wall_s=1.0,
    )


class Runner:
    """fp32 and each mode fall linearly from 2.0 to ``ends[mode]``; a replicate to its draw's end."""

    def __init__(self, ends: dict[str, float], *, replicate_end: dict[int, float] | None = None,
                 calls: list[tuple[str, int | None]] | None = None, perturb: str | None = None,
                 draw: int = 0) -> None:
        self.seed, self.measure_steps = 0, STEPS
        self.ends, self.replicate_end = ends, replicate_end or REPLICATE_END
        self.calls = [] if calls is None else calls
        self.perturb, self.draw = perturb, draw

    def perturbed(self, perturb: str, draw: int = 0) -> Runner:
        return Runner(self.ends, replicate_end=self.replicate_end, calls=self.calls, perturb=perturb, draw=draw)

    def __call__(self, policy: Policy, label: str) -> TrialResult:
        self.calls.append((policy.mode, self.draw if self.perturb else None))
        end = self.replicate_end[self.draw] if self.perturb else self.ends.get(policy.mode, 1.9)
        return _result(policy, label, [2.0 + (end - 2.0) * i / (STEPS - 1) for i in range(STEPS)])


def _compare(runner: Runner, modes: list[str]):
    return run_comparison(runner, [(Policy(mode=m), m) for m in modes])


def test_a_narrow_stall_is_judged_again_against_a_second_replicate() -> None:
    # bf16-mixed fell 85% as far as fp32: short of the first replicate's 90%, within the second's 60%.
    runner = Runner({"fp32": 1.9, "bf16-mixed": 1.915})
    started: list[str] = []
    comparison = run_comparison(runner, [(Policy(mode="bf16-mixed"), "bf16-mixed")],
                                on_start=lambda i, label: started.append(label))
    (ev,) = comparison.evaluations
    assert ev.stable and ev.verdict.kind == "ok", ev.reason
    assert ev.verdict.metrics["replicates"] == 2
    assert ev.verdict.metrics["progress_limit"] == pytest.approx(0.6)
    assert "judged against fp32 (replicate 2, bf16-perturbed)" in ev.reason
    assert "it was stalled" in ev.reason
    assert runner.calls.count(("fp32", 1)) == 1
    assert "fp32 (replicate 2, bf16-perturbed)" in started


def test_a_stall_far_beyond_the_spread_runs_no_second_replicate() -> None:
    # 10% of fp32's fall: even eight times the first replicate's spread (a 20% limit) would not allow it.
    runner = Runner({"fp32": 1.9, "fp16-mixed": 1.99})
    (ev,) = _compare(runner, ["fp16-mixed"]).evaluations
    assert ev.verdict.kind == "stalled" and "replicates" not in ev.verdict.metrics
    assert ("fp32", 1) not in runner.calls


def test_a_stall_the_second_replicate_does_not_forgive_stays_a_stall() -> None:
    runner = Runner({"fp32": 1.9, "bf16-mixed": 1.915}, replicate_end={0: 1.905, 1: 1.9})
    (ev,) = _compare(runner, ["bf16-mixed"]).evaluations
    assert ev.verdict.kind == "stalled" and ev.verdict.metrics["replicates"] == 2
    assert "fp32 (replicate 2, bf16-perturbed) strayed no further than that allows" in ev.reason
    assert ev.verdict.metrics["progress_limit"] == pytest.approx(0.9)  # the first replicate's verdict


def test_the_second_replicate_runs_once_for_every_candidate() -> None:
    runner = Runner({"fp32": 1.9, "bf16-mixed": 1.915, "bf16-true": 1.916})
    evaluations = _compare(runner, ["bf16-mixed", "bf16-true"]).evaluations
    assert all(ev.stable for ev in evaluations)
    assert runner.calls.count(("fp32", 1)) == 1 and runner.calls.count(("fp32", 0)) == 1


def test_a_stable_candidate_runs_no_second_replicate() -> None:
    runner = Runner({"fp32": 1.9, "bf16-mixed": 1.901})
    (ev,) = _compare(runner, ["bf16-mixed"]).evaluations
    assert ev.stable and "replicates" not in ev.verdict.metrics and ("fp32", 1) not in runner.calls


def test_a_tune_keeps_a_narrow_stall_as_a_candidate() -> None:
    # Before the second look, the tune dropped bf16-mixed as stalled and chose fp32.
    runner = Runner({"fp32": 1.9, "bf16-mixed": 1.915})
    options = TuneOptions(trials=3, no_priors=True, modes=("bf16-mixed",))
    result = tune_policy(runner, CPU, options, study_name="second", dtype_ratio={"fp32": 1.0, "bf16": 2.0},
                         remeasure=False)
    judged = {ev.label: ev for ev in result.evaluations.values()}
    bf16 = next(ev for label, ev in judged.items() if label.startswith("bf16-mixed"))
    assert bf16.stable and bf16.verdict.metrics["replicates"] == 2
    assert runner.calls.count(("fp32", 1)) == 1


def test_a_re_measurement_judges_a_narrow_stall_again_too() -> None:
    # The search's trial and every re-measurement of the same curve: none is dropped as stalled.
    runner = Runner({"fp32": 1.9, "bf16-mixed": 1.915})
    options = TuneOptions(trials=3, no_priors=True, modes=("bf16-mixed",))
    result = tune_policy(runner, CPU, options, study_name="again", dtype_ratio={"fp32": 1.0, "bf16": 2.0})
    assert result.remeasure_rounds > 0 and not result.dropped
    assert any(f.candidate.mode == "bf16-mixed" for f in result.finalists)
    assert runner.calls.count(("fp32", 1)) == 1


def test_the_draw_is_kept_with_a_stored_replicate() -> None:
    second = Replicate(seed=3, losses=(1.0, 0.9), draw=1)
    assert second.label == "fp32 (replicate 2, bf16-perturbed)"
    assert Replicate.from_dict(second.to_dict()) == second
    old = {k: v for k, v in Replicate(seed=3, losses=(1.0, 0.9)).to_dict().items() if k != "draw"}
    assert Replicate.from_dict(old).draw == 0  # stored before draws had a number


def test_each_draw_perturbs_with_its_own_seed() -> None:
    assert perturbation_seed(5, 0) == 5  # the first replicate is perturbed as before
    assert len({perturbation_seed(5, d) for d in range(4)}) == 4
    with pytest.raises(ValueError, match="whole number"):
        perturbation_seed(5, -1)
