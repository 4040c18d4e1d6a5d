"""The answer stage: the winner (ties go to the safer policy), its one speed-up figure with its
interval, and everything the report, the config file and the cache need.

A candidate's TFLOP/s is the FLOPs per step the fp32 reference counted (every candidate runs the
same arithmetic) over its median step time; its MFU is that over the matmul peak probed here for
the dtype its matmuls run in, not a datasheet figure."""

from __future__ import annotations

import datetime as dt
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from advisor.runtime import script_digest
from advisor.trial import TrialResult
from advisor.tune._confirm import (
    STOP_OFF,
    STOP_TIME_BUDGET,
    Confirmed,
    Finalist,
    paired,
    pick_winner,
)
from advisor.tune._judge import Evaluation, warmup_of
from advisor.tune._plan import Plan
from advisor.tune._search import SearchOutcome
from advisor.tune._space import Candidate, Measured, SearchSpace, preference_key
from advisor.tune._steady import REMEASURE_LEANING_ROUNDS, REMEASURE_MAX_ROUNDS, Disturbance, Timing
from advisor.tune._timing import DEFAULT_CONFIDENCE, Gap, rounds_gap, step_time_range
from advisor.tune._trials import Replicate, Trials
from policies import Policy, TunedOn, mode_facts
from probes import HardwareProfile, hardware_fingerprint


@dataclass(frozen=True)
class Speedup:
    """The winner's goodput over fp32's, the one speed-up figure a tune reports; ``low``/``high``
    are ``None`` without an interval; ``basis`` says what it rests on, in words."""

    ratio: float
    low: float | None = None
    high: float | None = None
    pairs: int = 0
    confidence: float = DEFAULT_CONFIDENCE
    basis: str = ""

    @classmethod
    def of_gap(cls, gap: Gap) -> Speedup:
        bounded = gap.pairs >= 2 and math.isfinite(gap.high) and gap.low > 0
        return cls(round(gap.ratio, 4), _bound(gap.low) if bounded else None, _bound(gap.high) if bounded else None,
                   gap.pairs, gap.confidence, f"paired re-measurement, {gap.pairs} pair{'' if gap.pairs == 1 else 's'}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _bound(end: float) -> float:
    """An interval's end to four decimals, or four significant digits below 0.001x."""
    return round(end, 4) if end >= 1e-3 else float(f"{end:.4g}")


@dataclass(frozen=True)
class TuneCost:
    """What a tune cost in trial-equivalents: its wall time over the fp32 reference's measured
    window, so that start-up, warm-up and every rerun show as overhead."""

    wall_s: float
    trials: int
    window_s: float | None
    trial_equivalents: float | None

    @classmethod
    def of(cls, ran: list[TrialResult], wall_s: float, reference: TrialResult | None) -> TuneCost:
        window = None if reference is None else reference.phases.get("measured")
        return cls(round(wall_s, 3), len(ran), window, round(wall_s / window, 1) if window else None)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def compute_dtype(mode: str) -> str:
    """The dtype a mode's matmuls run in, as the matmul benchmark names it."""
    facts = mode_facts(mode)
    if facts.fp8_library is not None:
        return "fp8"
    if facts.autocast is not None:
        return facts.autocast
    if facts.weights != "fp32":
        return facts.weights
    return "tf32" if facts.tf32 else "fp32"


@dataclass(frozen=True)
class Utilisation:
    """One candidate's achieved throughput (no ``mfu`` where its dtype's peak was not probed)."""

    tflops: float
    dtype: str
    peak_tflops: float | None = None
    mfu: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def utilisation(flops_per_step: float | None, median_step_s: float | None, mode: str,
                peaks: dict[str, float] | None) -> Utilisation | None:
    """A candidate's achieved TFLOP/s and MFU; ``None`` without a FLOP count or a step time. A
    dtype measured slower than fp32 is held to fp32's rate (``dtype`` then says ``fp32``)."""
    if not flops_per_step or not median_step_s or flops_per_step <= 0 or median_step_s <= 0:
        return None
    tflops = flops_per_step / median_step_s / 1e12
    dtype = compute_dtype(mode)
    peaks = peaks or {}
    peak = peaks.get(dtype)
    if peak is not None and peaks.get("fp32") and peak < peaks["fp32"]:
        # No fast path for this dtype here (bf16 on a CPU without AVX512-BF16 or AMX): the
        # hardware's best rate for the work is fp32's, and the slow path is no peak to be near.
        dtype, peak = "fp32", peaks["fp32"]
    return Utilisation(round(tflops, 6), dtype, peak, round(tflops / peak, 6) if peak else None)


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
    round_bounds: tuple[int, int] = (REMEASURE_MAX_ROUNDS, REMEASURE_LEANING_ROUNDS)  # the timing's round bounds
    late: dict[str, str] = field(default_factory=dict)  # modes a long run's guard found unstable: not run

    def utilisation(self, cand: Candidate) -> Utilisation | None:
        ev = self.evaluations.get(cand)
        if ev is None or ev.timing is None:
            return None
        return utilisation(self.reference.result.flops_per_step, ev.timing.median, cand.mode, self.peak_tflops)

    @property
    def winner_speedup(self) -> float | None:
        return None if self.speedup is None else self.speedup.ratio

    def decisive_gap(self) -> dict[str, Any] | None:
        """The re-measured gap the choice rests on: the leader's over the winner, or over the closest
        safer finalist it beat."""
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

    def ranking(self) -> list[tuple[Candidate, Measured]]:  # stable and feasible first, by goodput
        return sorted(self.search.measured.items(),
                      key=lambda item: (not (item[1].stable and item[1].feasible), -item[1].goodput))

    def paired_speedup(self, cand: Candidate) -> Speedup | None:
        """A finalist's speed-up from its rounds beside fp32 in this run (``None`` for fp32)."""
        finalist = next((f for f in self.finalists if f.candidate == cand), None)
        if finalist is None or cand.mode == "fp32" and finalist.rounds == self.reference_rounds:
            return None
        gap = rounds_gap(finalist.rounds, self.reference_rounds)
        return Speedup.of_gap(gap) if gap.pairs else None

    def resumed(self, cand: Candidate) -> bool:  # its search figure came from the stored study
        return cand in self.search.measured and cand not in self.evaluations

    def to_dict(self) -> dict[str, Any]:
        search, space = self.search, self.space
        return {
            "winner": self.policy and self.policy.to_dict(),
            "winner_label": self.winner and self.winner.label,
            "speedup_vs_fp32": self.winner_speedup,
            "speedup": self.speedup and self.speedup.to_dict(), "tie_note": self.tie_note,
            "scale_batch_note": self.scale_batch_note, "user_batch": space.user_batch,
            "space": {"modes": list(space.modes), "micro_batches": list(space.micro_batches),
                      "fsdp": space.fsdp, "grid_size": len(space.grid())},
            "trials_run": search.runs, "trials_resumed": search.resumed, "stop_reason": search.stop_reason,
            "matmul_ratio_vs_fp32": self.dtype_ratio,
            "finalists": [f.to_dict() for f in self.finalists],
            "remeasure_rounds": self.remeasure_rounds, "remeasure_max_rounds": self.round_bounds[0],
            "remeasure_leaning_rounds": self.round_bounds[1], "remeasure_stop": self.remeasure_stop,
            "reference_rounds": self.reference_rounds, "time_budget": self.time_budget,
            "gap": self.decisive_gap(),
            "dropped_finalists": [{"label": m.candidate.label, "outcome": m.outcome, "reason": m.reason}
                                  for m in self.dropped],
            "pruned": [{"label": cand.label, "mode": cand.mode, "policy": cand.policy(space.user_batch).to_dict(),
                        "outcome": "pruned", "reason": reason} for cand, reason in search.pruned.items()],
            "reference": self.reference.to_dict(),
            "replicate": self.replicate and self.replicate.to_dict(losses=False),
            "candidates": tune_rows(self), "wall_s": self.wall_s, "window_note": self.window_note,
            "measure_steps": self.measure_steps, "extended_window": list(self.extended),
            "disturbed": [d.to_dict() for d in self.disturbances],
            "flops_per_step": self.reference.result.flops_per_step,
            "flops_basis": self.reference.result.flops_basis, "peak_tflops": dict(self.peak_tflops),
            "cost": self.cost and self.cost.to_dict(),
            "late": [{"mode": mode, "outcome": "unstable", "reason": reason} for mode, reason in self.late.items()],
        }


def tune_rows(result: TuneResult) -> list[dict[str, Any]]:
    """One row per measured candidate, in ranking order: what the results table shows."""
    rows = []
    ref_good = result.reference.goodput or 0.0
    for cand, m in result.ranking():
        ev = result.evaluations.get(cand)
        resumed = result.resumed(cand)
        # A stored figure over this run's fp32 is no ratio of anything: another run, another
        # machine state. Its row shows no search ratio; a paired figure it may have is this run's.
        search_speedup = m.goodput / ref_good if ref_good and not resumed else None
        won = cand == result.winner
        paired_figure = result.paired_speedup(cand)
        spread = ev and step_time_range(ev.result.step_times, warmup_of(ev.result))
        low, high = spread or (None, None)
        found = result.utilisation(cand)
        resumed_basis = "resumed: measured in an earlier run or by another worker"
        basis = (result.speedup.basis if won and result.speedup
                 else resumed_basis if resumed else "search run")
        rows.append({
            "label": cand.label, "mode": cand.mode,
            "policy": cand.policy(result.space.user_batch).to_dict(),
            "outcome": m.outcome or ("ok" if m.stable else "unstable"), "stable": m.stable,
            "feasible": m.feasible, "goodput": m.goodput,
            # The search ran each candidate once: its ratio to fp32 is a single run's. The
            # winner's speed-up is the tune's one figure (re-measured against fp32).
            "search_speedup_vs_fp32": search_speedup,
            "speedup_vs_fp32": result.winner_speedup if won else search_speedup,
            "speedup_basis": basis,
            # Its rounds beside fp32 in this run, when it was re-measured (the winner's is its figure).
            "paired_speedup": paired_figure and paired_figure.to_dict(), "resumed": resumed,
            # The spread of its search run's measured step times (seconds), for the ± it carries.
            "step_time_p10": low, "step_time_p90": high,
            "peak_memory": ev.result.peak_memory if ev else None,
            "tflops": found and found.tflops, "mfu": found and found.mfu,
            "mfu_dtype": found and found.dtype, "reason": m.reason, "winner": won,
        })
    return rows


def answer(confirmed: Confirmed, trials: Trials, planned: Plan, search: SearchOutcome,
           reference: Evaluation, profile: HardwareProfile, timing: Timing, *,
           workload: dict[str, Any] | None, peaks: dict[str, float], time_budget: float | None,
           late: dict[str, str], wall_s: float) -> TuneResult:
    """The winner among the confirmed finalists, its speed-up over fp32 and its tuned policy."""
    user_batch, stop, companion = trials.user_batch, confirmed.stop, confirmed.companion
    best, tie_note = pick_winner(confirmed.finalists, user_batch, stop=stop)
    winner = None if best is None else best.candidate
    policy = speedup = None
    if best is not None:
        speedup = _speedup(best, companion, planned.ref_cand, reference.goodput or 0.0, stop=stop)
        if speedup is not None:  # trials counted with those a resumed study ran
            policy = _tuned_policy(winner, best, speedup, trials, profile, workload,
                                   search.runs + search.resumed)
    batch_note = ""
    if winner and winner.micro_batch and user_batch and winner.micro_batch > user_batch:
        batch_note = (f"the winner uses a global batch of {winner.micro_batch} instead of "
                      f"{user_batch}: this changes the optimisation (learning-rate and convergence "
                      "may need retuning)")
    return TuneResult(
        reference, planned.space, search, trials.evaluations, confirmed.finalists, winner, policy,
        tie_note, batch_note, planned.ratios, wall_s, dropped=confirmed.dropped,
        remeasure_rounds=confirmed.rounds, replicate=trials.replicate, speedup=speedup,
        remeasure_stop=stop, time_budget=time_budget, window_note=trials.window_note,
        reference_rounds=list(companion.rounds) if companion else [],
        measure_steps=getattr(trials.runner, "measure_steps", None),
        extended=list(trials.yardsticks.extended) if trials.yardsticks else [],
        disturbances=list(timing.watch.events), peak_tflops=peaks,
        cost=TuneCost.of(timing.watch.ran, wall_s, trials.reference),
        round_bounds=(timing.max_rounds, timing.leaning_rounds), late=late,
    )


def _tuned_policy(winner: Candidate, best: Finalist, speedup: Speedup, trials: Trials, profile: HardwareProfile,
                  workload: dict[str, Any] | None, trial_count: int) -> Policy:
    ev = trials.evaluations.get(winner)
    measured = ev.result if ev else trials.reference
    script = (workload or {}).get("script")
    return winner.policy(trials.user_batch).with_(tuned_on=TunedOn(
        hardware_fingerprint=hardware_fingerprint(profile), device=profile.name, torch=profile.torch_version or "",
        libraries=profile.libraries, date=dt.date.today().isoformat(), speedup_vs_fp32=speedup.ratio,
        speedup_low=speedup.low, speedup_high=speedup.high, speedup_basis=speedup.basis,
        # Its rounds here, when it has any: its search figure may be another worker's.
        goodput=round(best.remeasured_goodput if winner not in trials.evaluations else best.goodput, 3),
        workload_fingerprint=measured.workload_fingerprint, model_signature=measured.model_signature,
        script=script, trials=trial_count, cuda=profile.cuda_runtime or "",
        # The script's own batch: a run splits whatever batch it asks for, keeping it global.
        global_batch=trials.user_batch, script_digest=script_digest(script) if script else None,
    ))


def _speedup(best: Finalist, companion: Finalist | None, ref_cand: Candidate, reference_goodput: float, *,
             stop: str) -> Speedup | None:
    """The winner's speed-up: 1 for fp32; else the paired gap; else its search run over fp32's."""
    if best.candidate == ref_cand:
        return Speedup(1.0, 1.0, 1.0, 0, basis="the fp32 reference itself")
    gap = paired(best, companion) if companion is not None else None
    if gap is not None and gap.pairs:
        return Speedup.of_gap(gap)
    if not reference_goodput:
        return None
    why = " (the time budget was spent first)" if stop == STOP_TIME_BUDGET else ""
    return Speedup(round(best.goodputs[0] / reference_goodput, 4), basis=f"single runs, not re-measured{why}")
