"""Timing noise, behind one seam: the ``Timing`` strategy a tune measures through.

A neighbour's burst slows some of a trial's steps, and its goodput is wrong by as much (one
disturbed fp32 reference once made every candidate look 17x faster). It shows in the step times'
spread (90th percentile over 10th), or on a GPU as another process computing on it (NVML).
``SteadyRunner`` runs such a trial, or a ``lost`` one, again a bounded number of times."""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import probes
from advisor.trial import TrialResult
from advisor.tune._judge import warmup_of
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

REMEASURE_MAX_ROUNDS = 4
"""Rounds of interleaved re-measurement on a CPU, in all, before a gap still unresolved is called
a tie (and the safer finalist wins it). In simulated tunes, four rounds resolve a 19% gap in 99 of
100 when runs scatter by 3% (a quiet GPU), but in 64 of 100 at the 7% of the shared 2-core build
machine; the rest are ties, won by the safer mode. Without the bound, a tie within 1% ran ten
rounds of every finalist, past 15 minutes."""

REMEASURE_LEANING_ROUNDS = 8
"""The rounds a gap may take on a CPU while it leans: unresolved, with its estimate beyond the
margin on the riskier finalist's side. Stopping at four would give the safer one the win that the
estimate says belongs to the other (on the 2-core Xeon, bf16-true's 11% lead over bf16-mixed in
examples/mlp.py often ended 4 rounds at [1.01, 1.27])."""

GPU_ROUNDS = 3
"""Paired rounds on a GPU: CUDA-event step times vary by a few percent, and three pairs resolve
a 5% gap there; a closer one is a tie, won by the safer mode."""


def judge_spread(spread: float | None, usual: float | None) -> tuple[bool, float | None]:
    """Whether a trial whose steps spread by ``spread`` was disturbed, and the limit it met."""
    if spread is None:
        return False, None
    limit = FIRST_SPREAD_LIMIT if usual is None else max(SPREAD_FLOOR, SPREAD_FACTOR * usual)
    return spread > limit, limit


@dataclass(frozen=True)
class Disturbance:
    """One trial the machine disturbed or lost (``kind``: spread, busy-gpu or lost). ``kept``, when
    not run again: repeats (two runs spread alike: the machine is this busy now) or spent."""

    label: str
    kind: str
    detail: str
    attempt: int
    rerun: bool
    spread: float | None = None
    limit: float | None = None
    kept: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "text": self.describe()}

    def describe(self) -> str:
        then = f"kept the least spread of {self.attempt} runs"
        if self.rerun:
            then = "run again"
        elif self.kept == "repeats":
            then += ": they spread alike, so the machine is this busy now"
        else:
            then += " (the machine stayed busy)"
        return f"{self.label}: {self.detail}; {then}"


@dataclass
class DisturbanceWatch:
    """The spreads of a tune's steady trials and every disturbance, shared by derived runners."""

    profile: HardwareProfile | None = None
    spreads: list[float] = field(default_factory=list)
    events: list[Disturbance] = field(default_factory=list)
    busy: Callable[[HardwareProfile], list[int]] | None = None  # tests pass a fake NVML reading
    ran: list[TrialResult] = field(default_factory=list)  # every trial run, reruns included

    @property
    def usual(self) -> float | None:
        return statistics.median(self.spreads) if self.spreads else None

    def gpu_others(self) -> list[int]:
        if self.profile is None or not self.profile.is_cuda:
            return []
        if self.busy is not None:
            return self.busy(self.profile)
        return probes.gpu_busy(self.profile.index or 0, uuid=self.profile.uuid)

    def check(self, result: TrialResult, label: str, attempt: int, others: list[int]) -> Disturbance | None:
        rerun = attempt <= MAX_RERUNS
        if result.outcome == "lost":
            return Disturbance(label, "lost", result.reason or "lost before the candidate was applied", attempt, rerun)
        if others:
            return Disturbance(label, "busy-gpu", f"other processes computed on the GPU meanwhile (PIDs "
                               f"{', '.join(map(str, others))})", attempt, rerun)
        if result.outcome != "ok":
            return None
        spread = step_spread(result.step_times, warmup_of(result))
        disturbed, limit = judge_spread(spread, self.usual)
        if not disturbed:
            if spread is not None:
                self.spreads.append(spread)
            return None
        usual = "no usual yet" if self.usual is None else f"usual {self.usual:.2f}x"
        return Disturbance(label, "spread", f"steps spread {spread:.2f}x from the 10th to the 90th percentile "
                           f"(limit {limit:.2f}x, {usual})", attempt, rerun, round(spread, 4), round(limit, 4))

    def keep(self, runs: list[tuple[TrialResult, Disturbance]]) -> TrialResult:
        """The run to keep once every rerun was disturbed too: the least spread, else the last."""
        read = [(event.spread, result) for result, event in runs if event.spread is not None]
        if not read:
            return runs[-1][0]
        spread, result = min(read, key=lambda item: item[0])
        self.spreads.append(spread)
        return result


class SteadyRunner:
    """A runner that runs a trial again when the machine disturbed or lost it; otherwise it is the
    wrapped runner (derived runners share the watch)."""

    _DERIVING = ("perturbed", "with_measure_steps", "with_flop_count")

    def __init__(self, runner: Any, watch: DisturbanceWatch) -> None:
        self.runner = runner
        self.watch = watch

    def __getattr__(self, name: str) -> Any:
        value = getattr(self.runner, name)
        if name in self._DERIVING:
            def derive(*args: Any, **kwargs: Any) -> SteadyRunner:
                return SteadyRunner(value(*args, **kwargs), self.watch)
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
            # Two runs that spread alike (within SPREAD_FACTOR): the machine is this busy now.
            if event.rerun and event.spread is not None and any(
                    e.spread is not None and max(e.spread, event.spread) <= SPREAD_FACTOR * min(e.spread, event.spread)
                    for _, e in runs):
                event = dataclasses.replace(event, rerun=False, kept="repeats")
            elif not event.rerun:
                event = dataclasses.replace(event, kept="spent")
            self.watch.events.append(event)
            runs.append((result, event))
            if not event.rerun:
                return self.watch.keep(runs)


@dataclass
class CpuTiming:
    """How a tune watches its trials for disturbances and bounds re-measurement: close finalists
    paired for up to ``max_rounds`` rounds (``leaning_rounds`` while a gap leans towards the
    riskier finalist)."""

    watch: DisturbanceWatch = field(default_factory=DisturbanceWatch)
    max_rounds: int = REMEASURE_MAX_ROUNDS
    leaning_rounds: int = REMEASURE_LEANING_ROUNDS

    def remeasure(self, rounds: int, *, leaning: bool) -> bool:
        return rounds < (self.leaning_rounds if leaning else self.max_rounds)

    def most_rounds(self, rounds: int, *, leaning: bool) -> int:
        return self.leaning_rounds if rounds >= self.max_rounds else self.max_rounds


@dataclass
class GpuTiming(CpuTiming):
    max_rounds: int = GPU_ROUNDS
    leaning_rounds: int = GPU_ROUNDS


Timing = CpuTiming  # the strategy's interface: GpuTiming differs in its round bounds alone


def timing_for(profile: HardwareProfile | None) -> Timing:
    watch = DisturbanceWatch(profile=profile)
    return GpuTiming(watch) if profile is not None and profile.is_cuda else CpuTiming(watch)
