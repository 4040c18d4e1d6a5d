"""The tuner: the fp32 reference, the search, the interleaved re-measurement of close
candidates until their gaps are resolved, and the winner with its evidence."""

from __future__ import annotations

import datetime as dt
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import probes
from advisor.runtime._workload import script_digest
from advisor.tune._checks import check_modes
from advisor.tune._options import TuneOptions
from advisor.tune._search import SearchOutcome, run_search, stored_replicate
from advisor.tune._space import (
    Candidate,
    Measured,
    SearchSpace,
    SpaceLimits,
    preference_key,
    space_for,
)
from advisor.tune._stability import StabilityThresholds, TrialCurve, safety_rank
from advisor.tune._timing import DEFAULT_MIN_MARGIN, Gap, compare, noise_band, paired_gap, summarize
from advisor.tune._trials import (
    Evaluation,
    Replicate,
    Runner,
    check_reference,
    evaluate,
    run_replicate,
    samples_per_step,
)
from policies import Policy, TunedOn, safe_default_mode, supported_modes
from probes import HardwareProfile, hardware_fingerprint
from probes._trial import TrialResult

# Rounds of interleaved re-measurement before a gap still unresolved is called a tie. Two pairs
# give the first interval. With runs as scattered as on the shared 2-core build machine (7%
# between runs), a 19% gap is resolved within 10 rounds in 98 of 100 simulated tunes (94 within
# 8); a true tie on a noisy machine costs all 10, on a quiet GPU two or three.
REMEASURE_MAX_ROUNDS = 10


@dataclass
class Finalist:
    """A candidate re-measured side by side with the others before a winner is declared.

    Attributes:
        candidate: the candidate.
        goodputs: its goodput in the search's run, then in each re-measurement.
        per_sample_times: seconds per sample of its measured steps (the tie rule when nothing
            was re-measured).
        rounds: its goodput in each round of re-measurement; ``None`` in a round it sat out.
        gap: once re-measured, the leader's gap over it; ``None`` for the leader.
    """

    candidate: Candidate
    goodputs: list[float]
    per_sample_times: list[float]
    rounds: list[float | None] = field(default_factory=list)
    gap: Gap | None = None

    @property
    def goodput(self) -> float:
        return statistics.median(self.goodputs)

    @property
    def remeasured_goodput(self) -> float:
        """The median over its re-measurement rounds (the search's run when there are none)."""
        runs = [g for g in self.rounds if g is not None]
        return statistics.median(runs) if runs else self.goodput

    def to_dict(self) -> dict[str, Any]:
        return {"label": self.candidate.label, "goodputs": self.goodputs, "goodput": self.goodput,
                "rounds": self.rounds, "gap_vs_leader": None if self.gap is None else self.gap.to_dict()}


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
    dropped: list[Measured] = field(default_factory=list)  # finalists whose re-measurement failed
    remeasure_rounds: int = 0
    replicate: Replicate | None = None  # fp32 under another seed: the spread the verdicts allow

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

    def decisive_gap(self) -> dict[str, Any] | None:
        """The re-measured gap the choice rests on: the leader's over the winner when a safer
        finalist won a tie; else over the closest of the safer finalists it beat (the closest
        rival when none is safer); ``None`` when nothing was re-measured."""
        rivals = [f for f in self.finalists if f.gap is not None]
        leader = next((f for f in self.finalists if f.gap is None), None)
        if not rivals or leader is None:
            return None
        other = next((f for f in rivals if f.candidate == self.winner), None)
        if other is None:
            safer = [f for f in rivals if preference_key(f.candidate, self.space.user_batch)
                     < preference_key(leader.candidate, self.space.user_batch)]
            other = min(safer or rivals, key=lambda f: f.gap.ratio if f.gap else math.inf)
        gap = other.gap.to_dict() if other.gap else {}
        return {"between": [leader.candidate.label, other.candidate.label], **gap}

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
                      "fsdp": self.space.fsdp, "grid_size": len(self.space.grid())},
            "trials_run": self.search.runs,
            "trials_resumed": self.search.resumed,
            "stop_reason": self.search.stop_reason,
            "matmul_ratio_vs_fp32": self.dtype_ratio,
            "finalists": [f.to_dict() for f in self.finalists],
            "remeasure_rounds": self.remeasure_rounds,
            "gap": self.decisive_gap(),
            "dropped_finalists": [{"label": m.candidate.label, "outcome": m.outcome, "reason": m.reason}
                                  for m in self.dropped],
            "pruned": [{"label": cand.label, "mode": cand.mode, "policy": cand.policy(self.space.user_batch).to_dict(),
                        "outcome": "pruned", "reason": reason} for cand, reason in self.search.pruned.items()],
            "reference": self.reference.to_dict(),
            "replicate": None if self.replicate is None else self.replicate.to_dict(losses=False),
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
    limits: SpaceLimits | None = None,
) -> TuneResult:
    """Find the fastest stable policy for the workload that ``runner`` runs.

    Args:
        runner: runs one candidate Policy (subprocess script trials, or a function in-process);
            one that can change its seed (``Reseedable``) also runs fp32's replicate, whose
            run-to-run spread widens the stability limits.
        profile: the hardware the trials run on; decides the search space.
        options: the tune's options (defaults when ``None``). The tuner reads ``trials``
            (the reference and re-measurements not counted), ``time_budget``, ``scale_batch``,
            ``include_emulated``, ``modes``, ``memory_limit`` (candidates over it are
            infeasible), ``storage`` and ``resume`` (where the Optuna study lives), ``seed``
            (of the sampler) and ``no_priors``; the runner has the measuring window already.
        study_name: the study's name in that storage.
        thresholds: stability thresholds.
        dtype_ratio: matmul ratios per dtype; measured on the device when ``None``.
        remeasure: re-measure close candidates interleaved, until their gaps are resolved,
            before declaring a winner.
        workload: extra facts recorded in the winner's ``[tuned_on]`` (script name).
        on_start, on_done: progress callbacks.
        clock: monotonic seconds (tests pass a fake).
        limits: what the script's way of training can apply (a framework's limits); the
            search never proposes anything outside them.

    Raises:
        MpadviseError: the fp32 reference failed, so nothing can be judged.
    """
    options = options or TuneOptions()
    clock = clock or time.monotonic
    start = clock()
    trials = _Trials(runner, thresholds or StabilityThresholds(), options.memory_limit_bytes, on_start, on_done)
    reference = trials.run_reference()
    user_batch = trials.user_batch
    # A script that shards with FSDP2 said so in its reference trial: the gradient reduction
    # dtype joins the space.
    space = _space(profile, options, user_batch, limits, fsdp=reference.result.fsdp)
    if dtype_ratio is not None:
        ratios = dtype_ratio
    else:  # the priors need the matmul ratios; without priors the benchmark is not worth its seconds
        ratios = {} if options.no_priors else measure_dtype_ratios(profile)
    ref_cand = space.normalise(Candidate("fp32", user_batch))
    ref_measured = trials.record(ref_cand, Policy(mode="fp32"), trials.reference)
    # fp32 under another seed, kept with a stored study (which --resume reuses): its spread
    # calibrates every verdict from here on.
    reference = trials.run_replicate(stored_replicate(options.storage, study_name) if options.resume else None)
    search = run_search(
        space, trials.run, options, first=_first_candidates(space, profile, ref_cand),
        reference_goodput=reference.goodput or 0.0, dtype_ratio=ratios, study_name=study_name,
        known={ref_cand: ref_measured}, clock=clock, replicate=trials.replicate_record,
        hardware=hardware_fingerprint(profile),
    )
    finalists, dropped, rounds = _settle_finalists(trials, search.measured, user_batch, remeasure=remeasure)
    winner, tie_note = _pick_winner(finalists, user_batch)
    policy = None
    if winner is not None:
        best = next(f for f in finalists if f.candidate == winner)
        policy = _tuned_policy(winner, best, trials, reference, profile, workload, search.runs + search.resumed)
    return TuneResult(reference, space, search, trials.evaluations, finalists, winner, policy, tie_note,
                      _scale_batch_note(winner, user_batch), ratios, clock() - start,
                      dropped=dropped, remeasure_rounds=rounds, replicate=trials.replicate)


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
    replicate: Replicate | None = None

    @property
    def user_batch(self) -> int | None:
        return None if self.reference is None else self.reference.user_batch

    @property
    def replicate_curve(self) -> TrialCurve | None:
        """fp32 under another seed, whose spread widens the stability limits; ``None`` if none."""
        return None if self.replicate is None else self.replicate.curve

    @property
    def replicate_record(self) -> dict[str, Any] | None:
        """The usable replicate as the study keeps it, or ``None``."""
        return None if self.replicate_curve is None else self.replicate.to_dict()

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

    def run_replicate(self, stored: dict[str, Any] | None) -> Evaluation:
        """Run fp32 under another seed (or reuse the ``stored`` replicate when it matches), whose
        spread widens the stability limits; returns the reference judged with that spread."""
        fp32, reference = Policy(mode="fp32"), self.reference
        if reference is None:
            raise RuntimeError("run_replicate needs the reference: call run_reference first")
        self.replicate = run_replicate(self.runner, reference, stored=stored, on_start=self.on_start)
        ran = None if self.replicate is None else self.replicate.result
        if ran is not None and self.on_done:
            ev = evaluate(self.replicate.label, fp32, ran, None, thresholds=self.thresholds)
            ok = ev.result.outcome == "ok"
            self.on_done(ev.label, ev, Measured(Candidate("fp32", reference.user_batch), ev.goodput or 0.0, ok, ok,
                                                outcome=ev.outcome, reason=ev.reason))
        return evaluate("fp32", fp32, reference, reference, thresholds=self.thresholds, replicate=self.replicate_curve)

    def run(self, cand: Candidate) -> Measured:
        """Run one candidate of the search and record its evaluation."""
        policy = cand.policy(self.user_batch)
        if self.on_start:
            self.on_start(cand.label)
        return self.record(cand, policy, self.runner(policy, cand.label))

    def record(self, cand: Candidate, policy: Policy, result: TrialResult) -> Measured:
        """Judge a result (the memory limit too), keep its evaluation, and report it."""
        ev = evaluate(cand.label, policy, self._limit_memory(result), self.reference, thresholds=self.thresholds,
                      replicate=self.replicate_curve)
        m = Measured(cand, ev.goodput or 0.0, feasible=ev.result.outcome == "ok", stable=ev.stable,
                     oom=ev.result.outcome == "oom", outcome=ev.outcome, reason=ev.reason,
                     verdict_kind=ev.verdict.kind if ev.verdict else "")
        self.evaluations[cand] = ev
        if self.on_done:
            self.on_done(cand.label, ev, m)
        return m

    def _limit_memory(self, result: TrialResult) -> TrialResult:
        """The result, turned out of memory when its peak exceeds the memory limit."""
        if (self.memory_limit is not None and result.outcome == "ok" and result.peak_memory
                and result.peak_memory > self.memory_limit):
            return result.with_outcome(
                "oom", f"peak memory {result.peak_memory / 2**20:.0f} MiB exceeds the limit {self.memory_limit / 2**20:.0f} MiB"
            )
        return result

    def remeasure(self, finalists: list[Finalist], first_round: int = 0) -> tuple[list[Finalist], list[Measured], int]:
        """Re-run close finalists in interleaved rounds until each gap to the leader is resolved.

        Each round runs the leader and every finalist whose gap to it the rounds so far cannot
        resolve, back to back and in alternating order, so a slow spell of the machine hits
        them alike. After ``REMEASURE_MAX_ROUNDS`` a gap still unresolved is a tie. A finalist
        whose re-measurement is not stable (unstable, crashed, out of memory) is dropped: one
        good run does not make a policy safe to recommend.

        Args:
            finalists: the candidates to settle; their ``rounds`` may hold earlier rounds.
            first_round: the number of the first round to run (rounds already held are kept).

        Returns:
            The finalists left (each with its gap to the leader), the failed re-measurements
            of those dropped, and the number of the next round.
        """
        active = list(finalists)
        lost: list[Measured] = []
        round_ = first_round
        for _ in range(REMEASURE_MAX_ROUNDS):
            if len(active) < 2:
                break
            leader = _lead(active)
            unsettled = [f for f in active if f.gap is not None and not f.gap.resolved]
            if not unsettled:
                break
            running = [leader, *unsettled]
            for f in active:
                f.rounds.extend([None] * (round_ + 1 - len(f.rounds)))
            for f in running if round_ % 2 == 0 else reversed(running):
                failure = self._remeasure_one(f, round_)
                if failure is not None:
                    active.remove(f)
                    lost.append(failure)
            round_ += 1
        _lead(active)
        return active, lost, round_

    def _remeasure_one(self, finalist: Finalist, round_: int) -> Measured | None:
        """Run a finalist once more for round ``round_``; returns what dropped it, or ``None``."""
        label = f"{finalist.candidate.label} (re-measure {round_ + 1})"
        if self.on_start:
            self.on_start(label)
        policy = finalist.candidate.policy(self.user_batch)
        result = self._limit_memory(self.runner(policy, label))
        ev = evaluate(label, policy, result, self.reference, thresholds=self.thresholds, replicate=self.replicate_curve)
        kind = ev.verdict.kind if ev.verdict else ""
        if self.on_done:
            self.on_done(label, ev, Measured(finalist.candidate, ev.goodput or 0.0, ev.result.outcome == "ok",
                                             ev.stable, outcome=ev.outcome, reason=ev.reason, verdict_kind=kind))
        if ev.stable:
            if ev.goodput:  # without sample counts there is nothing to compare; the round stays empty
                finalist.goodputs.append(ev.goodput)
                finalist.per_sample_times.extend(_per_sample_times(result))
                finalist.rounds[round_] = ev.goodput
            return None
        return Measured(finalist.candidate, finalist.goodputs[0], ev.result.outcome == "ok", False,
                        oom=ev.result.outcome == "oom", outcome=ev.outcome, verdict_kind=kind,
                        reason=f"stable in the search, then {ev.outcome} on re-measurement {round_ + 1}: {ev.reason}")


def _space(profile: HardwareProfile, options: TuneOptions, user_batch: int | None,
           limits: SpaceLimits | None = None, *, fsdp: bool = False) -> SearchSpace:
    """The candidates this hardware supports, narrowed to the options' modes and the limits;
    with ``fsdp`` (the script shards with FSDP2), the gradient reduction dtype too."""
    support = supported_modes(profile)
    modes = check_modes(list(options.modes), profile) if options.modes else None  # unknown or unsupported: one clear error
    return space_for(support, user_batch, include_emulated=options.include_emulated,
                     scale_batch=options.scale_batch, modes=modes, limits=limits, fsdp=fsdp)


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
    script = (workload or {}).get("script")
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
        script=script,
        trials=trial_count,
        cuda=profile.cuda_runtime or "",
        # The script's own batch: a run splits whatever batch it asks for, keeping it global.
        global_batch=trials.user_batch,
        script_digest=script_digest(script) if script else None,
    ))


def _scale_batch_note(winner: Candidate | None, user_batch: int | None) -> str:
    """A warning when the winner changes the global batch (``scale_batch``), else empty."""
    if winner is None or not winner.micro_batch or not user_batch or winner.micro_batch <= user_batch:
        return ""
    return (f"the winner uses a global batch of {winner.micro_batch} instead of {user_batch}: this changes "
            "the optimisation (learning-rate and convergence may need retuning)")


def _settle_finalists(
    trials: _Trials, measured: dict[Candidate, Measured], user_batch: int | None, *, remeasure: bool
) -> tuple[list[Finalist], list[Measured], int]:
    """The finalists once re-measurement has settled their gaps, best first.

    A finalist that fails its re-measurement is marked so in ``measured`` and dropped. Its
    going can bring others within the noise band of the new best, so the field is drawn
    again (keeping every round run so far) until a re-measurement drops none.

    Returns:
        The finalists, the failed re-measurements of those dropped, and the rounds run.
    """
    history: dict[Candidate, Finalist] = {}
    dropped: list[Measured] = []
    rounds = 0
    while True:
        finalists = _finalists(measured, trials.evaluations, user_batch, history)
        if not remeasure or len(finalists) < 2:
            for f in finalists:
                f.gap = None  # a lone finalist has no rival; a gap from an earlier field is stale
            return finalists, dropped, rounds
        finalists, lost, rounds = trials.remeasure(finalists, rounds)
        for m in lost:
            measured[m.candidate] = m
        dropped += lost
        if not lost:
            return sorted(finalists, key=lambda f: -f.remeasured_goodput), dropped, rounds


def _finalists(
    measured: dict[Candidate, Measured], evaluations: dict[Candidate, Evaluation], user_batch: int | None,
    history: dict[Candidate, Finalist] | None = None,
) -> list[Finalist]:
    """Every stable, feasible candidate within measured noise of the best, best first.

    Args:
        measured: what the search measured.
        evaluations: their evaluations (the step times give each one's noise).
        user_batch: the script's batch (for the safety order among equals).
        history: finalists of an earlier field by candidate, reused with their rounds; the
            new ones are added to it.
    """
    history = {} if history is None else history
    stable = [m for m in measured.values() if m.stable and m.feasible and m.goodput > 0]
    if not stable:
        return []
    stable.sort(key=lambda m: (-m.goodput, preference_key(m.candidate, user_batch)))
    best = stable[0]
    best_ev = evaluations.get(best.candidate)
    out = []
    for m in stable:
        ev = evaluations.get(m.candidate)
        noise = DEFAULT_MIN_MARGIN
        if ev and best_ev and ev.timing and best_ev.timing:
            noise = noise_band(ev.timing, best_ev.timing)
        if m is best or m.goodput * (1 + noise) >= best.goodput:
            if m.candidate not in history:
                history[m.candidate] = Finalist(m.candidate, [m.goodput], _per_sample_times(ev.result) if ev else [])
            out.append(history[m.candidate])
    return out


def _lead(finalists: list[Finalist]) -> Finalist | None:
    """The re-measured leader; sets every other finalist's gap to it.

    The leader has the highest median goodput over the rounds; should another finalist turn
    out resolved faster than it over their paired rounds, that one leads instead.
    """
    for f in finalists:
        f.gap = None
    if len(finalists) < 2:
        return finalists[0] if finalists else None
    leader = max(finalists, key=lambda f: f.remeasured_goodput)
    for _ in finalists:  # a pass hands the lead only to a finalist resolved faster: at most one each
        gaps = {id(f): _paired(leader, f) for f in finalists if f is not leader}
        overtaking = [f for f in finalists if id(f) in gaps and gaps[id(f)].verdict == "slower"]
        if not overtaking:
            break
        leader = min(overtaking, key=lambda f: gaps[id(f)].ratio)
    for f in finalists:
        f.gap = None if f is leader else _paired(leader, f)
    return leader


def _paired(a: Finalist, b: Finalist) -> Gap:
    """The gap of ``a`` over ``b`` over the rounds both ran."""
    pairs = [(x, y) for x, y in zip(a.rounds, b.rounds) if x is not None and y is not None]
    return paired_gap([x for x, _ in pairs], [y for _, y in pairs])


def _per_sample_times(result: TrialResult) -> list[float]:
    samples = samples_per_step(result) or 1
    warm = min(result.warmup_steps, max(0, len(result.step_times) - 1))
    return [t / samples for t in result.step_times[warm:]]


def _pick_winner(finalists: list[Finalist], user_batch: int | None) -> tuple[Candidate | None, str]:
    """The fastest finalist, unless a safer one is within the measured noise (ties go to safety).

    Re-measured finalists are judged by their gap to the leader: a finalist whose gap is a tie
    (within the margin that counts) or unresolved after the last round competes with it.
    Otherwise (no re-measurement) by the step times of the search's runs.
    """
    if not finalists:
        return None, ""
    if any(f.gap is not None for f in finalists):
        return _pick_by_gap(finalists, user_batch)
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


def _pick_by_gap(finalists: list[Finalist], user_batch: int | None) -> tuple[Candidate, str]:
    """The safest of the leader and the finalists whose gap to it is not resolved in its favour."""
    leader = next(f for f in finalists if f.gap is None)
    tied = [leader] + [f for f in finalists if f.gap is not None and f.gap.verdict in ("tie", "unresolved")]
    winner = min(tied, key=lambda f: preference_key(f.candidate, user_batch))
    if winner is leader or winner.gap is None:
        return winner.candidate, ""
    gap = winner.gap
    why = (f"a lead under the {gap.min_margin:.0%} that counts" if gap.verdict == "tie"
           else f"not resolved after {gap.pairs} paired runs")
    interval = (f"{gap.confidence:.0%} interval {gap.low:.2f}x to {gap.high:.2f}x" if math.isfinite(gap.high)
                else "no interval yet")
    return winner.candidate, (f"{leader.candidate.label} measured {gap.ratio:.2f}x of {winner.candidate.label} "
                              f"({interval}), {why}: the safer {winner.candidate.label} wins the tie")
