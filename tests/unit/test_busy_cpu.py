"""A CPU whose cores other processes keep busy: the trials run on the cores left.

Torch splits each operation over one thread per core, and every operation then waits at its
barrier for the thread the scheduler put aside: every step is slow alike, and the trial's spread
does not show it. The watch reads /proc/stat before each trial; a trial that finds a core taken
runs on the cores left, one that finds them free again on torch's own threads, and its speed is
compared with fp32 on as many threads; re-measured rounds pair only on one thread count. Fake
readings and fake runners; one real /proc/stat and one real trial process.
"""

from __future__ import annotations

import dataclasses
import io
import os
import re
import subprocess
import sys

import pytest
from rich.console import Console

from advisor.cli._report import render_tune
from advisor.trial import TrialResult
from advisor.tune import _steady
from advisor.tune._engine import (
    LOCAL_PAIRS,
    PAIRING_ROUNDS,
    REMEASURE_LEANING_ROUNDS,
    REMEASURE_MAX_ROUNDS,
    tune_policy,
)
from advisor.tune._options import TuneOptions
from advisor.tune._steady import (
    DisturbanceWatch,
    SteadyRunner,
    cpu_busy,
    free_threads,
    own_cpu_ticks,
    read_cpu_times,
)
from policies import Policy, PolicyError, TunedOn, load_config
from probes import HardwareProfile

CPU = HardwareProfile(kind="cpu", name="cpu", cores=2, cpu_flags=("avx2",), torch_version="2.13.0")
GPU = HardwareProfile(kind="cuda", name="NVIDIA H200", compute_capability=(9, 0), index=0,
                      torch_version="2.11.0", memory_total=141 * 2**30)
STEPS = 40


@pytest.mark.parametrize(("busy", "usable", "default", "threads"), [
    (None, 2, 2, None),   # unknown: torch's own choice
    (0.2, 2, 2, None),    # our own bookkeeping, a brief burst
    (0.69, 2, 2, None),   # under 0.7 of a core: not taken
    (0.7, 2, 2, 1),       # one core taken
    (1.0, 2, 2, 1),
    (2.0, 2, 2, 1),       # never fewer than one
    (1.0, 16, 8, None),   # 15 free logical CPUs still hold torch's 8 threads
    (10.0, 16, 8, 6),
])
def test_free_threads(busy, usable, default, threads) -> None:
    assert free_threads(busy, usable, default) == threads


def test_busy_cores_come_from_proc_stat(tmp_path) -> None:
    stat = tmp_path / "stat"
    # user nice system idle iowait irq softirq steal
    stat.write_text("cpu  30 0 10 160 0 0 0 0 0 0\ncpu0 20 0 5 75 0 0 0 0 0 0\ncpu1 10 0 5 85 0 0 0 0 0 0\nintr 1\n")
    assert read_cpu_times(path=str(stat)) == (40, 200)
    assert read_cpu_times({1}, path=str(stat)) == (15, 100)
    assert read_cpu_times(path=str(tmp_path / "missing")) is None
    readings = iter([(100, 1000), (280, 1200)])  # 180 of 200 ticks busy
    own = iter([500, 540])  # 40 of them this process tree's own
    busy = cpu_busy(read=lambda: next(readings), own=lambda: next(own), sleep=lambda s: None, confirm_s=0)
    assert busy == pytest.approx(0.7 * len(_steady.usable_cpus()))


class BurstyMachine:
    """Two cores at 100 clock ticks a second, on a clock that moves only when the watch sleeps or a
    trial runs; another process keeps one core busy for the first ``burst`` s of every ``period``."""

    def __init__(self, period: float = 1.0, burst: float = 0.15) -> None:
        self.period, self.burst, self.now, self.caught = period, burst, 0.0, 0

    def others(self, at: float) -> float:
        """Seconds the other process has been busy by ``at``."""
        full, rest = divmod(at, self.period)
        return full * self.burst + min(rest, self.burst)

    def read(self) -> tuple[int, int]:
        return round(self.others(self.now) * 100), round(self.now * 100) * 2

    def sleep(self, seconds: float) -> None:
        self.now += seconds

    def busy(self, **kwargs) -> float | None:
        first = (self.others(self.now + _steady.BUSY_SAMPLE_S) - self.others(self.now)) / _steady.BUSY_SAMPLE_S
        self.caught += _steady.taken_cores(first)  # a first look that falls in a burst
        return cpu_busy(read=self.read, own=lambda: 0, sleep=self.sleep, **kwargs)


@pytest.mark.parametrize(("start", "expected"), [
    (0.0, 0.05 / 0.3),   # the first look is all burst (1.0 core); the longer one finds its last 0.05 s
    (0.5, 0.0),          # between bursts: nothing taken
    (0.97, 0.08 / 0.3),  # the first look catches the burst's start (0.7 of a core), the longer one the rest
])
def test_a_burst_shorter_than_the_second_look_takes_no_core(monkeypatch, start, expected) -> None:
    monkeypatch.setattr(_steady, "usable_cpus", lambda: {0, 1})
    machine = BurstyMachine()
    machine.now = start
    busy = machine.busy()
    assert busy == pytest.approx(expected, abs=1e-9) and _steady.taken_cores(busy) == 0


def test_a_neighbour_that_stays_takes_its_core_in_both_looks(monkeypatch) -> None:
    monkeypatch.setattr(_steady, "usable_cpus", lambda: {0, 1})
    machine = BurstyMachine(period=1.0, burst=1.0)  # busy all the time
    slept: list[float] = []
    busy = cpu_busy(read=machine.read, own=lambda: 0, sleep=lambda s: slept.append(s) or machine.sleep(s))
    assert busy == pytest.approx(1.0) and _steady.taken_cores(busy) == 1
    assert slept == [_steady.BUSY_SAMPLE_S, _steady.CONFIRM_SAMPLE_S]


def test_this_process_trees_own_work_is_not_anothers() -> None:
    # A child of this process spinning through the sample: its CPU time is this tree's own, and
    # comes off the cores' busy time (whatever else the machine runs meanwhile).
    child = subprocess.Popen([sys.executable, "-c", "import time\nend = time.monotonic() + 30\nwhile time.monotonic() < end: pass"])
    owns: list[int] = []
    try:
        cpu_busy(0.5, own=lambda: owns.append(own_cpu_ticks()) or owns[-1])
    finally:
        child.kill()
        child.wait()
    assert owns[1] - owns[0] >= 5  # clock ticks of 10 ms: the child ran at least 50 ms of the 500


def test_this_machine_can_be_read() -> None:
    busy = cpu_busy(0.05)
    assert busy is None or 0.0 <= busy <= len(_steady.usable_cpus()) + 0.5


def _watch(readings: list[float], profile: HardwareProfile = CPU) -> DisturbanceWatch:
    values = iter(readings)
    return DisturbanceWatch(profile=profile, cpu_busy=lambda: next(values))


def test_threads_follow_the_cores_down_and_up_again(monkeypatch) -> None:
    monkeypatch.setattr(_steady, "usable_cpus", lambda: {0, 1})
    monkeypatch.setattr(_steady, "default_threads", lambda: 2)
    watch = _watch([0.0, 1.0, 1.0, 0.0, 0.1, 1.0])
    assert watch.threads_for("fp32") is None
    assert watch.threads_for("bf16-mixed") == 1
    assert watch.threads_for("fp16-mixed") == 1
    assert watch.threads_for("bf16-true") is None  # the neighbour left: torch's own threads again
    assert watch.threads_for("fp16-true") is None
    assert watch.threads_for("fp32 (re-measure 1)") == 1
    fell, rose, fell_again = watch.events
    assert [e.kind for e in watch.events] == ["busy-cpu", "cpu-free", "busy-cpu"]
    assert fell.threads == 1 and not fell.rerun and fell.kept == "threads"
    assert fell.describe().startswith("bf16-mixed: other processes kept 1 of this process's 2 cores busy (1.0")
    assert "from it on, trials ran on 1 thread while the cores stayed taken" in fell.describe()
    assert rose.threads == 2 and rose.describe() == (
        "bf16-true: the cores other processes kept busy were free again (0.0 cores' worth); "
        "from it on, trials ran on torch's 2 threads again")
    assert fell_again.label == "fp32 (re-measure 1)"


def test_every_core_taken_leaves_one_thread_and_says_so(monkeypatch) -> None:
    monkeypatch.setattr(_steady, "usable_cpus", lambda: {0, 1})
    monkeypatch.setattr(_steady, "default_threads", lambda: 2)
    watch = _watch([2.0])
    assert watch.threads_for("fp32") == 1
    assert "kept 2 of this process's 2 cores busy (2.0 cores' worth)" in watch.events[0].describe()


def test_a_gpu_trial_reads_no_cpu() -> None:
    watch = DisturbanceWatch(profile=GPU, cpu_busy=lambda: pytest.fail("read"))
    assert watch.threads_for("fp32") is None


class Runner:
    """fp32 and bf16-mixed over ``STEPS`` steps: bf16-mixed 1.25x faster on any thread count, and
    each thread count as fast as its share of the machine (2 threads twice 1)."""

    def __init__(self, *, threads: int | None = None, calls: list[tuple[str, int | None]] | None = None) -> None:
        self.seed, self.measure_steps, self.threads = 0, STEPS, threads
        self.calls = [] if calls is None else calls

    def with_threads(self, threads: int | None) -> Runner:
        return type(self)(threads=threads, calls=self.calls)

    def __call__(self, policy: Policy, label: str) -> TrialResult:
        self.calls.append((label, self.threads))
        step = (0.010 if policy.mode == "fp32" else 0.008) * (2 if self.threads == 1 else 1)
        n = STEPS + 3
        return TrialResult(
            outcome="ok", label=label, policy=policy.to_dict(), losses=tuple(2.0 - i / 100 for i in range(n)),
            step_times=(step,) * n, samples=(64,) * n, skipped=(False,) * n, warmup_steps=3, user_batch=64,
            global_batch=64, workload_fingerprint="ab" * 8, model_signature="cd" * 8, wall_s=1.0,
            threads=self.threads)


def test_a_trial_runs_on_the_threads_the_watch_allows(monkeypatch) -> None:
    monkeypatch.setattr(_steady, "usable_cpus", lambda: {0, 1})
    monkeypatch.setattr(_steady, "default_threads", lambda: 2)
    runner = Runner()
    steady = SteadyRunner(runner, _watch([0.0, 1.0, 0.0]))
    assert [steady(Policy(mode="fp32"), f"t{i}").threads for i in range(3)] == [None, 1, None]
    # Asked for a thread count, a runner keeps it: no reading.
    pinned = SteadyRunner(runner, DisturbanceWatch(profile=CPU, cpu_busy=lambda: pytest.fail("read")))
    assert pinned.with_threads(2)(Policy(mode="fp32"), "pinned").threads == 2


def test_a_multi_process_trial_keeps_torchs_threads() -> None:
    class Ranks(Runner):
        settings = type("Settings", (), {"nproc_per_node": 2})()

    steady = SteadyRunner(Ranks(), DisturbanceWatch(profile=CPU, cpu_busy=lambda: pytest.fail("read")))
    assert steady(Policy(mode="fp32"), "fp32").threads is None


def test_a_tune_compares_a_trial_with_fp32_on_as_many_threads(monkeypatch) -> None:
    # A neighbour takes a core after the fp32 reference: bf16-mixed's trials run on 1 thread, twice
    # as slow as on 2. Against the 2-thread reference it measured 0.625x and fp32 won.
    monkeypatch.setattr(_steady, "usable_cpus", lambda: {0, 1})
    monkeypatch.setattr(_steady, "default_threads", lambda: 2)
    readings = iter([0.0] + [1.0] * 200)
    monkeypatch.setattr(_steady, "cpu_busy", lambda: next(readings))
    runner = Runner()
    options = TuneOptions(trials=3, no_priors=True, modes=("bf16-mixed",))
    result = tune_policy(runner, CPU, options, study_name="busy", dtype_ratio={"fp32": 1.0, "bf16": 2.0})
    assert result.winner is not None and result.winner.mode == "bf16-mixed"
    assert result.speedup.ratio == pytest.approx(1.25, rel=0.01)
    labels = [label for label, _ in runner.calls]
    assert labels.count("fp32 (reference, 1 thread)") == 1
    assert [t for label, t in runner.calls if label == "fp32"] == [None]  # the reference: before the neighbour
    bf16 = next(ev for ev in result.evaluations.values() if ev.policy.mode == "bf16-mixed")
    assert bf16.result.threads == 1 and bf16.speedup == pytest.approx(1.25)
    assert [d.kind for d in result.disturbances] == ["busy-cpu"]


class UnevenRunner(Runner):
    """bf16-mixed's gain over fp32 differs with the threads, as on the 2-core Xeon (1.14x on
    torch's 2 threads, 1.33x on 1)."""

    GAIN = {None: 1.14, 1: 1.33}

    def __call__(self, policy: Policy, label: str) -> TrialResult:
        result = super().__call__(policy, label)
        if policy.mode == "fp32":
            return result
        step = 0.010 / self.GAIN[self.threads] * (2 if self.threads == 1 else 1)
        return dataclasses.replace(result, step_times=(step,) * len(result.step_times))


def _tune_beside(monkeypatch, runner: Runner, reading, name: str, modes: tuple[str, ...] = ("bf16-mixed",), **kwargs):
    """A tune of fp32 and ``modes`` on a 2-core CPU whose busy cores ``reading()`` gives."""
    monkeypatch.setattr(_steady, "usable_cpus", lambda: {0, 1})
    monkeypatch.setattr(_steady, "default_threads", lambda: 2)
    monkeypatch.setattr(_steady, "cpu_busy", reading)
    options = TuneOptions(trials=3, no_priors=True, modes=modes)
    return tune_policy(runner, CPU, options, study_name=name, dtype_ratio={"fp32": 1.0, "bf16": 2.0}, **kwargs)


def _uneven_tune(monkeypatch, readings: list[float], name: str):
    values = iter(readings)
    runner = UnevenRunner()
    return runner, _tune_beside(monkeypatch, runner, lambda: next(values), name)


class TimedRunner(UnevenRunner):
    """An ``UnevenRunner`` whose every trial, on any thread count, moves ``machine``'s clock on by
    ``trial_s``."""

    def __init__(self, machine: BurstyMachine, trial_s: float, **kwargs) -> None:
        super().__init__(**kwargs)
        self.machine, self.trial_s = machine, trial_s

    def with_threads(self, threads: int | None) -> TimedRunner:
        return TimedRunner(self.machine, self.trial_s, threads=threads, calls=self.calls)

    def __call__(self, policy: Policy, label: str) -> TrialResult:
        self.machine.sleep(self.trial_s)
        return super().__call__(policy, label)


@pytest.mark.parametrize("trial_s", [0.53, 0.61, 0.77])
def test_a_neighbours_brief_bursts_leave_the_tune_on_torchs_threads(monkeypatch, trial_s) -> None:
    # Beside a process busy for 0.15 s of every second (0.15 of a core on average), one 0.1 s
    # look before a trial sometimes fell in a burst and found a core taken; in re-measurement the
    # threads then stayed at one for the rest of the tune, whose speed-up was one thread's (1.33x
    # here, against 1.14x on torch's threads). Two of three real tunes of examples/mlp.py ended so.
    machine = BurstyMachine()
    runner = TimedRunner(machine, trial_s)
    result = _tune_beside(monkeypatch, runner, machine.busy, f"bursts-{trial_s}")
    assert machine.caught >= 1  # a look before a trial fell in a burst
    assert [e.kind for e in result.disturbances] == []
    assert result.winner is not None and result.speedup.ratio == pytest.approx(1.14, rel=1e-3)
    assert all(threads is None for _, threads in runner.calls)


def test_a_burst_that_ends_leaves_the_speed_up_on_torchs_threads(monkeypatch) -> None:
    # A neighbour keeps a core busy from the reference through the search, then leaves. The
    # rounds that decide run on torch's 2 threads again, so the speed-up is the one the script
    # will see there (1.14x), not the 1.33x of one thread. With the threads held at 1 for the
    # rest of the tune, it was 1.33x.
    runner, result = _uneven_tune(monkeypatch, [1.0] * 3 + [0.0] * 200, "burst")
    assert result.winner is not None and result.winner.mode == "bf16-mixed"
    assert result.speedup.ratio == pytest.approx(1.14, rel=1e-3) and result.speedup.pairs >= 2
    assert [e.kind for e in result.disturbances] == ["busy-cpu", "cpu-free"]
    assert all(threads is None for label, threads in runner.calls if "re-measure" in label)


@pytest.mark.parametrize("change", range(2, 14))
@pytest.mark.parametrize("busy_first", [False, True], ids=["arrives", "leaves"])
def test_no_speed_up_blends_rounds_on_two_thread_counts(monkeypatch, change, busy_first) -> None:
    # The neighbour arrives (or leaves) before the change-th trial. A speed-up over rounds on
    # both thread counts would lie between 1.14x and 1.33x, the gain of neither.
    before, after = (1.0, 0.0) if busy_first else (0.0, 1.0)
    _, result = _uneven_tune(monkeypatch, [before] * (change - 1) + [after] * 200, f"change-{change}")
    assert result.winner is not None and result.winner.mode == "bf16-mixed"
    ratio = result.speedup.ratio
    assert ratio == pytest.approx(1.14, rel=1e-3) or ratio == pytest.approx(1.33, rel=1e-3), (change, ratio)
    # The figure names the threads it was measured on: 1.33x is one thread's gain.
    assert result.speedup.threads == (1 if ratio == pytest.approx(1.33, rel=1e-3) else None), (change, ratio)


def _report(data: dict) -> str:
    console = Console(record=True, width=300, file=io.StringIO())
    render_tune(data, console)
    return console.export_text()


def test_a_speed_up_measured_on_fewer_threads_says_so_wherever_it_goes(monkeypatch, tmp_path) -> None:
    # A neighbour holds a core for the whole tune: every run has one thread, and the speed-up is
    # one thread's gain (1.33x), not the 1.14x of torch's two. The config file, the cache's
    # record and the report carried it as the machine's figure, with nothing to say so.
    _, result = _uneven_tune(monkeypatch, [1.0] * 200, "held")
    speedup = result.speedup
    assert result.winner is not None and speedup.ratio == pytest.approx(1.33, rel=1e-3) and speedup.pairs >= 2
    assert (speedup.threads, speedup.torch_threads) == (1, 2)
    assert speedup.basis.endswith(", on 1 of torch's 2 threads, other processes keeping cores busy")
    data = result.to_dict()
    assert (data["speedup"]["threads"], data["speedup"]["torch_threads"]) == (1, 2)
    tuned = result.policy.tuned_on
    assert tuned.speedup_threads == 1 and tuned.speedup_basis == speedup.basis
    path = result.policy.save(tmp_path / "held.mpadvise.toml")
    assert "speedup_threads = 1" in path.read_text()
    assert load_config(path).tuned_on.speedup_threads == 1
    assert "the speed-up was measured on 1 of torch's 2 threads: other processes kept cores busy" in _report(data)


def test_a_speed_up_on_torchs_threads_names_none(monkeypatch, tmp_path) -> None:
    _, result = _uneven_tune(monkeypatch, [1.0] * 3 + [0.0] * 200, "burst-ends")
    assert result.speedup.threads is None and result.speedup.torch_threads is None
    assert "threads" not in result.speedup.basis
    assert result.policy.tuned_on.speedup_threads is None
    assert "speedup_threads" not in result.policy.save(tmp_path / "quiet.mpadvise.toml").read_text()
    assert "measured on" not in _report(result.to_dict())


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "1"])
def test_a_config_file_whose_thread_count_is_no_count_is_refused(value) -> None:
    with pytest.raises(PolicyError, match="tuned_on.speedup_threads"):
        TunedOn(speedup_threads=value)


def test_the_trial_process_uses_the_threads_asked(tmp_path) -> None:
    script = tmp_path / "threads.py"
    script.write_text("import torch\nprint(torch.get_num_threads())\n")
    env = {**os.environ, "MPADVISE_TRIAL_THREADS": "1"}
    out = subprocess.run([sys.executable, "-P", "-m", "advisor.trial._run", str(script)], env=env,
                         capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "1"
    del env["MPADVISE_TRIAL_THREADS"]
    out = subprocess.run([sys.executable, "-P", "-m", "advisor.trial._run", str(script)], env=env,
                         capture_output=True, text=True, timeout=120, check=True)
    assert int(out.stdout.strip()) >= 1


@pytest.mark.parametrize("fall", range(2, 14))
def test_no_pair_mixes_thread_counts_wherever_the_threads_fall(monkeypatch, fall) -> None:
    # The neighbour arrives before the fall-th trial, search or re-measurement. Each run's goodput
    # over its partner's is 1.25 on one thread count and 2.5 or 0.625 across two; only the first
    # may be paired.
    monkeypatch.setattr(_steady, "usable_cpus", lambda: {0, 1})
    monkeypatch.setattr(_steady, "default_threads", lambda: 2)
    readings = iter([0.0] * (fall - 1) + [1.0] * 200)
    monkeypatch.setattr(_steady, "cpu_busy", lambda: next(readings))
    options = TuneOptions(trials=3, no_priors=True, modes=("bf16-mixed",))
    result = tune_policy(Runner(), CPU, options, study_name="fall", dtype_ratio={"fp32": 1.0, "bf16": 2.0})
    fp32 = result.reference_rounds
    for finalist in result.finalists:
        if finalist.candidate.mode == "fp32":
            continue
        pairs = [(x, y) for x, y in zip(finalist.rounds, fp32) if x is not None and y is not None]
        assert pairs and all(x / y == pytest.approx(1.25) for x, y in pairs), (fall, finalist.rounds, fp32)
    assert result.winner is not None and result.winner.mode == "bf16-mixed"


def test_a_reference_on_fewer_threads_times_later_trials_against_fp32_on_torchs(monkeypatch) -> None:
    # The neighbour was there for the reference only: the trials after it run on torch's
    # threads, timed against an fp32 run there, whose label gives the count.
    runner, result = _uneven_tune(monkeypatch, [1.0] + [0.0] * 200, "reference-busy")
    labels = [label for label, _ in runner.calls]
    assert labels.count("fp32 (reference, 2 threads)") == 1
    bf16 = next(ev for ev in result.evaluations.values() if ev.policy.mode == "bf16-mixed")
    assert bf16.result.threads is None and bf16.speedup == pytest.approx(1.14)


def _alternating(label: str, factor: float) -> float:
    """A run's scatter: ``factor`` in odd rounds of re-measurement, its inverse in even ones, 1
    outside re-measurement."""
    found = re.search(r"\(re-measure (\d+)\)", label)
    return 1.0 if found is None else factor if int(found.group(1)) % 2 else 1 / factor


class TiedRunner(UnevenRunner):
    """bf16-mixed as fast as fp32 on any thread count, 4% off either way in alternate rounds of
    re-measurement: a tie that four paired rounds cannot resolve."""

    GAIN = {None: 1.0, 1: 1.0}

    def __call__(self, policy: Policy, label: str) -> TrialResult:
        result = super().__call__(policy, label)
        if policy.mode == "fp32":
            return result
        scatter = _alternating(label, 1.04)
        return dataclasses.replace(result, step_times=tuple(t * scatter for t in result.step_times))


def test_rounds_a_change_of_threads_left_unpaired_do_not_count_towards_the_limit(monkeypatch) -> None:
    # The neighbour arrives after two rounds of re-measurement: those no longer pair, and four
    # rounds on one thread follow before the tie is called. Counted, they left two. The progress
    # bar's most rounds grows by one as each is voided (round 2 straddles the change, round 1 goes
    # once round 3 ran on one thread): a tie that does not lean never runs an eighth.
    runner = TiedRunner()
    progress: list[tuple[int, int]] = []
    result = _tune_beside(monkeypatch, runner,
                          lambda: float(sum("re-measure" in label for label, _ in runner.calls) >= 6), "late",
                          on_round=lambda number, most, runs: progress.append((number, most)))
    assert result.remeasure_stop == "round limit" and result.remeasure_rounds == 6
    assert progress == [(1, 4), (2, 4), (3, 5), (4, 6), (5, 6), (6, 6)]
    assert result.reference_rounds[:2] == [None, None]
    assert sum(r is not None for r in result.reference_rounds) == 4
    assert result.winner is not None and result.winner.mode == "fp32"


def test_a_neighbour_that_comes_and_goes_leaves_the_winner_paired(monkeypatch) -> None:
    # Another tune beside this one: its trials keep a core busy before every other run of
    # re-measurement. Followed down and up again, the threads changed within every round, so no
    # round paired: eight rounds, and the winner's speed-up rested on single runs. Once
    # re-measurement runs, the threads only fall: every later round pairs on one thread.
    runner = UnevenRunner()

    def reading() -> float:
        done = sum("re-measure" in label for label, _ in runner.calls)
        return float(done % 2)

    result = _tune_beside(monkeypatch, runner, reading, "comes-and-goes")
    assert result.winner is not None and result.winner.mode == "bf16-mixed"
    assert result.speedup.pairs >= LOCAL_PAIRS and result.speedup.low is not None
    assert result.speedup.ratio == pytest.approx(1.33, rel=1e-3)
    assert [e.kind for e in result.disturbances] == ["busy-cpu"]
    assert result.remeasure_rounds <= REMEASURE_MAX_ROUNDS


class LeaningRunner(Runner):
    """fp32 twice as slow as bf16-mixed; bf16-true 8% faster than bf16-mixed, 12% more or less in
    alternate rounds of re-measurement: a lead that leans its way and never resolves in eight."""

    def __call__(self, policy: Policy, label: str) -> TrialResult:
        result = super().__call__(policy, label)
        if policy.mode == "fp32":
            return result
        gain = 2.0 * (1.08 * _alternating(label, 1.12) if policy.mode == "bf16-true" else 1.0)
        step = result.step_times[0] * (0.010 / 0.008) / gain
        return dataclasses.replace(result, step_times=(step,) * len(result.step_times))


def test_a_winner_left_one_pair_by_a_late_neighbour_is_paired_again(monkeypatch) -> None:
    # The neighbour arrives with the eighth and last round: the seven before no longer pair, and
    # the winner held one pair beside fp32, a speed-up with no interval. Rounds of the winner and
    # fp32 alone follow, past the usual bound, until it holds two.
    started: list[int] = []
    result = _tune_beside(monkeypatch, LeaningRunner(),
                          lambda: float(bool(started) and started[-1] >= REMEASURE_LEANING_ROUNDS), "late-leaning",
                          modes=("bf16-mixed", "bf16-true"), on_round=lambda number, most, runs: started.append(number))
    assert result.winner is not None and result.winner.mode != "fp32"
    assert REMEASURE_LEANING_ROUNDS in started  # it leaned through all eight rounds
    assert result.speedup.pairs >= LOCAL_PAIRS and result.speedup.low is not None, result.speedup
    assert result.remeasure_rounds <= PAIRING_ROUNDS
