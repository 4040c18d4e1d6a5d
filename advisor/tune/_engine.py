"""The tuner: the fp32 reference, the search, the interleaved re-measurement of close
candidates (and of the winner against fp32) until their gaps are settled, and the winner with
its evidence and its one speed-up figure."""

from __future__ import annotations

import datetime as dt
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import probes
from advisor._log import get_logger
from advisor.runtime import script_digest
from advisor.trial import TrialResult, startup_seconds
from advisor.tune._checks import check_modes
from advisor.tune._options import TuneOptions
from advisor.tune._search import SearchOutcome, check_study_workload, run_search, stored_replicate
from advisor.tune._space import (
    Candidate,
    Measured,
    SearchSpace,
    SpaceLimits,
    preference_key,
    space_for,
)
from advisor.tune._stability import StabilityThresholds, TrialCurve, safety_rank
from advisor.tune._steady import Disturbance, DisturbanceWatch, SteadyRunner, default_threads
from advisor.tune._timing import (
    DEFAULT_CONFIDENCE,
    DEFAULT_MIN_MARGIN,
    Gap,
    compare,
    noise_band,
    paired_gap,
    step_time_range,
    summarize,
)
from advisor.tune._trials import (
    Evaluation,
    FlopCountable,
    Replicate,
    Runner,
    Yardsticks,
    evaluate,
    run_reference,
    run_replicate,
    samples_per_step,
)
from advisor.tune._utilisation import Utilisation, utilisation
from policies import Policy, TunedOn, safe_default_mode, supported_modes
from probes import HardwareProfile, hardware_fingerprint

# Rounds of interleaved re-measurement, in all, before a gap still unresolved is called a tie
# (and the safer finalist wins it). Two pairs give the first interval; a finalist stops being
# re-measured as soon as its interval shows a clear lead, or shows that the riskier of the two
# cannot be more than the margin faster. The bound trades resolution for time: in simulated
# tunes, four rounds resolve a 19% gap in 99 of 100 when runs scatter by 3% (a quiet GPU), but
# in 64 of 100 at the 7% of the shared 2-core build machine (ten rounds: 98); the rest are
# ties, won by the safer mode. Without it, a tie within 1% ran ten rounds of every finalist,
# past 15 minutes; now it costs four.
REMEASURE_MAX_ROUNDS = 4
# The rounds a gap may take while it leans: unresolved, with its estimate beyond the margin on the
# riskier finalist's side. Stopping at four would give the safer one the win that the estimate
# says belongs to the other (on the 2-core Xeon, bf16-true's 11% lead over bf16-mixed in
# examples/mlp.py often ended 4 rounds at [1.01, 1.27]); a gap whose estimate lies within the
# margin, or on the safer side, stops at four, where more rounds could not change the winner.
REMEASURE_LEANING_ROUNDS = 8
# The fewest paired rounds of the winner beside fp32, run here, that its speed-up rests on.
LOCAL_PAIRS = 2
# The most rounds in all when the winner still lacks its ``LOCAL_PAIRS``: rounds past the usual
# bounds that run the winner and fp32 alone. Its figure may be another worker's, or the rounds it
# ran may have been left unpaired by a change of threads (two workers of a shared study on one
# 2-core machine each saw the other come and go, and a winner ended with one pair, no interval).
PAIRING_ROUNDS = REMEASURE_LEANING_ROUNDS + 4
# The pairs a winner holds before the precision asked of its speed-up (``--speedup-within``) is
# given up as out of reach: when the scatter of its pairs says the interval could not get that
# narrow within ``PAIRING_ROUNDS``. The scatter of two pairs, one degree of freedom, is too
# rough to give up on; on a tiny model beside two CPU-bound processes the pairs scatter by
# tens of percent and the rounds up to the bound would buy nothing.
REACH_MIN_PAIRS = 3
# How far ahead ``speedup_within_pairs_needed`` projects the pairs a precision would take.
PAIRS_PROJECTED = 100

# Why re-measurement ended (``TuneResult.remeasure_stop``).
STOP_SETTLED = "settled"
STOP_ROUND_LIMIT = "round limit"
STOP_TIME_BUDGET = "time budget"
STOP_OFF = "off"


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
        in_band: whether the search measured it within noise of the best. The runner-up and
            fp32 run beside the best even when they are not, as evidence; such a finalist
            takes a tie only on paired runs (two pairs or more), never on the want of them.
    """

    candidate: Candidate
    goodputs: list[float]
    per_sample_times: list[float]
    rounds: list[float | None] = field(default_factory=list)
    gap: Gap | None = None
    in_band: bool = True  # within the search's noise of the best; else it runs only as evidence

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


@dataclass(frozen=True)
class Speedup:
    """The winner's goodput over fp32's: the one speed-up figure a tune reports, writes and caches.

    Attributes:
        ratio: the speed-up, rounded to 4 decimals (above 1 when the winner is faster).
        low: the lower end of its confidence interval; ``None`` where there is none (single
            runs, a single pair).
        high: the upper end; ``None`` likewise.
        pairs: the paired runs of the winner and fp32 it rests on (0 for single runs, and for
            fp32 itself).
        confidence: the interval's confidence level.
        basis: what it rests on, in words: ``"paired re-measurement, 4 pairs"``, ``"single runs,
            not re-measured"``, ``"the fp32 reference itself"``; with ``threads``, the threads too.
        threads: the CPU threads its runs had, where other processes kept cores busy and they
            ran on fewer than torch's own (``torch_threads``); ``None``: torch's own (or a GPU).
            A 16-bit gain on one thread is not the gain on all cores (on the 2-core Xeon,
            bf16-mixed gained 1.33x on one thread and 1.14x on two).
        torch_threads: torch's own thread count, beside ``threads``; ``None`` without it.
    """

    ratio: float
    low: float | None = None
    high: float | None = None
    pairs: int = 0
    confidence: float = DEFAULT_CONFIDENCE
    basis: str = ""
    threads: int | None = None
    torch_threads: int | None = None

    @classmethod
    def of_gap(cls, gap: Gap) -> Speedup:
        """The paired gap of the winner over fp32, as the speed-up."""
        bounded = gap.pairs >= 2 and math.isfinite(gap.high) and gap.low > 0
        return cls(round(gap.ratio, 4), round(gap.low, 4) if bounded else None, round(gap.high, 4) if bounded else None,
                   gap.pairs, gap.confidence, f"paired re-measurement, {gap.pairs} pair{'' if gap.pairs == 1 else 's'}")

    def on_threads(self, threads: int | None, torch_threads: int | None) -> Speedup:
        """This figure, measured on ``threads`` of torch's ``torch_threads`` (said in its basis);
        unchanged when ``threads`` is ``None`` or not fewer."""
        if threads is None or torch_threads is None or threads >= torch_threads:
            return self
        return replace(self, threads=threads, torch_threads=torch_threads,
                       basis=f"{self.basis}, on {threads} of torch's {torch_threads} threads, other processes "
                             "keeping cores busy")

    def to_dict(self) -> dict[str, Any]:
        return {"ratio": self.ratio, "low": self.low, "high": self.high, "pairs": self.pairs,
                "confidence": self.confidence, "basis": self.basis, "threads": self.threads,
                "torch_threads": self.torch_threads}


@dataclass(frozen=True)
class TuneCost:
    """What a tune cost, in trial-equivalents: its wall time over one measured window (the fp32
    reference's measured steps), so that start-up, warm-up and every rerun show as overhead.

    Attributes:
        wall_s: the tune's wall time, in seconds.
        trials: trials run in all (the reference, its replicate, the search, the reruns of
            disturbed or lost trials and the rounds of re-measurement).
        window_s: one measured window, in seconds; ``None`` when the reference had no timeline.
        trial_equivalents: ``wall_s / window_s``; ``None`` without a window.
        startup_share: the median over the trials of the share of each trial's wall time spent
            before its first step ended (imports, set-up, the first step's compilation).
    """

    wall_s: float
    trials: int
    window_s: float | None
    trial_equivalents: float | None
    startup_share: float | None

    @classmethod
    def of(cls, ran: list[TrialResult], wall_s: float, reference: TrialResult | None) -> TuneCost:
        """The cost of a tune that ran ``ran`` in ``wall_s`` seconds, in windows of the kept
        ``reference`` (not a disturbed first run of it)."""
        window = None if reference is None else reference.phases.get("measured")
        shares = [s / r.wall_s for r in ran if r.wall_s > 0 and (s := startup_seconds(r.timeline)) is not None]
        return cls(round(wall_s, 3), len(ran), window, round(wall_s / window, 1) if window else None,
                   round(statistics.median(shares), 3) if shares else None)

    def to_dict(self) -> dict[str, Any]:
        return {"wall_s": self.wall_s, "trials": self.trials, "window_s": self.window_s,
                "trial_equivalents": self.trial_equivalents, "startup_share": self.startup_share}


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
    replicate: Replicate | None = None  # fp32 with perturbed initial weights: the spread the verdicts allow
    speedup: Speedup | None = None  # the winner's, against fp32
    remeasure_stop: str = STOP_OFF  # why re-measurement ended: STOP_SETTLED, STOP_ROUND_LIMIT, ...
    time_budget: float | None = None
    reference_rounds: list[float | None] = field(default_factory=list)  # fp32's goodput in each round
    window_note: str = ""  # whether the measured window grew (fp32 still falling), or is short
    measure_steps: int | None = None  # the measured window every trial used in the end
    extended: list[str] = field(default_factory=list)  # candidates judged again on a longer window
    disturbances: list[Disturbance] = field(default_factory=list)  # trials run again: disturbed or lost
    peak_tflops: dict[str, float] = field(default_factory=dict)  # probed matmul TFLOP/s per dtype
    cost: TuneCost | None = None  # what the tune's trials cost, against one measured window
    speedup_within: float | None = None  # the precision asked of the speed-up (--speedup-within)
    # Whether the winner's paired speed-up is that precise; None when nothing was asked, or the
    # winner has no paired figure (fp32 itself).
    speedup_within_met: bool | None = None
    # When not met: whether the scatter of its pairs put it out of reach of the round bound, and
    # the pairs that scatter would need (None beyond PAIRS_PROJECTED, or on too few pairs to tell).
    speedup_within_out_of_reach: bool | None = None
    speedup_within_pairs_needed: int | None = None

    def utilisation(self, cand: Candidate) -> Utilisation | None:
        """A measured candidate's achieved TFLOP/s and MFU, from the reference's FLOP count."""
        ev = self.evaluations.get(cand)
        if ev is None or ev.timing is None:
            return None
        return utilisation(self.reference.result.flops_per_step, ev.timing.median, cand.mode, self.peak_tflops)

    @property
    def winner_speedup(self) -> float | None:
        """The winner's speed-up over fp32 (``speedup.ratio``); ``None`` without a winner."""
        return None if self.speedup is None else self.speedup.ratio

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

    def paired_speedup(self, cand: Candidate) -> Speedup | None:
        """A finalist's speed-up over fp32 from the rounds it ran beside fp32 in this run (the
        same computation as the winner's figure); ``None`` for fp32 itself, and for a candidate
        never re-measured beside it."""
        finalist = next((f for f in self.finalists if f.candidate == cand), None)
        if finalist is None or cand.mode == "fp32" and finalist.rounds == self.reference_rounds:
            return None
        pairs = [(x, y) for x, y in zip(finalist.rounds, self.reference_rounds) if x is not None and y is not None]
        if not pairs:
            return None
        return Speedup.of_gap(paired_gap([x for x, _ in pairs], [y for _, y in pairs]))

    def resumed(self, cand: Candidate) -> bool:
        """Whether a measured candidate's search figure is not this run's: taken from the stored
        study (an earlier run's, or another worker's)."""
        return cand in self.search.measured and cand not in self.evaluations

    def to_dict(self) -> dict[str, Any]:
        rows = []
        ref_good = self.reference.goodput or 0.0
        for cand, m in self.ranking():
            ev = self.evaluations.get(cand)
            resumed = self.resumed(cand)
            # A stored figure over this run's fp32 is no ratio of anything: another run, another
            # machine state. Its row shows no search ratio; a paired figure it may have is this run's.
            search_speedup = m.goodput / ref_good if ref_good and not resumed else None
            won = cand == self.winner
            paired = self.paired_speedup(cand)
            spread = None if ev is None else step_time_range(ev.result.step_times, _warmup_of(ev.result))
            rows.append({
                "label": cand.label,
                "mode": cand.mode,
                "policy": cand.policy(self.space.user_batch).to_dict(),
                "outcome": m.outcome or ("ok" if m.stable else "unstable"),
                "stable": m.stable,
                "feasible": m.feasible,
                "goodput": m.goodput,
                # The search ran each candidate once: its ratio to fp32 is a single run's. The
                # winner's speed-up is the tune's one figure (re-measured against fp32).
                "search_speedup_vs_fp32": search_speedup,
                "speedup_vs_fp32": self.winner_speedup if won else search_speedup,
                "speedup_basis": (self.speedup.basis if won and self.speedup else
                                  "resumed: measured in an earlier run or by another worker" if resumed else "search run"),
                # Its rounds beside fp32 in this run, when it was re-measured (the winner's is its figure).
                "paired_speedup": None if paired is None else paired.to_dict(),
                "resumed": resumed,
                # The spread of its search run's measured step times (seconds), for the ± it carries.
                "step_time_p10": None if spread is None else spread[0],
                "step_time_p90": None if spread is None else spread[1],
                "peak_memory": ev.result.peak_memory if ev else None,
                **_utilisation_fields(self.utilisation(cand)),
                "reason": m.reason,
                "winner": won,
            })
        return {
            "winner": None if self.policy is None else self.policy.to_dict(),
            "winner_label": None if self.winner is None else self.winner.label,
            "speedup_vs_fp32": self.winner_speedup,
            "speedup": None if self.speedup is None else self.speedup.to_dict(),
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
            "remeasure_max_rounds": REMEASURE_MAX_ROUNDS,
            "remeasure_leaning_rounds": REMEASURE_LEANING_ROUNDS,
            "remeasure_stop": self.remeasure_stop,
            "reference_rounds": self.reference_rounds,
            "time_budget": self.time_budget,
            "gap": self.decisive_gap(),
            "dropped_finalists": [{"label": m.candidate.label, "outcome": m.outcome, "reason": m.reason}
                                  for m in self.dropped],
            "pruned": [{"label": cand.label, "mode": cand.mode, "policy": cand.policy(self.space.user_batch).to_dict(),
                        "outcome": "pruned", "reason": reason} for cand, reason in self.search.pruned.items()],
            "reference": self.reference.to_dict(),
            "replicate": None if self.replicate is None else self.replicate.to_dict(losses=False),
            "candidates": rows,
            "wall_s": self.wall_s,
            "window_note": self.window_note,
            "measure_steps": self.measure_steps,
            "extended_window": list(self.extended),
            "disturbed": [d.to_dict() for d in self.disturbances],
            "flops_per_step": self.reference.result.flops_per_step,
            "flops_basis": self.reference.result.flops_basis,
            "peak_tflops": dict(self.peak_tflops),
            "cost": None if self.cost is None else self.cost.to_dict(),
            "speedup_within": self.speedup_within,
            "speedup_within_met": self.speedup_within_met,
            "speedup_within_out_of_reach": self.speedup_within_out_of_reach,
            "speedup_within_pairs_needed": self.speedup_within_pairs_needed,
        }


def measure_matmul(profile: HardwareProfile) -> tuple[dict[str, float], dict[str, float]]:
    """Matmul throughput per dtype on this device: relative to fp32 (the search's priors), and
    in TFLOP/s (the peaks each candidate's MFU is measured against)."""
    ratios, peaks = {}, {}
    for row in probes.matmul_benchmark(profile):
        if row.skipped is None and row.ratio_vs_fp32:
            ratios[row.dtype] = float(row.ratio_vs_fp32)
        if row.skipped is None and row.tflops:
            peaks[row.dtype] = float(row.tflops)
    ratios["fp32"] = 1.0
    return ratios, peaks


def _higher_peaks(first: dict[str, float], second: dict[str, float]) -> dict[str, float]:
    """Each dtype's higher figure of two probes of the matmul peaks.

    A peak is what the hardware can do, and a neighbour's burst only ever slows a matmul. One
    probe lasts a fraction of a second, so one burst can halve every MFU of a tune; two probes
    minutes apart, at the tune's start and end, rarely both meet one."""
    return {dtype: max(first.get(dtype, 0.0), second.get(dtype, 0.0)) for dtype in {**first, **second}}


def tune_policy(
    runner: Runner,
    profile: HardwareProfile,
    options: TuneOptions | None = None,
    *,
    study_name: str = "mpadvise",
    thresholds: StabilityThresholds | None = None,
    dtype_ratio: dict[str, float] | None = None,
    peak_tflops: dict[str, float] | None = None,
    remeasure: bool = True,
    workload: dict[str, Any] | None = None,
    on_start: Callable[[str], None] | None = None,
    on_done: Callable[[str, Evaluation | None, Measured], None] | None = None,
    clock: Callable[[], float] | None = None,
    limits: SpaceLimits | None = None,
    on_round: Callable[[int, int, int], None] | None = None,
) -> TuneResult:
    """Find the fastest stable policy for the workload that ``runner`` runs.

    Args:
        runner: runs one candidate Policy (subprocess script trials, or a function in-process);
            one that can perturb fp32's initial weights (``Perturbable``) also runs fp32's
            replicate, whose drift widens the stability limits.
        profile: the hardware the trials run on; decides the search space.
        options: the tune's options (defaults when ``None``). The tuner reads ``trials``
            (the reference and re-measurements not counted), ``time_budget`` (no trial of the
            search and no round of re-measurement starts after it), ``scale_batch``,
            ``include_emulated``, ``modes``, ``memory_limit`` (candidates over it are
            infeasible), ``storage`` and ``resume`` (where the Optuna study lives; a study of
            another workload is not resumed), ``seed`` (of the sampler) and ``no_priors``; the
            runner has the measuring window already.
        study_name: the study's name in that storage.
        thresholds: stability thresholds.
        dtype_ratio: matmul ratios per dtype; measured on the device when ``None``.
        peak_tflops: matmul TFLOP/s per dtype, each candidate's MFU's denominator; measured
            with the ratios when ``dtype_ratio`` is ``None`` (tests pass both), and then, where
            the reference counted its FLOPs, again at the end, each dtype keeping its higher
            figure (``_higher_peaks``).
        remeasure: re-measure close candidates interleaved, until their gaps are settled, and
            the winner against fp32 for its speed-up, before declaring a winner.
        workload: extra facts recorded in the winner's ``[tuned_on]`` (script name).
        on_start, on_done: progress callbacks.
        clock: monotonic seconds (tests pass a fake).
        limits: what the script's way of training can apply (a framework's limits); the
            search never proposes anything outside them.
        on_round: called before each round of re-measurement with its number (from 1), the
            most rounds there can be, and how many runs it holds.

    Raises:
        MpadviseError: the fp32 reference failed, so nothing can be judged.
    """
    options = options or TuneOptions()
    clock = clock or time.monotonic
    start = clock()
    # Every trial, the reference's first, is run again when the machine disturbed or lost it.
    watch = DisturbanceWatch(profile=profile)
    runner = SteadyRunner(runner, watch)
    trials = _Trials(runner, thresholds or StabilityThresholds(), options.memory_limit_bytes, on_start, on_done)
    reference = trials.run_reference(
        deadline=None if options.time_budget is None else start + options.time_budget, clock=clock)
    user_batch = trials.user_batch
    # A script that shards with FSDP2 said so in its reference trial: the gradient reduction
    # dtype joins the space.
    space = _space(profile, options, user_batch, limits, fsdp=reference.result.fsdp)
    probed = False  # whether this tune measured the peaks itself (and so probes them again at its end)
    if dtype_ratio is not None:
        ratios, peaks = dtype_ratio, dict(peak_tflops or {})
    elif options.no_priors and not trials.reference.flops_per_step:
        ratios, peaks = {}, {}  # neither priors nor an MFU to compute: the benchmark is not worth its seconds
    else:
        ratios, peaks = measure_matmul(profile)
        probed = True
        if options.no_priors:
            ratios = {}
    ref_cand = space.normalise(Candidate("fp32", user_batch))
    ref_measured = trials.record(ref_cand, Policy(mode="fp32"), trials.reference)
    # A stored study's verdicts hold for the workload its reference ran: one whose model,
    # optimizer or batch changed since (an environment variable, a config file) starts afresh.
    workload_facts = _workload_facts(trials.reference)
    resume = check_study_workload(options.storage, study_name, workload_facts, resume=options.resume)
    if resume != options.resume:
        options = options.with_(resume=resume)
    # fp32's replicate, kept with a stored study (which --resume reuses): its drift calibrates
    # every verdict from here on.
    reference = trials.run_replicate(stored_replicate(options.storage, study_name) if options.resume else None)
    search_start = clock()
    search = run_search(
        space, trials.run, options, first=_first_candidates(space, profile, ref_cand),
        reference_goodput=reference.goodput or 0.0, dtype_ratio=ratios, study_name=study_name,
        known={ref_cand: ref_measured}, clock=clock, replicate=trials.replicate_record,
        hardware=hardware_fingerprint(profile), workload=workload_facts,
    )

    def out_of_time() -> bool:  # the search's budget bounds re-measurement too
        return options.time_budget is not None and clock() - search_start >= options.time_budget

    within = options.speedup_within or None  # 0 asks for no precision: the pairs the decision took
    settled = _settle_finalists(trials, search.measured, user_batch, ref_cand, remeasure=remeasure,
                                out_of_time=out_of_time, on_round=on_round, within=within)
    winner, tie_note = _pick_winner(settled.finalists, user_batch, stop=settled.stop)
    if probed and trials.reference.flops_per_step:
        peaks = _higher_peaks(peaks, measure_matmul(profile)[1])
    policy = speedup = within_met = out_of_reach = needed = None
    if winner is not None:
        best = next(f for f in settled.finalists if f.candidate == winner)
        speedup = _speedup(best, settled.companion, ref_cand, reference.goodput or 0.0, stop=settled.stop)
        if speedup is not None:
            speedup = speedup.on_threads(trials.threads_of(best, settled.companion), default_threads())
        if within is not None and speedup is not None and speedup.pairs:
            gap = _paired(best, settled.companion)
            within_met = _paired_enough(gap, within)
            if not within_met:
                out_of_reach = _out_of_reach(gap, within, len(settled.companion.rounds))
                needed = gap.pairs_for(within, PAIRS_PROJECTED) if gap.pairs >= REACH_MIN_PAIRS else None
        policy = _tuned_policy(winner, best, speedup, trials, profile, workload, search.runs + search.resumed)
    return TuneResult(reference, space, search, trials.evaluations, settled.finalists, winner, policy, tie_note,
                      _scale_batch_note(winner, user_batch), ratios, clock() - start,
                      dropped=settled.dropped, remeasure_rounds=settled.rounds, replicate=trials.replicate,
                      speedup=speedup, remeasure_stop=settled.stop, time_budget=options.time_budget,
                      reference_rounds=list(settled.companion.rounds) if settled.companion else [],
                      window_note=trials.window_note, measure_steps=getattr(trials.runner, "measure_steps", None),
                      extended=list(trials.yardsticks.extended) if trials.yardsticks else [],
                      disturbances=list(watch.events), peak_tflops=peaks, cost=TuneCost.of(watch.ran, clock() - start, trials.reference),
                      speedup_within=within, speedup_within_met=within_met,
                      speedup_within_out_of_reach=out_of_reach, speedup_within_pairs_needed=needed)


def _utilisation_fields(found: Utilisation | None) -> dict[str, Any]:
    """A candidate row's achieved TFLOP/s, MFU and the dtype its MFU is of (``None`` each when unknown)."""
    return {"tflops": None if found is None else found.tflops, "mfu": None if found is None else found.mfu,
            "mfu_dtype": None if found is None else found.dtype}


def _workload_facts(result: TrialResult) -> dict[str, str | None]:
    """What identifies the workload a reference trial ran, for the study to keep."""
    return {"workload_fingerprint": result.workload_fingerprint, "model_signature": result.model_signature}


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
    window_note: str = ""  # how run_reference settled the measured window
    yardsticks: Yardsticks | None = None  # fp32 and its replicate per window, once the replicate ran
    _asked: int | None = None
    _deadline: float | None = None
    _clock: Callable[[], float] = time.monotonic
    _reference_goodput: float | None = None
    _round_threads: list[int | None] = field(default_factory=list)  # the thread counts of a round's runs
    _rounds_on: dict[int, int | None] = field(default_factory=dict)  # each paired round run here: its threads
    _remeasured: dict[int, Finalist] = field(default_factory=dict)  # every finalist re-measured, by id
    _unpaired: set[int] = field(default_factory=set)  # rounds a change of threads left unpaired

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

    def run_reference(self, *, deadline: float | None = None, clock: Callable[[], float] = time.monotonic) -> Evaluation:
        """Run fp32, the baseline every candidate is judged against (``run_reference``).

        Raises:
            MpadviseError: the reference failed or is not finite.
        """
        # While fp32's loss still falls geometrically at the window's end, the window grows and
        # every later trial (replicate, candidates, re-measurements) measures the longer one.
        self._asked, self._deadline, self._clock = getattr(self.runner, "measure_steps", None), deadline, clock
        # The reference alone counts a step's FLOPs: every candidate runs the same arithmetic.
        counts = isinstance(self.runner, FlopCountable)
        runner = self.runner.with_flop_count(True) if counts else self.runner
        result, runner, self.window_note = run_reference(
            runner, thresholds=self.thresholds, on_start=self.on_start, deadline=deadline, clock=clock)
        self.runner = runner.with_flop_count(False) if counts else runner
        self.reference = result
        ev = evaluate("fp32", Policy(mode="fp32"), result, result, thresholds=self.thresholds)
        self._reference_goodput = ev.goodput
        return ev

    def run_replicate(self, stored: dict[str, Any] | None) -> Evaluation:
        """Run fp32 under another seed (or reuse the ``stored`` replicate when it matches), whose
        spread widens the stability limits; returns the reference judged with that spread."""
        fp32, reference = Policy(mode="fp32"), self.reference
        if reference is None:
            raise RuntimeError("run_replicate needs the reference: call run_reference first")
        self.replicate = run_replicate(self.runner, reference, stored=stored, on_start=self.on_start)
        # From here on a candidate bending away from fp32 is judged on a longer window.
        self.yardsticks = Yardsticks(self.runner, reference, self.replicate, thresholds=self.thresholds,
                                     asked=self._asked, deadline=self._deadline, clock=self._clock,
                                     on_start=self.on_start)
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
        if self.yardsticks is not None:
            ev = self.yardsticks.evaluate(cand.label, policy, self._limit_memory(result))
        else:  # the reference itself, recorded before its replicate ran
            ev = evaluate(cand.label, policy, self._limit_memory(result), self.reference, thresholds=self.thresholds,
                          replicate=self.replicate_curve)
        m = Measured(cand, self._comparable_goodput(ev) or 0.0, feasible=ev.result.outcome == "ok", stable=ev.stable,
                     oom=ev.result.outcome == "oom", outcome=ev.outcome, reason=ev.reason,
                     verdict_kind=ev.verdict.kind if ev.verdict else "")
        self.evaluations[cand] = ev
        if self.on_done:
            self.on_done(cand.label, ev, m)
        return m

    def threads_of(self, best: Finalist, companion: Finalist | None) -> int | None:
        """The threads ``best``'s speed-up over fp32 (``companion``) was measured on: those of
        the rounds that pair them, or without any, of its search trial; ``None`` for torch's own
        (rounds pair only on one thread count, ``_pair_on_one_thread_count``)."""
        rounds = [] if companion is None else [
            r for r, (a, b) in enumerate(zip(best.rounds, companion.rounds)) if a is not None and b is not None]
        if rounds:
            counts = {self._rounds_on.get(r) for r in rounds}
            return counts.pop() if len(counts) == 1 else None
        ev = self.evaluations.get(best.candidate)
        return None if ev is None else ev.result.threads

    def _comparable_goodput(self, ev: Evaluation) -> float | None:
        """A search trial's goodput as it compares with the others': its own where it ran on the
        reference's threads; else its speed-up over fp32 on as many threads, times the
        reference's goodput (a busy CPU changed the threads after the reference ran)."""
        if self.reference is None or ev.result.threads == self.reference.threads:
            return ev.goodput
        if ev.speedup is None or self._reference_goodput is None:
            return ev.goodput
        return ev.speedup * self._reference_goodput

    def _limit_memory(self, result: TrialResult) -> TrialResult:
        """The result, turned out of memory when its peak exceeds the memory limit."""
        if (self.memory_limit is not None and result.outcome == "ok" and result.peak_memory
                and result.peak_memory > self.memory_limit):
            return result.with_outcome(
                "oom", f"peak memory {result.peak_memory / 2**20:.0f} MiB exceeds the limit {self.memory_limit / 2**20:.0f} MiB"
            )
        return result

    def remeasure(
        self, finalists: list[Finalist], companion: Finalist, first_round: int = 0, *,
        out_of_time: Callable[[], bool] = lambda: False, on_round: Callable[[int, int, int], None] | None = None,
        hard_limit: int | None = None, within: float | None = None,
    ) -> tuple[list[Finalist], list[Measured], int, str]:
        """Re-run finalists in interleaved rounds until each gap to the leader is settled, and
        the likely winner's against fp32.

        Each round runs the leader and every finalist whose gap to it is not settled yet, and
        with them fp32 (``companion``) and the finalist that would win were it the last round,
        back to back and in alternating order, so that a slow spell of the machine hits them
        alike. A gap is settled once its interval shows a clear lead, a lead too small to
        count, or that the riskier of the two cannot be more than the margin faster (the
        safer then wins). No round starts after ``REMEASURE_MAX_ROUNDS`` in all (a gap still
        unresolved is a tie), not counting rounds a change of threads left unpaired, unless a
        gap leans (``_leaning``); none at all after ``REMEASURE_LEANING_ROUNDS``; nor once
        ``out_of_time``. Rounds pair only on one thread count (``_pair_on_one_thread_count``).
        A finalist whose re-measurement is not stable (unstable, crashed, out of memory) is
        dropped: one good run does not make a policy safe to recommend.

        Args:
            finalists: the candidates to settle; their ``rounds`` may hold earlier rounds.
            companion: fp32 at the script's batch (a finalist itself, or not), run in every
                round alongside, for the winner's speed-up.
            first_round: the number of the first round to run (rounds already held are kept).
            out_of_time: whether the time budget is spent.
            on_round: progress: the round's number (from 1), the most rounds, its runs.
            hard_limit: the one bound on the rounds in all, in place of the usual ones (for
                rounds that pair the winner, ``PAIRING_ROUNDS``).
            within: the winner and fp32 run on, even once its lead is resolved, until its
                speed-up's interval lies within this fraction of its figure either way.

        Returns:
            The finalists left (each with its gap to the leader), the failed re-measurements
            of those dropped, the number of the next round, and why it stopped
            (``STOP_SETTLED``, ``STOP_ROUND_LIMIT`` or ``STOP_TIME_BUDGET``).
        """
        active = list(finalists)
        lost: list[Measured] = []
        round_ = first_round
        while True:
            running = _round_runners(active, companion, self.user_batch, within)
            if not running:
                stop = STOP_SETTLED
                break
            paired = round_ - len(self._unpaired)  # a round a change of threads voided does not count
            if hard_limit is not None:
                over = round_ >= hard_limit
            else:
                over = round_ >= REMEASURE_LEANING_ROUNDS or (
                    paired >= REMEASURE_MAX_ROUNDS and not _leaning(active, self.user_batch))
            if over:
                stop = STOP_ROUND_LIMIT
                break
            if out_of_time():
                stop = STOP_TIME_BUDGET
                break
            if on_round:
                # The most rounds as far as is known now: the usual limit plus the rounds voided so
                # far, or the hard bound once a leaning gap runs past that limit.
                most = REMEASURE_LEANING_ROUNDS if paired >= REMEASURE_MAX_ROUNDS else round_ - paired + REMEASURE_MAX_ROUNDS
                on_round(round_ + 1, hard_limit or min(most, REMEASURE_LEANING_ROUNDS), len(running))
            for f in [*active, companion]:
                f.rounds.extend([None] * (round_ + 1 - len(f.rounds)))
            self._round_threads = []
            for f in running if round_ % 2 == 0 else reversed(running):
                failure = self._remeasure_one(f, round_)
                if failure is not None and any(f is a for a in active):
                    # fp32 alongside only (not a finalist) keeps its place: its round stays empty.
                    active = [a for a in active if a is not f]
                    lost.append(failure)
            self._remeasured.update({id(f): f for f in [*active, companion]})
            self._pair_on_one_thread_count(round_)
            round_ += 1
        _lead(active)
        return active, lost, round_, stop

    def _pair_on_one_thread_count(self, round_: int) -> None:
        """Keep paired only rounds on one thread count, the latest: a busy CPU changed the
        threads within round ``round_`` (none of its runs pair), or between it and earlier rounds
        (those no longer pair: a gain on one thread count is not the gain on another)."""
        counts = set(self._round_threads)
        if not counts:
            return
        if len(counts) > 1:
            voided = [round_]
        else:
            (count,) = counts
            voided = [r for r, t in self._rounds_on.items() if t != count]
            self._rounds_on[round_] = count
        if not voided:
            return
        get_logger().info(f"re-measurement round{'s' if len(voided) > 1 else ''} {', '.join(str(r + 1) for r in voided)} "
                          "ran on another thread count than the latest; not paired")
        for r in voided:
            self._rounds_on.pop(r, None)
            self._unpaired.add(r)
            for f in self._remeasured.values():
                if r < len(f.rounds):
                    f.rounds[r] = None

    def _remeasure_one(self, finalist: Finalist, round_: int) -> Measured | None:
        """Run a finalist once more for round ``round_``; returns what dropped it, or ``None``."""
        label = f"{finalist.candidate.label} (re-measure {round_ + 1})"
        if self.on_start:
            self.on_start(label)
        policy = finalist.candidate.policy(self.user_batch)
        result = self._limit_memory(self.runner(policy, label))
        watch = getattr(self.runner, "watch", None)
        if isinstance(watch, DisturbanceWatch):
            watch.only_fall = True  # a rise from here on would leave every round run so far unpaired
        self._round_threads.append(result.threads)
        ev = evaluate(label, policy, result, self.reference, thresholds=self.thresholds, replicate=self.replicate_curve)
        if self.yardsticks is not None:
            ev = self.yardsticks.second_look(ev)
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


def _tuned_policy(winner: Candidate, best: Finalist, speedup: Speedup, trials: _Trials, profile: HardwareProfile,
                  workload: dict[str, Any] | None, trial_count: int) -> Policy:
    """The winner's policy with its ``[tuned_on]`` record: hardware, versions, evidence (the
    speed-up is the tune's one figure, with its interval and basis)."""
    ev = trials.evaluations.get(winner)
    measured = ev.result if ev else trials.reference
    script = (workload or {}).get("script")
    return winner.policy(trials.user_batch).with_(tuned_on=TunedOn(
        hardware_fingerprint=hardware_fingerprint(profile),
        device=profile.name,
        torch=profile.torch_version or "",
        libraries=profile.libraries,
        date=dt.date.today().isoformat(),
        speedup_vs_fp32=speedup.ratio,
        speedup_low=speedup.low,
        speedup_high=speedup.high,
        speedup_basis=speedup.basis,
        speedup_threads=speedup.threads,
        # Its rounds here, when it has any: its search figure may be another worker's.
        goodput=round(best.remeasured_goodput if winner not in trials.evaluations else best.goodput, 3),
        workload_fingerprint=measured.workload_fingerprint,
        model_signature=measured.model_signature,
        script=script,
        trials=trial_count,
        cuda=profile.cuda_runtime or "",
        # The script's own batch: a run splits whatever batch it asks for, keeping it global.
        global_batch=trials.user_batch,
        script_digest=script_digest(script) if script else None,
    ))


def _speedup(best: Finalist, companion: Finalist | None, ref_cand: Candidate, reference_goodput: float, *,
             stop: str) -> Speedup | None:
    """The winner's speed-up over fp32: exactly 1 for fp32 itself; else the paired gap over the
    rounds both ran; else (nothing re-measured) its search run over fp32's reference run."""
    if best.candidate == ref_cand:
        return Speedup(1.0, 1.0, 1.0, 0, basis="the fp32 reference itself")
    gap = _paired(best, companion) if companion is not None else None
    if gap is not None and gap.pairs:
        return Speedup.of_gap(gap)
    if not reference_goodput:
        return None
    why = " (the time budget was spent first)" if stop == STOP_TIME_BUDGET else ""
    return Speedup(round(best.goodputs[0] / reference_goodput, 4), basis=f"single runs, not re-measured{why}")


def _scale_batch_note(winner: Candidate | None, user_batch: int | None) -> str:
    """A warning when the winner changes the global batch (``scale_batch``), else empty."""
    if winner is None or not winner.micro_batch or not user_batch or winner.micro_batch <= user_batch:
        return ""
    return (f"the winner uses a global batch of {winner.micro_batch} instead of {user_batch}: this changes "
            "the optimisation (learning-rate and convergence may need retuning)")


@dataclass
class _Settled:
    """The field once re-measurement has ended."""

    finalists: list[Finalist]
    dropped: list[Measured]
    rounds: int
    stop: str
    companion: Finalist | None  # fp32 at the script's batch, as re-measured alongside


def _settle_finalists(
    trials: _Trials, measured: dict[Candidate, Measured], user_batch: int | None, ref_cand: Candidate, *,
    remeasure: bool, out_of_time: Callable[[], bool] = lambda: False,
    on_round: Callable[[int, int, int], None] | None = None, within: float | None = None,
) -> _Settled:
    """The finalists once re-measurement has settled their gaps (and the winner's against
    fp32, to ``within`` of its figure when given), best first.

    A finalist that fails its re-measurement is marked so in ``measured`` and dropped. Its
    going can bring others within the noise band of the new best, so the field is drawn
    again (keeping every round run so far) until a re-measurement drops none.
    """
    history: dict[Candidate, Finalist] = {}
    ref = measured.get(ref_cand)
    ref_ev = trials.evaluations.get(ref_cand)
    companion = None
    if ref is not None:  # one object for fp32, whether it runs as a finalist or alongside
        companion = history[ref_cand] = Finalist(ref_cand, [ref.goodput], _per_sample_times(ref_ev.result) if ref_ev else [])
    dropped: list[Measured] = []
    rounds = 0
    stop = STOP_OFF
    while True:
        finalists = _finalists(measured, trials.evaluations, user_batch, history)
        if any(f.candidate not in trials.evaluations for f in finalists):
            # A figure from the stored study (an earlier run's, another worker's) is never ranked
            # against this run's: the finalists run side by side here, even where the search's
            # single runs would otherwise decide.
            remeasure = True
        if remeasure and companion is not None and finalists and all(f is not companion for f in finalists):
            companion.in_band = False
            finalists.append(companion)  # fp32 competes too: a winner must beat it side by side
        if not remeasure or not finalists or companion is None:
            for f in finalists:
                f.gap = None  # nothing re-measured: the search's runs decide
            return _Settled(finalists, dropped, rounds, stop, companion)
        finalists, lost, rounds, stop = trials.remeasure(finalists, companion, rounds, out_of_time=out_of_time,
                                                         on_round=on_round)
        if not lost:
            if len(finalists) < 2:
                for f in finalists:
                    f.gap = None
            lost, rounds = _pair_winner_locally(trials, finalists, companion, rounds, user_batch, stop, on_round,
                                                out_of_time, within)
        for m in lost:
            measured[m.candidate] = m
        dropped += lost
        if not lost:
            return _Settled(sorted(finalists, key=lambda f: -f.remeasured_goodput), dropped, rounds, stop, companion)


def _pair_winner_locally(
    trials: _Trials, finalists: list[Finalist], companion: Finalist, rounds: int, user_batch: int | None, stop: str,
    on_round: Callable[[int, int, int], None] | None, out_of_time: Callable[[], bool] = lambda: False,
    within: float | None = None,
) -> tuple[list[Measured], int]:
    """Run a would-be winner that holds fewer than ``LOCAL_PAIRS`` paired rounds beside fp32
    here, or (``within``) a speed-up interval wider than ``within`` of its figure either way,
    with fp32, until it holds them.

    Its figure may be another worker's (read from a shared study) or an earlier run's, while
    fp32's is this machine's: their ratio is no speed-up of this machine. A lone finalist, or a
    field the time budget cut short before any round, would otherwise be cached on that ratio.
    Or this worker ran it, but a change of threads left its rounds unpaired: one pair has no
    interval. These rounds run past the usual round limit, up to ``PAIRING_ROUNDS`` in all. A
    figure measured elsewhere gets them even past the time budget: nothing measured elsewhere is
    cached without them. A winner this worker ran keeps to the budget (single runs, or one pair,
    when it is spent). A winner stopped at two pairs, once its lead was resolved, can carry an
    interval of 1.03x to 1.89x (the Accelerate MLP at width 4096 on the 2-core Xeon): ``within``
    asks for a figure a user can quote.

    Returns:
        The failed re-measurement of a winner that is not stable here (empty when none), and
        the number of the next round.
    """
    for _ in range(len(finalists)):  # the pick may move once its rounds are in: at most once per finalist
        pick, _ = _pick_finalist(finalists, user_batch, stop=stop)
        if pick is None or pick.candidate == companion.candidate or _pairing_done(_paired(pick, companion), within,
                                                                                  len(companion.rounds)):
            break  # none, fp32 itself, or paired here already (as precisely as asked, or as can be)
        own = pick.candidate in trials.evaluations
        if own and (stop == STOP_TIME_BUDGET or out_of_time()):
            break  # this worker's own figure, and the budget is spent
        before = rounds

        def paired_or_spent(pick: Finalist = pick, own: bool = own) -> bool:
            return _pairing_done(_paired(pick, companion), within, len(companion.rounds)) or (own and out_of_time())

        _, lost, rounds, _ = trials.remeasure([pick], companion, rounds, on_round=on_round,
                                              out_of_time=paired_or_spent, hard_limit=PAIRING_ROUNDS, within=within)
        if lost:
            finalists.remove(pick)
            return lost, rounds
        if len(finalists) >= 2:
            _lead(finalists)
        if rounds == before:  # the round limit is reached: no more rounds can run
            break
    return [], rounds


def _paired_enough(gap: Gap, within: float | None) -> bool:
    """Whether a winner's gap over fp32 rests on ``LOCAL_PAIRS`` pairs at least, and with
    ``within``, on an interval inside that fraction of its figure either way."""
    if gap.pairs < LOCAL_PAIRS:
        return False
    if within is None:
        return True
    bound = math.log1p(within)
    return gap.low > 0 and math.isfinite(gap.high) and max(math.log(gap.high / gap.ratio),
                                                             math.log(gap.ratio / gap.low)) <= bound


def _out_of_reach(gap: Gap, within: float | None, rounds_held: int) -> bool:
    """Whether the precision ``within`` asks of a winner's speed-up cannot be reached: on
    ``REACH_MIN_PAIRS`` pairs or more, their scatter would need more pairs than the rounds left
    up to ``PAIRING_ROUNDS`` (``rounds_held`` held so far) can add."""
    if within is None or gap.pairs < REACH_MIN_PAIRS:
        return False
    return gap.pairs_for(within, gap.pairs + max(0, PAIRING_ROUNDS - rounds_held)) is None


def _pairing_done(gap: Gap, within: float | None, rounds_held: int) -> bool:
    """Whether a winner needs no more pairs beside fp32: it holds them, as precise as asked,
    or that precision is out of reach with its lead over fp32 still settled. A pair run for the
    precision can unsettle the lead (one a neighbour disturbed: 2.0x, 1.96x, then 0.4x); giving up
    the precision then would give up the decision, and hand fp32 a tie."""
    return _paired_enough(gap, within) or (gap.resolved and _out_of_reach(gap, within, rounds_held))


def _finalists(
    measured: dict[Candidate, Measured], evaluations: dict[Candidate, Evaluation], user_batch: int | None,
    history: dict[Candidate, Finalist] | None = None,
) -> list[Finalist]:
    """The best stable, feasible candidate, the runner-up, and every other within measured
    noise of the best, best first.

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
    for rank, m in enumerate(stable):
        ev = evaluations.get(m.candidate)
        noise = DEFAULT_MIN_MARGIN
        if ev and best_ev and ev.timing and best_ev.timing:
            noise = noise_band(ev.timing, best_ev.timing)
        # The runner-up always runs beside the best: one run each is never the evidence a
        # winner rests on, however wide the search's lead (a disturbed run can make it so).
        in_band = m.goodput * (1 + noise) >= best.goodput
        if rank < 2 or in_band:
            if m.candidate not in history:
                history[m.candidate] = Finalist(m.candidate, [m.goodput], _per_sample_times(ev.result) if ev else [])
            history[m.candidate].in_band = in_band
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


def _warmup_of(result: TrialResult) -> int:
    """The warm-up steps to drop, leaving at least one timed step for a short run."""
    return min(result.warmup_steps, max(0, len(result.step_times) - 1))


def _per_sample_times(result: TrialResult) -> list[float]:
    samples = samples_per_step(result) or 1
    warm = _warmup_of(result)
    return [t / samples for t in result.step_times[warm:]]


def _round_runners(active: list[Finalist], companion: Finalist, user_batch: int | None,
                   within: float | None = None) -> list[Finalist]:
    """Who runs in the next round of re-measurement; nobody once everything is settled.

    The leader and every finalist whose gap to it is not settled; with them (or alone, while
    its speed-up is unresolved, or with ``within`` not yet that precise) the finalist that would
    win now, and fp32 beside it, so that the winner's speed-up rests on rounds both ran. Nobody
    runs for fp32's own speed-up.
    """
    leader = _lead(active)
    if leader is None:
        return []
    rivals = [f for f in active if f.gap is not None and not _settled(leader, f, user_batch)]
    running = [leader, *rivals] if rivals else []
    pick, _ = _pick_finalist(active, user_batch)
    if pick is not None and pick.candidate != companion.candidate:
        gap = _paired(pick, companion)  # fewer than two pairs are unresolved, so enough pairs is checked too
        if running or not gap.resolved or not _pairing_done(gap, within, len(companion.rounds)):
            running += [f for f in (pick, companion) if all(f is not r for r in running)]
    return running


def _settled(leader: Finalist, other: Finalist, user_batch: int | None) -> bool:
    """Whether more rounds could not change who wins between the leader and ``other``.

    Either the gap is resolved (a clear lead, or a lead too small to count), or its interval
    shows that the riskier of the two cannot be more than the margin faster than the safer,
    which then wins (as a tie would go).
    """
    gap = other.gap
    if gap is None or gap.resolved:
        return True
    lead_key, other_key = preference_key(leader.candidate, user_batch), preference_key(other.candidate, user_batch)
    if lead_key > other_key:  # the leader is the riskier
        return gap.a_lead_ruled_out
    if lead_key < other_key:
        return gap.b_lead_ruled_out
    return False


def _leaning(finalists: list[Finalist], user_batch: int | None) -> bool:
    """Whether a gap still unsettled has its estimate beyond the margin on the riskier
    finalist's side: stopping now would give the safer one, as a tie, a win that more rounds
    would likely hand to the other. Call after ``_lead`` (the leader has no gap)."""
    leader = next((f for f in finalists if f.gap is None), None)
    if leader is None:
        return False
    for other in finalists:
        gap = other.gap
        if gap is None or _settled(leader, other, user_batch):
            continue
        edge = 1.0 + gap.min_margin
        lead_key, other_key = preference_key(leader.candidate, user_batch), preference_key(other.candidate, user_batch)
        if (lead_key >= other_key and gap.ratio > edge) or (lead_key <= other_key and gap.ratio < 1.0 / edge):
            return True
    return False


def _pick_winner(finalists: list[Finalist], user_batch: int | None, *, stop: str = STOP_OFF) -> tuple[Candidate | None, str]:
    """The fastest finalist, unless a safer one is within the measured noise (ties go to safety).

    Re-measured finalists are judged by their gap to the leader: a finalist whose gap is a tie
    (within the margin that counts) or unresolved when re-measurement stopped competes with
    it. Otherwise (no re-measurement) by the step times of the search's runs.
    """
    winner, note = _pick_finalist(finalists, user_batch, stop=stop)
    return (None if winner is None else winner.candidate), note


def _pick_finalist(finalists: list[Finalist], user_batch: int | None, *,
                   stop: str = STOP_OFF) -> tuple[Finalist | None, str]:
    """``_pick_winner``'s finalist and note."""
    if not finalists:
        return None, ""
    if any(f.gap is not None for f in finalists):
        return _pick_by_gap(finalists, user_batch, stop)
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
    return winner, note


def _pick_by_gap(finalists: list[Finalist], user_batch: int | None, stop: str) -> tuple[Finalist, str]:
    """The safest of the leader and the finalists whose gap to it is not resolved in its favour.

    A finalist other than fp32 takes such a tie only when it is itself resolved faster than fp32
    over the rounds both ran (two or more; with fewer, nothing paired says either way): a tie
    with the leader hands it the leader's place, not the leader's lead over fp32. (One tune of
    examples/mlp.py had bf16-true 1.14x of fp32, resolved, and 1.13x of bf16-mixed, unresolved;
    bf16-mixed took the tie and was written at 0.99x of fp32.)
    """
    leader = next(f for f in finalists if f.gap is None)
    fp32 = min((f for f in finalists if f.candidate.mode == "fp32"), default=None,
               key=lambda f: preference_key(f.candidate, user_batch))
    tied: list[Finalist] = [leader]
    passed_over: list[tuple[Finalist, Gap]] = []  # each with its gap over fp32
    for f in finalists:
        if f.gap is None or not (f.gap.verdict == "tie" or (f.gap.verdict == "unresolved" and (f.in_band or f.gap.pairs >= 2))):
            continue
        over_fp32 = None if fp32 is None or f is fp32 else _paired(f, fp32)
        if over_fp32 is not None and over_fp32.pairs >= 2 and over_fp32.verdict != "faster":
            passed_over.append((f, over_fp32))
        else:
            tied.append(f)
    winner = min(tied, key=lambda f: preference_key(f.candidate, user_batch))
    safer = [(f, g) for f, g in passed_over
             if preference_key(f.candidate, user_batch) < preference_key(winner.candidate, user_batch)]
    if winner is leader and safer and fp32 is not None:
        other, over_fp32 = min(safer, key=lambda item: preference_key(item[0].candidate, user_batch))
        return winner, _passed_over_note(leader, other, over_fp32, fp32)
    if winner is leader or winner.gap is None:
        return winner, ""
    gap = winner.gap
    if gap.verdict == "tie":
        why = f"a lead under the {gap.min_margin:.0%} that counts"
    elif gap.a_lead_ruled_out:
        why = f"no more than the {gap.min_margin:.0%} that counts"
    elif stop == STOP_TIME_BUDGET:
        why = f"not resolved after {gap.pairs} paired runs, when the time budget cut re-measurement short"
    else:
        why = f"not resolved after {gap.pairs} paired runs"
    return winner, (f"{leader.candidate.label} measured {gap.ratio:.2f}x of {winner.candidate.label} "
                    f"({_interval_text(gap)}), {why}: the safer {winner.candidate.label} wins the tie")


def _interval_text(gap: Gap) -> str:
    """A gap's interval as a tie note says it: "95% interval 0.88x to 1.12x", or "no interval yet"."""
    if not math.isfinite(gap.high):
        return "no interval yet"
    return f"{gap.confidence:.0%} interval {gap.low:.2f}x to {gap.high:.2f}x"


def _passed_over_note(leader: Finalist, other: Finalist, over_fp32: Gap, fp32: Finalist) -> str:
    """Why a safer finalist within the noise of the leader did not take the tie: it is not
    resolved faster than fp32."""
    gap = other.gap
    assert gap is not None
    return (f"{leader.candidate.label} measured {gap.ratio:.2f}x of the safer {other.candidate.label}, within the "
            f"noise, but {other.candidate.label} is not resolved faster than {fp32.candidate.label} "
            f"({over_fp32.ratio:.2f}x, {_interval_text(over_fp32)}, {over_fp32.pairs} paired runs): "
            f"{leader.candidate.label} keeps the lead")
