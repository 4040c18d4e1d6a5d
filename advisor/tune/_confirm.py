"""The confirm stage: a bounded, paired re-measure of the finalists within noise of the best,
in interleaved rounds beside fp32; ties go to the safer finalist."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from advisor.tune._judge import Evaluation, samples_per_step, warmup_of
from advisor.tune._space import Candidate, Measured, preference_key
from advisor.tune._steady import Timing
from advisor.tune._timing import DEFAULT_MIN_MARGIN, Gap, compare, noise_band, rounds_gap, summarize
from advisor.tune._trials import Trials

# The fewest paired rounds of the winner beside fp32, run here, that its speed-up rests on: its
# figure in the search may be another worker's (a shared study) or an earlier run's.
LOCAL_PAIRS = 2

# Why re-measurement ended (``TuneResult.remeasure_stop``).
STOP_SETTLED = "settled"
STOP_ROUND_LIMIT = "round limit"
STOP_TIME_BUDGET = "time budget"
STOP_OFF = "off"


@dataclass
class Finalist:
    """A candidate re-measured beside the others. ``goodputs``: the search's run, then each
    re-measurement; ``rounds``: goodput per round (``None`` where it sat out); ``gap``: the
    leader's over it. One not ``in_band`` (fp32 beside the best) ties only on two pairs or more."""

    candidate: Candidate
    goodputs: list[float]
    per_sample_times: list[float]
    rounds: list[float | None] = field(default_factory=list)
    gap: Gap | None = None
    in_band: bool = True

    @property
    def goodput(self) -> float:
        return statistics.median(self.goodputs)

    @property
    def remeasured_goodput(self) -> float:  # the search's run when there are no rounds
        runs = [g for g in self.rounds if g is not None]
        return statistics.median(runs) if runs else self.goodput

    def to_dict(self) -> dict[str, Any]:
        return {"label": self.candidate.label, "goodputs": self.goodputs, "goodput": self.goodput,
                "rounds": self.rounds, "gap_vs_leader": None if self.gap is None else self.gap.to_dict()}


@dataclass
class Confirmed:
    """The field once re-measurement has ended."""

    finalists: list[Finalist]
    dropped: list[Measured]
    rounds: int
    stop: str
    companion: Finalist | None  # fp32 at the script's batch, as re-measured alongside


def confirm(
    trials: Trials, measured: dict[Candidate, Measured], user_batch: int | None,
    ref_cand: Candidate, timing: Timing, *, remeasure: bool = True,
    out_of_time: Callable[[], bool] = lambda: False,
    on_round: Callable[[int, int, int], None] | None = None,
) -> Confirmed:
    """The finalists once re-measurement has settled their gaps, best first. One that fails its
    re-measurement is marked so in ``measured`` and dropped, which can bring others within the
    noise of the new best: the field is drawn again (keeping the rounds run) until none drops."""
    history: dict[Candidate, Finalist] = {}
    ref = measured.get(ref_cand)
    companion = None
    if ref is not None:  # one object for fp32, whether it runs as a finalist or alongside
        companion = history[ref_cand] = _finalist(ref, trials.evaluations.get(ref_cand))
    dropped: list[Measured] = []
    rounds, stop = 0, STOP_OFF
    while True:
        finalists = _finalists(measured, trials.evaluations, user_batch, history)
        if any(f.candidate not in trials.evaluations for f in finalists):
            # A figure from the stored study (an earlier run's, another worker's) is never ranked
            # against this run's: the finalists run side by side here.
            remeasure = True
        if remeasure and companion is not None and finalists and all(f is not companion for f in finalists):
            companion.in_band = False
            finalists.append(companion)  # fp32 competes too: a winner must beat it side by side
        if not remeasure or not finalists or companion is None:
            for f in finalists:
                f.gap = None  # nothing re-measured: the search's runs decide
            return Confirmed(finalists, dropped, rounds, stop, companion)
        finalists, lost, rounds, stop = _rounds(trials, finalists, companion, rounds, user_batch, timing,
                                                out_of_time=out_of_time, on_round=on_round)
        for m in lost:
            measured[m.candidate] = m
        dropped += lost
        if not lost:
            return Confirmed(sorted(finalists, key=lambda f: -f.remeasured_goodput), dropped, rounds, stop, companion)


def _rounds(
    trials: Trials, finalists: list[Finalist], companion: Finalist, first_round: int,
    user_batch: int | None, timing: Timing, *, out_of_time: Callable[[], bool],
    on_round: Callable[[int, int, int], None] | None,
) -> tuple[list[Finalist], list[Measured], int, str]:
    """Re-run finalists in interleaved rounds until each gap to the leader is settled; returns
    those left, those dropped, the next round's number and why it stopped."""
    active = list(finalists)
    lost: list[Measured] = []
    round_ = first_round
    spent = False
    while True:
        running = _round_runners(active, companion, user_batch)
        if spent or out_of_time():
            # Past the budget only a would-be winner measured elsewhere (a shared study, an earlier
            # run) runs on, beside fp32, until it holds its pairs: nothing is cached without them.
            spent = True
            foreign = _measured_elsewhere(trials, active, companion, user_batch)
            running = [] if foreign is None else [foreign, companion]
        if not running:
            stop = STOP_TIME_BUDGET if spent else STOP_SETTLED
            break
        leaning = _leaning(active, user_batch)
        if not timing.remeasure(round_, leaning=leaning):
            stop = STOP_ROUND_LIMIT
            break
        if on_round:
            on_round(round_ + 1, timing.most_rounds(round_, leaning=leaning), len(running))
        for f in [*active, companion]:
            f.rounds.extend([None] * (round_ + 1 - len(f.rounds)))
        for f in running if round_ % 2 == 0 else reversed(running):
            failure = _run_once(trials, f, round_)
            if failure is not None and any(f is a for a in active):
                # fp32 alongside only (not a finalist) keeps its place: its round stays empty.
                active = [a for a in active if a is not f]
                lost.append(failure)
        round_ += 1
    lead(active)
    return active, lost, round_, stop


def _measured_elsewhere(trials: Trials, active: list[Finalist], companion: Finalist,
                        user_batch: int | None) -> Finalist | None:
    """The finalist that would win now, when its figure is not this run's and it holds fewer than
    ``LOCAL_PAIRS`` pairs beside fp32 here."""
    lead(active)
    pick, _ = pick_winner(active, user_batch)
    if pick is None or pick is companion or pick.candidate in trials.evaluations:
        return None
    return pick if paired(pick, companion).pairs < LOCAL_PAIRS else None


def _run_once(trials: Trials, finalist: Finalist, round_: int) -> Measured | None:
    """Run a finalist once more; returns what dropped it, or ``None``."""
    ev = trials.run_again(finalist.candidate, f"{finalist.candidate.label} (re-measure {round_ + 1})")
    if ev.stable:
        if ev.goodput:  # without sample counts there is nothing to compare; the round stays empty
            finalist.goodputs.append(ev.goodput)
            finalist.rounds[round_] = ev.goodput
        return None
    return Measured(finalist.candidate, finalist.goodputs[0], ev.result.outcome == "ok", False,
                    oom=ev.result.outcome == "oom", outcome=ev.outcome, verdict_kind=ev.verdict.kind if ev.verdict else "",
                    reason=f"stable in the search, then {ev.outcome} on re-measurement {round_ + 1}: {ev.reason}")


def _finalists(measured: dict[Candidate, Measured], evaluations: dict[Candidate, Evaluation],
               user_batch: int | None, history: dict[Candidate, Finalist]) -> list[Finalist]:
    """The best stable candidate and every other within measured noise of it, best first;
    ``history`` keeps finalists (and their rounds) across fields."""
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
        # Only a candidate within the noise of the best can still win: one outside it is not
        # re-measured (a run a neighbour disturbed is run again before it counts, ``_steady``).
        in_band = m.goodput * (1 + noise) >= best.goodput
        if rank == 0 or in_band:
            if m.candidate not in history:
                history[m.candidate] = _finalist(m, ev)
            history[m.candidate].in_band = in_band
            out.append(history[m.candidate])
    return out


def lead(finalists: list[Finalist]) -> Finalist | None:
    """The re-measured leader (highest median goodput, unless another is resolved faster than
    it over their paired rounds); sets every other finalist's gap to it."""
    for f in finalists:
        f.gap = None
    if len(finalists) < 2:
        return finalists[0] if finalists else None
    leader = max(finalists, key=lambda f: f.remeasured_goodput)
    for _ in finalists:  # a pass hands the lead only to a finalist resolved faster: at most one each
        gaps = {id(f): paired(leader, f) for f in finalists if f is not leader}
        overtaking = [f for f in finalists if id(f) in gaps and gaps[id(f)].verdict == "slower"]
        if not overtaking:
            break
        leader = min(overtaking, key=lambda f: gaps[id(f)].ratio)
    for f in finalists:
        f.gap = None if f is leader else paired(leader, f)
    return leader


def paired(a: Finalist, b: Finalist) -> Gap:
    return rounds_gap(a.rounds, b.rounds)


def _finalist(m: Measured, ev: Evaluation | None) -> Finalist:
    # Times per sample compare across micro-batches.
    if ev is None:
        return Finalist(m.candidate, [m.goodput], [])
    samples, times = samples_per_step(ev.result) or 1, ev.result.step_times[warmup_of(ev.result):]
    return Finalist(m.candidate, [m.goodput], [t / samples for t in times])


def _round_runners(active: list[Finalist], companion: Finalist, user_batch: int | None) -> list[Finalist]:
    """Who runs next: the leader and every finalist whose gap to it is not settled; with them (or
    alone, while its speed-up is unresolved or under ``LOCAL_PAIRS`` pairs) the would-be winner,
    and fp32 beside it."""
    leader = lead(active)
    if leader is None:
        return []
    rivals = [f for f in active if f.gap is not None and not _settled(leader, f, user_batch)]
    running = [leader, *rivals] if rivals else []
    pick, _ = pick_winner(active, user_batch)
    if pick is not None and pick.candidate != companion.candidate:
        gap = paired(pick, companion)
        if running or not gap.resolved or gap.pairs < LOCAL_PAIRS:
            running += [f for f in (pick, companion) if all(f is not r for r in running)]
    return running


def _riskier(a: Finalist, b: Finalist, user_batch: int | None) -> int:
    """1 when ``a`` is the riskier, -1 when ``b`` is, 0 when they rank alike."""
    a_key, b_key = preference_key(a.candidate, user_batch), preference_key(b.candidate, user_batch)
    return (a_key > b_key) - (a_key < b_key)


def _settled(leader: Finalist, other: Finalist, user_batch: int | None) -> bool:
    """Whether more rounds could not change who wins: the gap is resolved, or the riskier of
    the two cannot be more than the margin faster than the safer (which then wins the tie)."""
    gap = other.gap
    if gap is None or gap.resolved:
        return True
    riskier = _riskier(leader, other, user_batch)
    return gap.a_lead_ruled_out if riskier > 0 else gap.b_lead_ruled_out if riskier < 0 else False


def _leaning(finalists: list[Finalist], user_batch: int | None) -> bool:
    """Whether an unsettled gap's estimate lies beyond the margin on the riskier finalist's side
    (stopping now would hand the safer one a likely wrong tie). Call after ``lead``."""
    leader = next((f for f in finalists if f.gap is None), None)
    for other in finalists if leader is not None else []:
        gap = other.gap
        if gap is not None and not _settled(leader, other, user_batch):
            riskier, edge = _riskier(leader, other, user_batch), 1.0 + gap.min_margin
            if (riskier >= 0 and gap.ratio > edge) or (riskier <= 0 and gap.ratio < 1.0 / edge):
                return True
    return False


def pick_winner(finalists: list[Finalist], user_batch: int | None, *,
                stop: str = STOP_OFF) -> tuple[Finalist | None, str]:
    """The fastest finalist, unless a safer one is within the measured noise (ties go to safety):
    by gap to the leader once re-measured, else by the step times of the search's runs."""
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
    """The safest of the leader and the finalists whose gap to it is not resolved in its favour;
    one other than fp32 takes such a tie only when resolved faster than fp32 over two or more
    rounds (bf16-mixed once took a tie from bf16-true and was written at 0.99x)."""
    leader = next(f for f in finalists if f.gap is None)
    fp32 = min((f for f in finalists if f.candidate.mode == "fp32"), default=None,
               key=lambda f: preference_key(f.candidate, user_batch))
    tied: list[Finalist] = [leader]
    passed_over: list[tuple[Finalist, Gap]] = []  # each with its gap over fp32
    for f in finalists:
        if f.gap is None or not (f.gap.verdict == "tie" or f.gap.verdict == "unresolved"
                                 and (f.in_band or f.gap.pairs >= 2)):
            continue
        over_fp32 = None if fp32 is None or f is fp32 else paired(f, fp32)
        if over_fp32 is not None and over_fp32.pairs >= 2 and over_fp32.verdict != "faster":
            passed_over.append((f, over_fp32))
        else:
            tied.append(f)
    winner = min(tied, key=lambda f: preference_key(f.candidate, user_batch))
    safer = [(f, g) for f, g in passed_over
             if preference_key(f.candidate, user_batch) < preference_key(winner.candidate, user_batch)]
    if winner is leader and safer and fp32 is not None:
        other, over_fp32 = min(safer, key=lambda item: preference_key(item[0].candidate, user_batch))
        ratio, name = other.gap.ratio if other.gap else math.nan, other.candidate.label
        note = (f"{leader.candidate.label} measured {ratio:.2f}x of the safer {name}, within "
                f"the noise, but {name} is not resolved faster than {fp32.candidate.label} "
                f"({over_fp32.ratio:.2f}x, {_interval_text(over_fp32)}, {over_fp32.pairs} paired "
                f"runs): {leader.candidate.label} keeps the lead")
        return winner, note
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
    if not math.isfinite(gap.high):
        return "no interval yet"
    return f"{gap.confidence:.0%} interval {gap.low:.2f}x to {gap.high:.2f}x"

