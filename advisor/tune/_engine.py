"""The tuner: the fp32 reference, the search, the interleaved re-measurement of close
candidates, and the winner with its evidence."""

from __future__ import annotations

import datetime as dt
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from advisor.tune._checks import check_modes
from advisor.tune._search import SearchOutcome, run_search
from advisor.tune._space import Candidate, Measured, SearchSpace, preference_key, space_for
from advisor.tune._stability import StabilityThresholds, safety_rank
from advisor.tune._timing import DEFAULT_MIN_MARGIN, compare, noise_band, summarize
from advisor.tune._trials import Evaluation, Runner, check_reference, evaluate, samples_per_step
from policies import Policy, TunedOn, safe_default_mode, supported_modes
from probes import HardwareProfile, hardware_fingerprint
from probes._trial import TrialResult

REMEASURE_MAX = 3  # finalists re-measured side by side
REMEASURE_ROUNDS = 2  # extra runs of each finalist, interleaved


@dataclass
class Finalist:
    """A candidate re-measured side by side with the others before a winner is declared."""

    candidate: Candidate
    goodputs: list[float]
    per_sample_times: list[float]

    @property
    def goodput(self) -> float:
        return statistics.median(self.goodputs)


@dataclass
class TuneResult:
    """Everything a tune measured and decided."""

    reference: Evaluation
    space: SearchSpace
    search: SearchOutcome
    evaluations: dict[Candidate, Evaluation]
    finalists: list[Finalist]
    winner: Candidate | None
    policy: Policy | None
    tie_note: str = ""
    scale_batch_note: str = ""
    dtype_ratio: dict[str, float] = field(default_factory=dict)
    wall_s: float = 0.0

    @property
    def winner_speedup(self) -> float | None:
        if self.winner is None:
            return None
        ref = self.reference.goodput or 0.0
        for f in self.finalists:
            if f.candidate == self.winner and ref:
                return f.goodput / ref
        m = self.search.measured.get(self.winner)
        return m.goodput / ref if m and ref else None

    def ranking(self) -> list[tuple[Candidate, Measured]]:
        """Measured candidates, stable and feasible first, by goodput."""
        return sorted(
            self.search.measured.items(),
            key=lambda item: (not (item[1].stable and item[1].feasible), -item[1].goodput),
        )

    def to_dict(self) -> dict[str, Any]:
        rows = []
        ref_good = self.reference.goodput or 0.0
        for cand, m in self.ranking():
            ev = self.evaluations.get(cand)
            rows.append({
                "label": cand.label,
                "mode": cand.mode,
                "policy": cand.policy(self.space.user_batch).to_dict(),
                "outcome": m.outcome or ("ok" if m.stable else "unstable"),
                "stable": m.stable,
                "feasible": m.feasible,
                "goodput": m.goodput,
                "speedup_vs_fp32": m.goodput / ref_good if ref_good else None,
                "peak_memory": ev.result.peak_memory if ev else None,
                "reason": m.reason,
                "winner": cand == self.winner,
            })
        return {
            "winner": None if self.policy is None else self.policy.to_dict(),
            "winner_label": None if self.winner is None else self.winner.label,
            "speedup_vs_fp32": self.winner_speedup,
            "tie_note": self.tie_note,
            "scale_batch_note": self.scale_batch_note,
            "user_batch": self.space.user_batch,
            "space": {"modes": list(self.space.modes), "micro_batches": list(self.space.micro_batches),
                      "grid_size": len(self.space.grid())},
            "trials_run": self.search.runs,
            "trials_resumed": self.search.resumed,
            "stop_reason": self.search.stop_reason,
            "matmul_ratio_vs_fp32": self.dtype_ratio,
            "finalists": [{"label": f.candidate.label, "goodputs": f.goodputs, "goodput": f.goodput} for f in self.finalists],
            "reference": self.reference.to_dict(),
            "candidates": rows,
            "wall_s": self.wall_s,
        }


def measure_dtype_ratios(profile: HardwareProfile) -> dict[str, float]:
    """Matmul TFLOP/s per dtype relative to fp32 on this device: the search's priors."""
    import probes

    ratios = {}
    for row in probes.matmul_benchmark(profile):
        if row.skipped is None and row.ratio_vs_fp32:
            ratios[row.dtype] = float(row.ratio_vs_fp32)
    ratios["fp32"] = 1.0
    return ratios


def tune_policy(
    runner: Runner,
    profile: HardwareProfile,
    *,
    trials: int | None = 20,
    time_budget: float | None = None,
    scale_batch: bool = False,
    include_emulated: bool = False,
    modes: list[str] | None = None,
    memory_limit: int | None = None,
    storage: str | None = None,
    study_name: str = "mpadvise",
    resume: bool = False,
    seed: int = 0,
    thresholds: StabilityThresholds | None = None,
    use_priors: bool = True,
    dtype_ratio: dict[str, float] | None = None,
    remeasure: bool = True,
    workload: dict[str, Any] | None = None,
    on_start: Callable[[str], None] | None = None,
    on_done: Callable[[str, Evaluation | None, Measured], None] | None = None,
    clock: Callable[[], float] | None = None,
) -> TuneResult:
    """Find the fastest stable policy for the workload that ``runner`` runs.

    Args:
        runner: runs one candidate Policy (subprocess script trials, or a function in-process).
        profile: the hardware the trials run on; decides the search space.
        trials: trial budget for the search (the reference and re-measurements not counted).
        time_budget: seconds after which no new trial starts.
        scale_batch: also try micro-batches above the script's batch (changes the global batch).
        include_emulated: search FP8 emulated on a CPU too.
        modes: restrict the search to these modes.
        memory_limit: bytes; candidates over it are infeasible.
        storage, study_name, resume: where the Optuna study lives, for ``--resume``.
        seed: seed of every trial and of the sampler.
        thresholds: stability thresholds.
        use_priors: stop early when no untried candidate can beat the best.
        dtype_ratio: matmul ratios per dtype; measured on the device when ``None``.
        remeasure: re-measure close candidates interleaved before declaring a winner.
        workload: extra facts recorded in the winner's ``[tuned_on]`` (script name).
        on_start, on_done: progress callbacks.

    Raises:
        MpadviseError: the fp32 reference failed, so nothing can be judged.
    """
    import time

    clock = clock or time.monotonic
    start = clock()
    thresholds = thresholds or StabilityThresholds()
    if on_start:
        on_start("fp32 (reference)")
    ref_result = runner(Policy(mode="fp32"), "fp32")
    check_reference(ref_result)
    reference = evaluate("fp32", Policy(mode="fp32"), ref_result, ref_result, thresholds=thresholds)
    user_batch = ref_result.user_batch
    support = supported_modes(profile)
    if modes:
        modes = check_modes(modes, profile)  # unknown or unsupported: one clear error
    space = space_for(support, user_batch, include_emulated=include_emulated, scale_batch=scale_batch, modes=modes)
    if dtype_ratio is not None:
        ratios = dtype_ratio
    else:  # the priors need the matmul ratios; without priors the benchmark is not worth its seconds
        ratios = measure_dtype_ratios(profile) if use_priors else {}
    evaluations: dict[Candidate, Evaluation] = {}

    def judge_result(cand: Candidate, policy: Policy, result: TrialResult) -> tuple[Evaluation, Measured]:
        if memory_limit is not None and result.outcome == "ok" and result.peak_memory and result.peak_memory > memory_limit:
            result = result.with_outcome(
                "oom", f"peak memory {result.peak_memory / 2**20:.0f} MiB exceeds the limit {memory_limit / 2**20:.0f} MiB"
            )
        ev = evaluate(cand.label, policy, result, ref_result, thresholds=thresholds)
        m = Measured(cand, ev.goodput or 0.0, feasible=ev.result.outcome == "ok", stable=ev.stable,
                     oom=ev.result.outcome == "oom", outcome=ev.outcome, reason=ev.reason)
        return ev, m

    ref_cand = space.normalise(Candidate("fp32", user_batch))
    ev, ref_measured = judge_result(ref_cand, Policy(mode="fp32"), ref_result)
    evaluations[ref_cand] = ev
    if on_done:
        on_done(ref_cand.label, ev, ref_measured)

    def run_candidate(cand: Candidate) -> Measured:
        policy = cand.policy(user_batch)
        if on_start:
            on_start(cand.label)
        ev, m = judge_result(cand, policy, runner(policy, cand.label))
        evaluations[cand] = ev
        if on_done:
            on_done(cand.label, ev, m)
        return m

    default_mode, _ = safe_default_mode(profile)
    # The reference and the hardware's safe default first, then each other mode's default
    # settings, safest first: every mode gets one honest look before TPE explores variants.
    first = [ref_cand] + [
        space.normalise(Candidate(m, user_batch))
        for m in sorted(space.modes, key=lambda m: (m != default_mode, safety_rank(m)))
    ]
    search = run_search(
        space, run_candidate, first=first, reference_goodput=reference.goodput or 0.0, dtype_ratio=ratios,
        max_trials=trials, time_budget=time_budget, storage=storage, study_name=study_name, resume=resume,
        seed=seed, use_priors=use_priors, known={ref_cand: ref_measured}, clock=clock,
    )
    finalists = _finalists(search.measured, evaluations, user_batch)
    if remeasure and len(finalists) > 1:
        finalists = _remeasure(finalists, runner, user_batch, ref_result, thresholds, on_start, on_done)
    winner, tie_note = _pick_winner(finalists, user_batch)
    policy = None
    if winner is not None:
        policy = winner.policy(user_batch)
        best = next(f for f in finalists if f.candidate == winner)
        ev = evaluations.get(winner)
        policy = policy.with_(tuned_on=TunedOn(
            hardware_fingerprint=hardware_fingerprint(profile),
            device=profile.name,
            torch=profile.torch_version or "",
            libraries=profile.libraries,
            date=dt.date.today().isoformat(),
            speedup_vs_fp32=round(best.goodput / reference.goodput, 4) if reference.goodput else None,
            goodput=round(best.goodput, 3),
            workload_fingerprint=ev.result.workload_fingerprint if ev else ref_result.workload_fingerprint,
            model_signature=ev.result.model_signature if ev else ref_result.model_signature,
            script=(workload or {}).get("script"),
            trials=search.runs + search.resumed,
        ))
    scale_note = ""
    if winner is not None and winner.micro_batch and user_batch and winner.micro_batch > user_batch:
        scale_note = (f"the winner uses a global batch of {winner.micro_batch} instead of {user_batch}: this changes "
                      "the optimisation (learning-rate and convergence may need retuning)")
    return TuneResult(reference, space, search, evaluations, finalists, winner, policy, tie_note, scale_note,
                      ratios, clock() - start)


def _finalists(
    measured: dict[Candidate, Measured], evaluations: dict[Candidate, Evaluation], user_batch: int | None
) -> list[Finalist]:
    """Stable, feasible candidates within measured noise of the best, best first."""
    stable = [m for m in measured.values() if m.stable and m.feasible and m.goodput > 0]
    if not stable:
        return []
    stable.sort(key=lambda m: (-m.goodput, preference_key(m.candidate, user_batch)))
    best = stable[0]
    best_ev = evaluations.get(best.candidate)
    out = []
    for m in stable[:REMEASURE_MAX]:
        ev = evaluations.get(m.candidate)
        per_sample = _per_sample_times(ev.result) if ev else []
        noise = DEFAULT_MIN_MARGIN
        if ev and best_ev and ev.timing and best_ev.timing:
            noise = noise_band(ev.timing, best_ev.timing)
        if m is best or m.goodput * (1 + noise) >= best.goodput:
            out.append(Finalist(m.candidate, [m.goodput], per_sample))
    return out


def _per_sample_times(result: TrialResult) -> list[float]:
    samples = samples_per_step(result) or 1
    warm = min(result.warmup_steps, max(0, len(result.step_times) - 1))
    return [t / samples for t in result.step_times[warm:]]


def _remeasure(finalists, runner, user_batch, ref_result, thresholds, on_start, on_done) -> list[Finalist]:
    """Run each close finalist again, alternating between them, so noise hits them alike."""
    for round_ in range(REMEASURE_ROUNDS):
        order = finalists if round_ % 2 == 0 else list(reversed(finalists))
        for f in order:
            label = f"{f.candidate.label} (re-measure {round_ + 1})"
            if on_start:
                on_start(label)
            policy = f.candidate.policy(user_batch)
            result = runner(policy, label)
            ev = evaluate(label, policy, result, ref_result, thresholds=thresholds)
            if ev.stable and ev.goodput:
                f.goodputs.append(ev.goodput)
                f.per_sample_times.extend(_per_sample_times(result))
            if on_done:
                on_done(label, ev, Measured(f.candidate, ev.goodput or 0.0, ev.result.outcome == "ok", ev.stable,
                                            outcome=ev.outcome, reason=ev.reason))
    return sorted(finalists, key=lambda f: -f.goodput)


def _pick_winner(finalists: list[Finalist], user_batch: int | None) -> tuple[Candidate | None, str]:
    """The fastest finalist, unless a safer one is within the measured noise (ties go to safety)."""
    if not finalists:
        return None, ""
    fastest = max(finalists, key=lambda f: f.goodput)
    tied = [fastest]
    for f in finalists:
        if f is fastest or not f.per_sample_times or not fastest.per_sample_times:
            continue
        cmp = compare(summarize(fastest.per_sample_times, 0), summarize(f.per_sample_times, 0))
        if cmp.verdict != "faster":  # fastest is not faster than f beyond the noise
            tied.append(f)
    winner = min(tied, key=lambda f: preference_key(f.candidate, user_batch))
    note = ""
    if winner is not fastest:
        note = (f"{fastest.candidate.label} measured {fastest.goodput / winner.goodput:.2f}x of "
                f"{winner.candidate.label}, within the noise: the safer {winner.candidate.label} wins the tie")
    return winner.candidate, note
