"""The tuner: the fp32 reference, the search, the interleaved re-measurement of close
candidates, and the winner with its evidence."""

from __future__ import annotations

import datetime as dt
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import probes
from advisor.tune._checks import check_modes
from advisor.tune._options import TuneOptions
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
    ratios = {}
    for row in probes.matmul_benchmark(profile):
        if row.skipped is None and row.ratio_vs_fp32:
            ratios[row.dtype] = float(row.ratio_vs_fp32)
    ratios["fp32"] = 1.0
    return ratios


def tune_policy(
    runner: Runner,
    profile: HardwareProfile,
    options: TuneOptions | None = None,
    *,
    study_name: str = "mpadvise",
    thresholds: StabilityThresholds | None = None,
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
        options: the tune's options (defaults when ``None``). The tuner reads ``trials``
            (the reference and re-measurements not counted), ``time_budget``, ``scale_batch``,
            ``include_emulated``, ``modes``, ``memory_limit`` (candidates over it are
            infeasible), ``storage`` and ``resume`` (where the Optuna study lives), ``seed``
            (of the sampler) and ``no_priors``; the runner has the measuring window already.
        study_name: the study's name in that storage.
        thresholds: stability thresholds.
        dtype_ratio: matmul ratios per dtype; measured on the device when ``None``.
        remeasure: re-measure close candidates interleaved before declaring a winner.
        workload: extra facts recorded in the winner's ``[tuned_on]`` (script name).
        on_start, on_done: progress callbacks.
        clock: monotonic seconds (tests pass a fake).

    Raises:
        MpadviseError: the fp32 reference failed, so nothing can be judged.
    """
    options = options or TuneOptions()
    clock = clock or time.monotonic
    start = clock()
    trials = _Trials(runner, thresholds or StabilityThresholds(), options.memory_limit_bytes, on_start, on_done)
    reference = trials.run_reference()
    user_batch = trials.user_batch
    space = _space(profile, options, user_batch)
    if dtype_ratio is not None:
        ratios = dtype_ratio
    else:  # the priors need the matmul ratios; without priors the benchmark is not worth its seconds
        ratios = {} if options.no_priors else measure_dtype_ratios(profile)
    ref_cand = space.normalise(Candidate("fp32", user_batch))
    ref_measured = trials.record(ref_cand, Policy(mode="fp32"), trials.reference)
    search = run_search(
        space, trials.run, options, first=_first_candidates(space, profile, ref_cand),
        reference_goodput=reference.goodput or 0.0, dtype_ratio=ratios, study_name=study_name,
        known={ref_cand: ref_measured}, clock=clock,
    )
    finalists = _finalists(search.measured, trials.evaluations, user_batch)
    if remeasure and len(finalists) > 1:
        finalists = trials.remeasure(finalists)
    winner, tie_note = _pick_winner(finalists, user_batch)
    policy = None
    if winner is not None:
        best = next(f for f in finalists if f.candidate == winner)
        policy = _tuned_policy(winner, best, trials, reference, profile, workload, search.runs + search.resumed)
    return TuneResult(reference, space, search, trials.evaluations, finalists, winner, policy, tie_note,
                      _scale_batch_note(winner, user_batch), ratios, clock() - start)


@dataclass
class _Trials:
    """Runs candidates and judges each against the fp32 reference, keeping every evaluation."""

    runner: Runner
    thresholds: StabilityThresholds
    memory_limit: int | None
    on_start: Callable[[str], None] | None
    on_done: Callable[[str, Evaluation | None, Measured], None] | None
    evaluations: dict[Candidate, Evaluation] = field(default_factory=dict)
    reference: TrialResult | None = None

    @property
    def user_batch(self) -> int | None:
        return None if self.reference is None else self.reference.user_batch

    def run_reference(self) -> Evaluation:
        """Run fp32, the baseline every candidate is judged against.

        Raises:
            MpadviseError: the reference failed or is not finite.
        """
        if self.on_start:
            self.on_start("fp32 (reference)")
        result = self.runner(Policy(mode="fp32"), "fp32")
        check_reference(result)
        self.reference = result
        return evaluate("fp32", Policy(mode="fp32"), result, result, thresholds=self.thresholds)

    def run(self, cand: Candidate) -> Measured:
        """Run one candidate of the search and record its evaluation."""
        policy = cand.policy(self.user_batch)
        if self.on_start:
            self.on_start(cand.label)
        return self.record(cand, policy, self.runner(policy, cand.label))

    def record(self, cand: Candidate, policy: Policy, result: TrialResult) -> Measured:
        """Judge a result (the memory limit too), keep its evaluation, and report it."""
        if (self.memory_limit is not None and result.outcome == "ok" and result.peak_memory
                and result.peak_memory > self.memory_limit):
            result = result.with_outcome(
                "oom", f"peak memory {result.peak_memory / 2**20:.0f} MiB exceeds the limit {self.memory_limit / 2**20:.0f} MiB"
            )
        ev = evaluate(cand.label, policy, result, self.reference, thresholds=self.thresholds)
        m = Measured(cand, ev.goodput or 0.0, feasible=ev.result.outcome == "ok", stable=ev.stable,
                     oom=ev.result.outcome == "oom", outcome=ev.outcome, reason=ev.reason)
        self.evaluations[cand] = ev
        if self.on_done:
            self.on_done(cand.label, ev, m)
        return m

    def remeasure(self, finalists: list[Finalist]) -> list[Finalist]:
        """Run each close finalist again, alternating between them, so noise hits them alike."""
        for round_ in range(REMEASURE_ROUNDS):
            order = finalists if round_ % 2 == 0 else list(reversed(finalists))
            for f in order:
                self._remeasure_one(f, f"{f.candidate.label} (re-measure {round_ + 1})")
        return sorted(finalists, key=lambda f: -f.goodput)

    def _remeasure_one(self, finalist: Finalist, label: str) -> None:
        if self.on_start:
            self.on_start(label)
        policy = finalist.candidate.policy(self.user_batch)
        result = self.runner(policy, label)
        ev = evaluate(label, policy, result, self.reference, thresholds=self.thresholds)
        if ev.stable and ev.goodput:
            finalist.goodputs.append(ev.goodput)
            finalist.per_sample_times.extend(_per_sample_times(result))
        if self.on_done:
            self.on_done(label, ev, Measured(finalist.candidate, ev.goodput or 0.0, ev.result.outcome == "ok",
                                             ev.stable, outcome=ev.outcome, reason=ev.reason))


def _space(profile: HardwareProfile, options: TuneOptions, user_batch: int | None) -> SearchSpace:
    """The candidates this hardware supports, narrowed to the options' modes."""
    support = supported_modes(profile)
    modes = check_modes(list(options.modes), profile) if options.modes else None  # unknown or unsupported: one clear error
    return space_for(support, user_batch, include_emulated=options.include_emulated,
                     scale_batch=options.scale_batch, modes=modes)


def _first_candidates(space: SearchSpace, profile: HardwareProfile, ref_cand: Candidate) -> list[Candidate]:
    """The reference and the hardware's safe default first, then each other mode's default
    settings, safest first: every mode gets one honest look before TPE explores variants."""
    default_mode, _ = safe_default_mode(profile)
    return [ref_cand] + [
        space.normalise(Candidate(m, space.user_batch))
        for m in sorted(space.modes, key=lambda m: (m != default_mode, safety_rank(m)))
    ]


def _tuned_policy(winner: Candidate, best: Finalist, trials: _Trials, reference: Evaluation,
                  profile: HardwareProfile, workload: dict[str, Any] | None, trial_count: int) -> Policy:
    """The winner's policy with its ``[tuned_on]`` record: hardware, versions, evidence."""
    ev = trials.evaluations.get(winner)
    measured = ev.result if ev else trials.reference
    return winner.policy(trials.user_batch).with_(tuned_on=TunedOn(
        hardware_fingerprint=hardware_fingerprint(profile),
        device=profile.name,
        torch=profile.torch_version or "",
        libraries=profile.libraries,
        date=dt.date.today().isoformat(),
        speedup_vs_fp32=round(best.goodput / reference.goodput, 4) if reference.goodput else None,
        goodput=round(best.goodput, 3),
        workload_fingerprint=measured.workload_fingerprint,
        model_signature=measured.model_signature,
        script=(workload or {}).get("script"),
        trials=trial_count,
    ))


def _scale_batch_note(winner: Candidate | None, user_batch: int | None) -> str:
    """A warning when the winner changes the global batch (``scale_batch``), else empty."""
    if winner is None or not winner.micro_batch or not user_batch or winner.micro_batch <= user_batch:
        return ""
    return (f"the winner uses a global batch of {winner.micro_batch} instead of {user_batch}: this changes "
            "the optimisation (learning-rate and convergence may need retuning)")


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
