"""Trials the machine disturbed, or lost, are run again before anything is decided on them.

A tune runs where users run it: on shared nodes, beside other jobs. A neighbour's burst during
one trial slows some of its steps, and that trial's goodput is then wrong by as much as the
burst: one disturbed fp32 reference once made every candidate look 17x faster. Such a trial
shows itself in its own step times, whose spread (the 90th percentile over the 10th) goes far
beyond what the same workload shows undisturbed. On a GPU another process computing on the
device (NVML) disturbs it the same way. And a trial that ended before its candidate was even
applied (``lost``: the machine's failure, a slow import past the timeout) says nothing about the
candidate. Each is run again, a bounded number of times, and the tune says so.

``judge_spread`` is the pure decision; ``SteadyRunner`` wraps any runner with it, so that the
reference, its replicate, the search and every re-measurement are watched alike.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import probes
from advisor.trial import TrialResult
from advisor.tune._timing import step_spread
from policies import Policy
from probes import HardwareProfile

SPREAD_FACTOR = 2.0
"""A trial is disturbed when its spread exceeds this multiple of the tune's usual spread. Quiet
runs of one workload differ in spread by well under 2x (the 2-core build machine: 1.3x to 1.6x
for examples/mlp.py); a neighbour's burst through part of a trial multiplies it by 3x to 7x."""

SPREAD_FLOOR = 1.5
"""A spread at or below this is never called disturbed: on a quiet GPU spreads sit near 1.01,
and twice that is still a steady trial."""

FIRST_SPREAD_LIMIT = 3.0
"""The limit before the tune knows its workload's usual spread (the fp32 reference, the first
trial): no steady training loop measured here spreads its 90th percentile step to 3x its 10th."""

MAX_RERUNS = 2
"""How many times a disturbed or lost trial is run again before its last run is kept as it is."""

def judge_spread(spread: float | None, usual: float | None, *, factor: float = SPREAD_FACTOR,
                 floor: float = SPREAD_FLOOR, first_limit: float = FIRST_SPREAD_LIMIT) -> tuple[bool, float | None]:
    """Whether a trial whose steps spread by ``spread`` was disturbed, and the limit it was held to.

    Args:
        spread: the trial's ``step_spread``; ``None`` is never disturbed.
        usual: the tune's usual spread so far (``None`` before the first steady trial).
        factor: how far beyond the usual spread counts as disturbed.
        floor: the least limit.
        first_limit: the limit while there is no usual spread yet.
    """
    if spread is None:
        return False, None
    limit = first_limit if usual is None else max(floor, factor * usual)
    return spread > limit, limit


@dataclass(frozen=True)
class Disturbance:
    """One trial run again because the machine disturbed or lost it.

    Attributes:
        label: the trial's label.
        kind: ``"spread"`` (its steps spread far beyond the usual), ``"busy-gpu"`` (another
            process computed on the GPU) or ``"lost"`` (it ended before the candidate was applied).
        detail: what was seen, in words.
        attempt: which run of the trial it was (1 for the first).
        rerun: whether it was run again; ``False`` when a run was kept instead (see ``kept``).
        spread: the trial's spread, where read.
        limit: the spread it was held to, where read.
        kept: why a run was kept rather than run again: ``"repeats"`` (two runs spread alike, so
            the spread is this workload's on this machine as it is now) or ``"spent"`` (the
            reruns are spent); empty while it is run again.
    """

    label: str
    kind: str
    detail: str
    attempt: int
    rerun: bool
    spread: float | None = None
    limit: float | None = None
    kept: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"label": self.label, "kind": self.kind, "detail": self.detail, "attempt": self.attempt,
                "rerun": self.rerun, "spread": self.spread, "limit": self.limit, "kept": self.kept,
                "text": self.describe()}

    def describe(self) -> str:
        """One line for the report."""
        if self.rerun:
            then = "run again"
        elif self.kept == "repeats":
            then = f"kept the least spread of {self.attempt} runs: they spread alike, so the machine is this busy now"
        else:
            then = f"kept the least spread of {self.attempt} runs (the machine stayed busy)"
        return f"{self.label}: {self.detail}; {then}"


@dataclass
class DisturbanceWatch:
    """What a tune has seen of its machine: the spreads of its steady trials, and every
    disturbance. One watch serves every runner derived from the tune's runner."""

    profile: HardwareProfile | None = None
    max_reruns: int = MAX_RERUNS
    spreads: list[float] = field(default_factory=list)
    events: list[Disturbance] = field(default_factory=list)
    busy: Callable[[HardwareProfile], list[int]] | None = None  # tests pass a fake NVML reading
    ran: list[TrialResult] = field(default_factory=list)  # every trial run, reruns included

    @property
    def usual(self) -> float | None:
        """The median spread of the steady trials so far; ``None`` before the first."""
        return statistics.median(self.spreads) if self.spreads else None

    def gpu_others(self) -> list[int]:
        """PIDs of other processes computing on the tune's GPU (none on a CPU)."""
        if self.profile is None or not self.profile.is_cuda:
            return []
        if self.busy is not None:
            return self.busy(self.profile)
        return probes.gpu_busy(self.profile.index or 0, uuid=self.profile.uuid)

    def check(self, result: TrialResult, label: str, attempt: int, others: list[int]) -> Disturbance | None:
        """The disturbance a finished trial shows, or ``None`` when it is steady (its spread then
        joins the usual)."""
        rerun = attempt <= self.max_reruns
        if result.outcome == "lost":
            return Disturbance(label, "lost", result.reason or "lost before the candidate was applied", attempt, rerun)
        if others:
            return Disturbance(label, "busy-gpu", f"other processes computed on the GPU meanwhile (PIDs "
                               f"{', '.join(map(str, others))})", attempt, rerun)
        if result.outcome != "ok":
            return None
        spread = step_spread(result.step_times, min(result.warmup_steps, max(0, len(result.step_times) - 1)))
        disturbed, limit = judge_spread(spread, self.usual)
        if not disturbed:
            if spread is not None:
                self.spreads.append(spread)
            return None
        usual = "no usual yet" if self.usual is None else f"usual {self.usual:.2f}x"
        return Disturbance(label, "spread", f"steps spread {spread:.2f}x from the 10th to the 90th percentile "
                           f"(limit {limit:.2f}x, {usual})", attempt, rerun, round(spread, 4), round(limit, 4))


    def keep(self, runs: list[tuple[TrialResult, Disturbance]]) -> TrialResult:
        """The run to keep once every rerun was disturbed too: the least spread one, whose
        spread then joins the usual (the workload evidently spreads this much here); the last
        run when none was read."""
        read = [(event.spread, result) for result, event in runs if event.spread is not None]
        if not read:
            return runs[-1][0]
        spread, result = min(read, key=lambda item: item[0])
        self.spreads.append(spread)
        return result


class SteadyRunner:
    """A runner that runs a trial again when the machine disturbed or lost it.

    Derived runners (``perturbed``, ``with_measure_steps``) share the watch. Every other
    attribute is the wrapped runner's, so a runner keeps the protocols it has (a fake without
    ``perturbed`` still has none).
    """

    _DERIVING = ("perturbed", "with_measure_steps", "with_flop_count")

    def __init__(self, runner: Any, watch: DisturbanceWatch, *,
                 on_rerun: Callable[[Disturbance], None] | None = None) -> None:
        self.runner = runner
        self.watch = watch
        self.on_rerun = on_rerun

    def __getattr__(self, name: str) -> Any:
        value = getattr(self.runner, name)
        if name in self._DERIVING:
            def derive(*args: Any, **kwargs: Any) -> SteadyRunner:
                return SteadyRunner(value(*args, **kwargs), self.watch, on_rerun=self.on_rerun)
            return derive
        return value

    def __call__(self, policy: Policy, label: str) -> TrialResult:
        runs: list[tuple[TrialResult, Disturbance]] = []
        while True:
            attempt = len(runs) + 1
            others_before = self.watch.gpu_others()
            result = self.runner(policy, label if attempt == 1 else f"{label} (run {attempt})")
            self.watch.ran.append(result)
            others = sorted(set(others_before) | set(self.watch.gpu_others()))
            event = self.watch.check(result, label, attempt, others)
            if event is None:
                return result
            if event.rerun and _repeats(event, [e for _, e in runs]):
                event = dataclasses.replace(event, rerun=False, kept="repeats")
            elif not event.rerun:
                event = dataclasses.replace(event, kept="spent")
            self.watch.events.append(event)
            if self.on_rerun is not None:
                self.on_rerun(event)
            runs.append((result, event))
            if not event.rerun:
                return self.watch.keep(runs)


def _repeats(event: Disturbance, earlier: list[Disturbance]) -> bool:
    """Whether ``event``'s spread matches an earlier run's of the same trial within
    ``SPREAD_FACTOR``: the spread is then the machine's as it is now, not one burst's."""
    if event.spread is None:
        return False
    return any(e.spread is not None and max(e.spread, event.spread) <= SPREAD_FACTOR * min(e.spread, event.spread)
               for e in earlier)
