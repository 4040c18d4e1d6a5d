"""Trials the machine disturbed, or lost, are run again before anything is decided on them.

A tune runs where users run it: on shared nodes, beside other jobs. A neighbour's burst during
one trial slows some of its steps, and that trial's goodput is then wrong by as much as the
burst: one disturbed fp32 reference once made every candidate look 17x faster. Such a trial
shows itself in its own step times, whose spread (the 90th percentile over the 10th) goes far
beyond what the same workload shows undisturbed. On a GPU another process computing on the
device (NVML) disturbs it the same way. And a trial that ended before its candidate was even
applied (``lost``: the machine's failure, a slow import past the timeout) says nothing about the
candidate. Each is run again, a bounded number of times, and the tune says so.

One disturbance does not show in a trial's spread at all: a CPU whose cores other processes
keep busy. Torch splits an operation over as many threads as there are cores, and every
operation then waits at its barrier for the thread the scheduler put aside; every step is slow
alike. On the 2-core build machine, beside one CPU-bound process, examples/mlp.py's step went
from 3.8 ms to 280 ms with a spread of 1.09x, and fp32 and bf16-mixed measured the same. So
before each trial on a CPU the watch reads how many of this process's cores other processes
keep busy (``cpu_busy``, from /proc/stat; a look that finds one taken looks again, longer, so
that a burst a trial outlives moves nothing), and a trial that finds one taken runs on the cores
left (``free_threads``); once a reading finds them free again, trials run on torch's own threads
again. Each trial's speed is compared only with fp32 on as many threads, and re-measured rounds
on different thread counts are never paired. Once re-measurement has run its first trial the
count only falls (``only_fall``): a rise would leave every round before it unpaired, and a
neighbour that comes and goes, such as another tune's trials, made it rise and fall until a winner
was left one pair. The tune says when the count changed.

``judge_spread`` is the pure decision; ``SteadyRunner`` wraps any runner with it, so that the
reference, its replicate, the search and every re-measurement are watched alike.
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
import sys
import time
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

BUSY_SAMPLE_S = 0.1
"""How long ``cpu_busy`` watches the cores before a trial: ten scheduler ticks of a 100 Hz clock,
enough to see a core that another process keeps busy."""

CONFIRM_SAMPLE_S = 0.3
"""How long ``cpu_busy`` looks again when its first look finds a core taken; the smaller of the two
looks counts. A neighbour that stays keeps the core busy through both; a burst a trial outlives
(a command started beside it, the kernel writing files back) does not. Beside a process busy for
0.15 s of every second, one 0.1 s look had held the rest of 8 of 9 tunes of examples/mlp.py on
one thread, and their speed-up was one thread's."""

TAKEN_SHARE = 0.7
"""A core counts as taken when other processes kept it busy this much of the time (in sum over
the cores: 1.4 busy cores are 2 taken); less is a brief burst that a trial outlives."""


def read_cpu_times(cpus: set[int] | None = None, path: str = "/proc/stat") -> tuple[int, int] | None:
    """``(busy, total)`` clock ticks summed over ``cpus`` (every CPU when ``None``) since boot, from
    /proc/stat; ``None`` where it cannot be read (not Linux)."""
    busy = total = 0
    try:
        with open(path, encoding="ascii") as stat:
            for line in stat:
                name, *fields = line.split()
                if not name.startswith("cpu") or name == "cpu" or not name[3:].isdigit():
                    continue
                if cpus is not None and int(name[3:]) not in cpus:
                    continue
                ticks = [int(v) for v in fields[:8]]
                idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle and iowait
                total += sum(ticks)
                busy += sum(ticks) - idle
    except (OSError, ValueError, IndexError):
        return None
    return (busy, total) if total else None


def own_cpu_ticks(root: int | None = None, proc: str = "/proc") -> int:
    """The clock ticks of CPU time (user and system, every thread) that process ``root`` (this
    one) and all its descendants have used: a tune's own warm server importing torch is not
    another process's load."""
    root = os.getpid() if root is None else root
    parent: dict[int, int] = {}
    ticks: dict[int, int] = {}
    try:
        entries = os.listdir(proc)
    except OSError:
        return 0
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"{proc}/{entry}/stat", encoding="ascii", errors="replace") as stat:
                text = stat.read()
            fields = text[text.rindex(")") + 2:].split()  # after the command, which may hold spaces
            parent[int(entry)], ticks[int(entry)] = int(fields[1]), int(fields[11]) + int(fields[12])
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile, or not readable
    tree, frontier = {root}, [root]
    while frontier:
        pid = frontier.pop()
        children = [child for child, ppid in parent.items() if ppid == pid and child not in tree]
        tree.update(children)
        frontier.extend(children)
    return sum(ticks.get(pid, 0) for pid in tree)


def cpu_busy(sample_s: float = BUSY_SAMPLE_S, *, confirm_s: float = CONFIRM_SAMPLE_S,
             read: Callable[[], tuple[int, int] | None] | None = None, own: Callable[[], int] = own_cpu_ticks,
             sleep: Callable[[float], None] = time.sleep) -> float | None:
    """How many of this process's cores other processes kept busy over the next ``sample_s``, in
    cores (1.0: one core's worth): the cores' busy time less this process tree's own (``own``);
    ``None`` where that cannot be read. A look that finds a core taken is followed by one over
    ``confirm_s`` (0 for none), and the smaller counts (``CONFIRM_SAMPLE_S``)."""
    cpus = usable_cpus()
    read = read or (lambda: read_cpu_times(cpus))

    def look(seconds: float) -> float | None:
        before, own_before = read(), own()
        sleep(seconds)
        after, own_after = read(), own()
        if before is None or after is None or after[1] <= before[1]:
            return None
        others = max(0, (after[0] - before[0]) - (own_after - own_before))
        return others / (after[1] - before[1]) * len(cpus)

    busy = look(sample_s)
    if busy is None or confirm_s <= 0 or taken_cores(busy) == 0:
        return busy
    again = look(confirm_s)
    return busy if again is None else min(busy, again)


def usable_cpus() -> set[int]:
    """The CPUs this process may run on."""
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return set(range(os.cpu_count() or 1))


def default_threads() -> int:
    """The threads torch uses for CPU ops by its own choice (its count when imported here, else
    one per usable CPU)."""
    torch = sys.modules.get("torch")
    if torch is not None:
        return int(torch.get_num_threads())
    return len(usable_cpus())


def taken_cores(busy: float) -> int:
    """How many cores ``busy`` cores' worth of other processes' time takes (``TAKEN_SHARE``)."""
    return math.floor(busy + 1.0 - TAKEN_SHARE)


def free_threads(busy: float | None, usable: int, default: int) -> int | None:
    """The threads a trial may use without waiting for a core others keep busy: the usable cores
    less the taken ones (``taken_cores``), at least 1; ``None`` when that is not fewer than torch's
    ``default`` (nothing to change) or ``busy`` is unknown."""
    if busy is None:
        return None
    free = max(1, usable - taken_cores(busy))
    return free if free < default else None


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
            process computed on the GPU), ``"lost"`` (it ended before the candidate was applied),
            ``"busy-cpu"`` (other processes kept some of the CPU's cores busy: the trial, and
            later ones while they stay taken, ran on fewer threads, never run again for it) or
            ``"cpu-free"`` (the cores were free again: from the trial on, torch's own threads).
        detail: what was seen, in words.
        attempt: which run of the trial it was (1 for the first).
        rerun: whether it was run again; ``False`` when a run was kept instead (see ``kept``).
        spread: the trial's spread, where read.
        limit: the spread it was held to, where read.
        kept: why a run was kept rather than run again: ``"repeats"`` (two runs spread alike, so
            the spread is this workload's on this machine as it is now), ``"spent"`` (the
            reruns are spent) or ``"threads"`` (a busy CPU: run on fewer threads instead); empty
            while it is run again.
        threads: for ``"busy-cpu"`` and ``"cpu-free"``, the threads the trial and later ones
            ran on.
    """

    label: str
    kind: str
    detail: str
    attempt: int
    rerun: bool
    spread: float | None = None
    limit: float | None = None
    kept: str = ""
    threads: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"label": self.label, "kind": self.kind, "detail": self.detail, "attempt": self.attempt,
                "rerun": self.rerun, "spread": self.spread, "limit": self.limit, "kept": self.kept,
                "threads": self.threads, "text": self.describe()}

    def describe(self) -> str:
        """One line for the report."""
        if self.kind == "cpu-free":
            return f"{self.label}: {self.detail}; from it on, trials ran on torch's {self.threads} threads again"
        if self.kept == "threads":
            plural = "s" if self.threads != 1 else ""
            return (f"{self.label}: {self.detail}; from it on, trials ran on {self.threads} thread{plural} while the "
                    "cores stayed taken, each compared only with fp32 on as many")
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
    cpu_busy: Callable[[], float | None] | None = None  # a fake reading in tests; else ``cpu_busy``
    threads: int | None = None  # while a busy CPU is seen: the threads every trial runs on
    only_fall: bool = False  # set by the tune once re-measurement runs: the threads may fall, never rise

    def threads_for(self, label: str) -> int | None:
        """The threads the next trial runs on: ``None`` (torch's own choice) on a GPU and while
        the CPU's cores are free; the free cores while other processes keep some taken. A change
        either way is an event (``"busy-cpu"``, ``"cpu-free"``); with ``only_fall`` a reading
        that finds more cores free keeps the threads as they are."""
        if self.profile is None or self.profile.is_cuda:
            return None
        default = default_threads()
        usable = len(usable_cpus())
        busy = (self.cpu_busy or cpu_busy)()
        if busy is None:
            return self.threads
        free = free_threads(busy, usable, default)
        if free == self.threads or (self.only_fall and self.threads is not None and (free is None or free > self.threads)):
            return self.threads
        if free is None:
            self.events.append(Disturbance(
                label, "cpu-free", f"the cores other processes kept busy were free again ({busy:.1f} cores' worth)",
                1, False, kept="threads", threads=default))
        else:
            self.events.append(Disturbance(
                label, "busy-cpu", f"other processes kept {min(usable, taken_cores(busy))} of this process's {usable} "
                f"cores busy ({busy:.1f} cores' worth)", 1, False, kept="threads", threads=free))
        self.threads = free
        return free

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

    _DERIVING = ("perturbed", "with_measure_steps", "with_flop_count", "with_threads")

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
            runner = self.runner
            if _sets_threads(runner):
                threads = self.watch.threads_for(label)
                if threads is not None:
                    runner = runner.with_threads(threads)
            result = runner(policy, label if attempt == 1 else f"{label} (run {attempt})")
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


def _sets_threads(runner: Any) -> bool:
    """Whether the watch picks ``runner``'s threads: a runner that can be given a thread count
    (``with_threads``), has none yet, and runs one process per trial (each rank of a multi-process
    trial keeps torch's own choice)."""
    settings = getattr(runner, "settings", None)
    return (hasattr(runner, "with_threads") and getattr(runner, "threads", None) is None
            and getattr(settings, "nproc_per_node", 1) == 1)


def _repeats(event: Disturbance, earlier: list[Disturbance]) -> bool:
    """Whether ``event``'s spread matches an earlier run's of the same trial within
    ``SPREAD_FACTOR``: the spread is then the machine's as it is now, not one burst's."""
    if event.spread is None:
        return False
    return any(e.spread is not None and max(e.spread, event.spread) <= SPREAD_FACTOR * min(e.spread, event.spread)
               for e in earlier)
