"""Interleaved pairs for ``mpadvise trial --pairs N``: fp32 and every candidate that came out
stable run again, ``N`` rounds, back to back and in alternating order, so that each speed-up
rests on paired runs with a confidence interval, as a tune's re-measurement does, and not on
one run of each (on a shared 2-core machine, one run's ratio scattered from 1.28x to 1.65x
where the start-up-free figure was 1.45x).

A candidate that is not stable in a round leaves the rounds, with the reason: one stable
run does not make it safe.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from advisor.tune._answer import Speedup
from advisor.tune._judge import Evaluation, evaluate
from advisor.tune._reference import Comparison
from advisor.tune._run import Runner
from advisor.tune._stability import StabilityThresholds
from advisor.tune._timing import Gap, paired_gap
from policies import Policy

PAIRS_MAX = 50


@dataclass
class PairedRuns:
    """One candidate's runs beside fp32's, round by round.

    Attributes:
        label: the candidate's label.
        policy: its policy.
        goodputs: its goodput in each round; ``None`` where it did not pair (not run, no
            sample count, or fp32's run failed).
        fp32_goodputs: fp32's goodput in the same rounds, ``None`` likewise.
        dropped: why it left the rounds (its outcome and reason), empty while it stayed.
    """

    label: str
    policy: Policy
    goodputs: list[float | None] = field(default_factory=list)
    fp32_goodputs: list[float | None] = field(default_factory=list)
    dropped: str = ""

    def _paired_rounds(self) -> list[int]:
        """The rounds that paired."""
        return [r for r, (c, f) in enumerate(zip(self.goodputs, self.fp32_goodputs)) if c is not None and f is not None]

    def gap(self) -> Gap:
        """Its gap over fp32, over the rounds that paired."""
        rounds = self._paired_rounds()
        return paired_gap([self.goodputs[r] or 0.0 for r in rounds], [self.fp32_goodputs[r] or 0.0 for r in rounds])

    def speedup(self) -> Speedup | None:
        """Its paired speed-up over fp32 with its interval; ``None`` without a single pair."""
        return Speedup.of_gap(self.gap()) if self._paired_rounds() else None

    def to_dict(self) -> dict[str, Any]:
        speedup = self.speedup()
        return {"label": self.label, "mode": self.policy.mode, "goodputs": self.goodputs,
                "fp32_goodputs": self.fp32_goodputs, "dropped": self.dropped or None,
                "speedup_vs_fp32": None if speedup is None else speedup.to_dict()}


def run_pairs(
    runner: Runner,
    comparison: Comparison,
    rounds: int,
    *,
    thresholds: StabilityThresholds | None = None,
    on_start: Callable[[int, str], None] | None = None,
    on_done: Callable[[int, Evaluation], None] | None = None,
) -> list[PairedRuns]:
    """Run fp32 and each candidate the comparison found stable, ``rounds`` times, interleaved.

    Round ``r`` runs fp32 first and the candidates after it when ``r`` is even, and the
    reverse when it is odd, so that a slow spell of the machine falls on both sides alike.
    Each run is judged as the comparison judged it (against its reference, with the
    replicate's limits). No round starts once no candidate is left.

    Args:
        runner: runs one trial, as the comparison's did.
        comparison: what ``run_comparison`` measured.
        rounds: how many rounds (0 runs nothing).
        on_start, on_done: progress, with each run's index from 0.

    Returns:
        One ``PairedRuns`` per candidate the comparison found stable with a goodput, in its order.
    """
    reference = comparison.reference.result
    fp32 = Policy(mode="fp32")
    replicate = None if comparison.replicate is None else comparison.replicate.curve
    judged_against = comparison.judged_against()
    runs = [PairedRuns(ev.label, ev.policy) for ev in _pairable(comparison)]
    index = 0
    for round_ in range(rounds):
        active = [p for p in runs if not p.dropped]
        if not active:
            break
        order: list[PairedRuns | None] = [None, *active]  # None: fp32
        if round_ % 2:
            order.reverse()
        got: dict[str, float | None] = {}
        fp32_got: float | None = None
        for entry in order:
            label = "fp32" if entry is None else entry.label
            policy = fp32 if entry is None else entry.policy
            shown = f"{label} (pair {round_ + 1})"
            if on_start:
                on_start(index, shown)
            result = runner(policy, shown)
            ev = evaluate(shown, policy, result, reference, thresholds=thresholds,
                          replicate=judged_against.get(label, replicate))
            if on_done:
                on_done(index, ev)
            index += 1
            if entry is None:
                fp32_got = ev.goodput if result.outcome == "ok" else None
                continue
            if not ev.stable:
                entry.dropped = f"{ev.outcome} in pair {round_ + 1}: {ev.reason}"
            got[label] = ev.goodput if ev.stable else None
        for entry in active:
            paired = fp32_got is not None and got.get(entry.label) is not None
            entry.goodputs.append(got.get(entry.label) if paired else None)
            entry.fp32_goodputs.append(fp32_got if paired else None)
    return runs


def _pairable(comparison: Comparison) -> list[Evaluation]:
    """The candidates the comparison found stable with a goodput: those the rounds pair."""
    return [ev for ev in comparison.evaluations if ev.stable and ev.goodput]


def pairs_runs(comparison: Comparison, rounds: int) -> int:
    """The most runs ``run_pairs`` makes for this comparison: fp32 and each pairable
    candidate, every round (for a progress bar's total); 0 when none is pairable."""
    pairable = len(_pairable(comparison))
    return rounds * (1 + pairable) if pairable else 0
