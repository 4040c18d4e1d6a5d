"""``mpadvise trial --pairs N``: fp32 and every stable candidate run again, ``N`` interleaved
rounds, so that each speed-up rests on paired runs with an interval (one run's ratio scattered
from 1.28x to 1.65x on a shared 2-core machine, where it was 1.45x)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from advisor.tune._answer import Speedup
from advisor.tune._judge import Evaluation, evaluate
from advisor.tune._run import Runner
from advisor.tune._stability import StabilityThresholds
from advisor.tune._timing import rounds_gap
from advisor.tune._trials import Comparison
from policies import Policy

PAIRS_MAX = 50


@dataclass
class PairedRuns:
    """One candidate's runs beside fp32's by round; ``dropped`` says why it left the rounds."""

    label: str
    policy: Policy
    goodputs: list[float | None] = field(default_factory=list)
    fp32_goodputs: list[float | None] = field(default_factory=list)
    dropped: str = ""

    def speedup(self) -> Speedup | None:
        gap = rounds_gap(self.goodputs, self.fp32_goodputs)
        return Speedup.of_gap(gap) if gap.pairs else None

    def to_dict(self) -> dict[str, Any]:
        speedup = self.speedup()
        return {"label": self.label, "mode": self.policy.mode, "goodputs": self.goodputs,
                "fp32_goodputs": self.fp32_goodputs, "dropped": self.dropped or None,
                "speedup_vs_fp32": None if speedup is None else speedup.to_dict()}


def run_pairs(
    runner: Runner, comparison: Comparison, rounds: int, *, thresholds: StabilityThresholds | None = None,
    on_start: Callable[[int, str], None] | None = None, on_done: Callable[[int, Evaluation], None] | None = None,
) -> list[PairedRuns]:
    """Run fp32 and each stable candidate of the comparison ``rounds`` times, interleaved (fp32
    first in even rounds, last in odd ones), each judged as the comparison judged it."""
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
            label, policy = ("fp32", fp32) if entry is None else (entry.label, entry.policy)
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
    return [ev for ev in comparison.evaluations if ev.stable and ev.goodput]


def pairs_runs(comparison: Comparison, rounds: int) -> int:
    """The most runs ``run_pairs`` makes (a progress bar's total)."""
    pairable = len(_pairable(comparison))
    return rounds * (1 + pairable) if pairable else 0
