"""Trials of candidate policies against the fp32 reference: run, measure, judge.

A *runner* turns a Policy into a TrialResult. ``ScriptRunner`` runs the user's script in a
subprocess (``mpadvise trial``/``tune``); ``FunctionRunner`` runs a function in this process
(``advisor.tune(train_fn)``, notebooks, fast tests). ``evaluate`` judges a result against the
reference: stability verdict, timing summary, goodput and speedup. ``run_replicate`` runs fp32
a second time, with the same seed and data but its initial parameters perturbed once by about
one bf16 rounding: how far it drifts from fp32 is how much this workload amplifies a
perturbation of precision's size, which widens the stability limits (``advisor.tune._spread``).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, Protocol, runtime_checkable

import probes
from advisor._entry import module_argv
from advisor._log import get_logger
from advisor.trial import (
    RUN_MODULE,
    TrialResult,
    TrialSpec,
    WarmLauncher,
    classify,
    framework_preload,
    json_float,
    ranks_argv,
    run_in_process,
    run_trial,
    trial_environment,
)
from advisor.tune._options import (
    DEFAULT_MEASURE_STEPS,
    DEFAULT_WARMUP_STEPS,
    TuneOptions,
    check_rank_device,
)
from advisor.tune._spread import still_falling
from advisor.tune._stability import StabilityThresholds, TrialCurve, Verdict, judge
from advisor.tune._steady import default_threads
from advisor.tune._timing import TimingSummary, compare, goodput, summarize
from policies import Policy
from probes import HardwareProfile, MpadviseError


class Runner(Protocol):
    """Runs one candidate and returns what it measured. The search takes one as an argument."""

    def __call__(self, policy: Policy, label: str) -> TrialResult: ...


@runtime_checkable
class Perturbable(Protocol):
    """A runner that can run the same workload with its initial parameters perturbed once (the
    replicate of fp32): same seed, same data order, only the numbers differ.

    A runner without this (a test's fake) gets no replicate: the fixed limits apply.
    """

    seed: int

    def __call__(self, policy: Policy, label: str) -> TrialResult: ...

    def perturbed(self, perturb: str, draw: int = 0) -> Runner:
        """The same runner, every trial's initial parameters perturbed by a ``perturb`` rounding
        (``draw`` picks an independent perturbation of the same size, for a second replicate)."""
        ...


@dataclass(frozen=True)
class TrialSettings:
    """The measuring window and limits shared by every trial of one comparison or tune."""

    warmup_steps: int = DEFAULT_WARMUP_STEPS
    measure_steps: int = DEFAULT_MEASURE_STEPS
    seed: int = 0
    memory_limit: int | None = None
    timeout: float = 600.0
    first_step_timeout: float = 120.0
    device: str | None = None
    framework: str | None = None
    nproc_per_node: int = 1
    perturb: str | None = None
    perturb_draw: int = 0
    count_flops: bool = False
    threads: int | None = None

    def __post_init__(self) -> None:
        for name in ("warmup_steps", "measure_steps", "nproc_per_node"):
            value = getattr(self, name)
            least = 0 if name == "warmup_steps" else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise MpadviseError(f"{name.replace('_', '-')}: {value!r} is not allowed; expected a whole number >= {least}")
        check_rank_device(self.nproc_per_node, self.device)

    @classmethod
    def for_tune(cls, options: TuneOptions) -> TrialSettings:
        """The measuring window and limits that a tune's options ask of every trial."""
        return cls(warmup_steps=options.warmup, measure_steps=options.steps, seed=options.seed,
                   memory_limit=options.memory_limit_bytes, timeout=options.timeout,
                   first_step_timeout=options.first_step_timeout, device=options.device,
                   framework=options.framework, nproc_per_node=options.nproc_per_node)

    def spec(self, policy: Policy, result_path: str, label: str) -> TrialSpec:
        return TrialSpec(
            policy=policy.to_dict(),
            result_path=result_path,
            seed=self.seed,
            warmup_steps=self.warmup_steps,
            measure_steps=self.measure_steps,
            memory_limit=self.memory_limit,
            first_step_timeout=self.first_step_timeout,
            device=self.device,
            label=label,
            framework=self.framework,
            nproc_per_node=self.nproc_per_node,
            perturb=self.perturb,
            perturb_draw=self.perturb_draw,
            count_flops=self.count_flops,
            threads=self.threads,
        )

    def launch(self, python: str, launch: Sequence[str] = ()) -> tuple[str, ...]:
        """What goes between the interpreter (``python``) and the script for a trial under
        these settings.

        One process: ``launch`` itself (a framework script's ``-P -m advisor.frameworks._boot
        FRAMEWORK``, or nothing). Several: the trial's own rank launcher (``advisor.trial._ranks``:
        no elastic agent, no TCP store, no restarts: a failure is the trial's outcome), which
        starts ``python -P -m advisor.trial._run LAUNCH SCRIPT ARGS`` as each rank: every rank
        runs the command line a one-process trial runs.
        """
        if self.nproc_per_node == 1:
            return tuple(launch)
        return (*ranks_argv(self.nproc_per_node), python, *module_argv(RUN_MODULE), *launch)


@runtime_checkable
class Extendable(Protocol):
    """A runner whose measured window can grow (``run_reference`` extends a short one)."""

    measure_steps: int

    def __call__(self, policy: Policy, label: str) -> TrialResult: ...

    def with_measure_steps(self, steps: int) -> Runner:
        """The same runner, every trial measuring ``steps`` optimizer steps."""
        ...


@runtime_checkable
class FlopCountable(Protocol):
    """A runner whose trials can count one optimizer step's FLOPs (the tune asks it of the fp32
    reference alone: every candidate runs the same arithmetic per step)."""

    def __call__(self, policy: Policy, label: str) -> TrialResult: ...

    def with_flop_count(self, on: bool = True) -> Runner:
        """The same runner, its trials counting FLOPs (``on``) or not."""
        ...


MAX_WINDOW_GROWTH = 8
"""How many times the measured window asked for may grow while fp32's loss is still falling
geometrically at its end: 40 steps become at most 320. A loss that halves every few steps has
long reached fp32's own floor, or a 16-bit mode's, by then."""


SECOND_LOOK_MULTIPLE = 8.0
"""A candidate judged stalled that would be stable were fp32's spread this many times what its
replicate measured gets a second replicate, perturbed by another draw of the same size
(``Yardsticks.second_look``). One replicate is one draw of how far a chaotic run strays: for a
normally distributed drift, one draw comes out under an eighth of the typical distance about one
time in ten, and a stable candidate then fails narrowly against it (on tests/integration/scripts/
noisy_small_drop.py, first replicates measured 0.036 and 0.015 where a second measured 0.111).
The larger of two draws is that small about one time in a hundred. A stall far beyond the spread
costs no extra run."""


REPLICATE_PERTURBATION = "bf16"
"""The format whose rounding perturbs the replicate's initial parameters: bf16's, the coarsest
of the 16-bit formats a candidate computes in (2^-8 of a value at most)."""


WAIT_IDLE_ENV = "MPADVISE_WAIT_IDLE_GPU"
"""Set (by the daemon) to make every trial wait until no other process computes on its GPU."""


WAIT_IDLE_MAX_S = 3600.0
"""How long a trial waits for its GPU before the tune gives up: an hour outlasts a colleague's
short job, and a day-long training run is better met with a clear error than a silent hang."""


def wait_until_idle(
    profile: HardwareProfile | None,
    *,
    poll_s: float = 5.0,
    max_wait_s: float = WAIT_IDLE_MAX_S,
    on_wait: Callable[[list[int]], None] | None = None,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Block until NVML shows no other compute process on the profile's GPU (no-op on a CPU).

    Tuning beside someone's training run would disturb it and measure noise. This process's
    own tree (itself, the processes it waits for, its trials) never counts as another's,
    in a container too (``probes.gpu_busy``).

    Raises:
        MpadviseError: the GPU was still busy after ``max_wait_s`` seconds.
    """
    if profile is None or not profile.is_cuda:
        return
    start = clock()
    while True:
        pids = probes.gpu_busy(profile.index or 0, uuid=profile.uuid)
        if not pids:
            return
        waited = clock() - start
        if waited >= max_wait_s:
            raise MpadviseError(
                f"{profile.name} ({profile.device}) is still busy after waiting {max_wait_s:g} s: "
                f"processes {', '.join(map(str, pids))} (PIDs as NVML reports them) compute on it; "
                f"run the tune again once they end, or unset {WAIT_IDLE_ENV} to tune beside them"
            )
        if on_wait is not None:
            on_wait(pids)
        sleep(min(poll_s, max_wait_s - waited))


def prestarted_launcher(script: str | os.PathLike[str], args: Sequence[str], launch: Sequence[str] = (), *,
                        nproc_per_node: int = 1, python: str | None = None) -> WarmLauncher:
    """A warm launcher for a script's trials, its server started now (``WarmLauncher.prestart``).

    A command calls this before its own slow work (importing torch, the probe, the matmul
    benchmark), which then runs while the server imports, and hands the launcher to its
    ``ScriptRunner`` (``warm=``). Where the trials would start cold, nothing starts.
    """
    import sys

    python = python or sys.executable
    warm = WarmLauncher(python, preload=framework_preload(launch))
    warm.prestart([*launch, os.fspath(script), *args], env=trial_environment(), nproc_per_node=nproc_per_node)
    return warm


class ScriptRunner:
    """Run ``python script args`` once per candidate, each in its own process.

    With ``wait_idle_on`` (a CUDA profile), each trial first waits until that GPU has no other
    compute process. ``launch`` goes between the interpreter and the script (see
    ``advisor.trial.run_trial``): how a framework script or a multi-process trial starts.

    Trials are forked from a warm server (``advisor.trial.WarmLauncher``) that imports torch,
    the project and a framework script's framework once, on the first trial; the runners derived
    from this one (``perturbed``, ``with_measure_steps``) share it. ``close()`` (or leaving a
    ``with`` block) ends it; a trial that cannot be forked starts cold, as does every trial
    under ``MPADVISE_WARM_TRIALS=0``.
    """

    def __init__(
        self,
        script: str | os.PathLike[str],
        args: list[str],
        settings: TrialSettings,
        *,
        python: str | None = None,
        wait_idle_on: HardwareProfile | None = None,
        launch: Sequence[str] = (),
        warm: WarmLauncher | None = None,
    ) -> None:
        import sys

        self.script = Path(script)
        self.args = list(args)
        self.settings = settings
        self.python = python or sys.executable
        self.wait_idle_on = wait_idle_on
        self.launch = tuple(launch)
        # Started on the first trial that can be forked; shared with the runners derived from this.
        self.warm = warm if warm is not None else WarmLauncher(self.python, preload=framework_preload(self.launch))
        # Trials are numbered across this runner and those derived from it.
        self._numbers = itertools.count(1)

    def close(self) -> None:
        """End the warm server, if one runs (shared: the derived runners' too)."""
        self.warm.close()

    def __enter__(self) -> ScriptRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def seed(self) -> int:
        return self.settings.seed

    def perturbed(self, perturb: str, draw: int = 0) -> ScriptRunner:
        """The same script and arguments, every trial's initial parameters perturbed once."""
        return self._with(perturb=perturb, perturb_draw=draw)

    @property
    def measure_steps(self) -> int:
        return self.settings.measure_steps

    def with_measure_steps(self, steps: int) -> ScriptRunner:
        """The same script and arguments, every trial measuring ``steps`` optimizer steps."""
        return self._with(measure_steps=steps)

    @property
    def threads(self) -> int | None:
        return self.settings.threads

    def with_threads(self, threads: int | None) -> ScriptRunner:
        """The same script and arguments, torch's CPU ops on ``threads`` threads (``None``: its own
        choice)."""
        return self._with(threads=threads)

    def with_flop_count(self, on: bool = True) -> ScriptRunner:
        """The same script and arguments, every trial counting one step's FLOPs (or none)."""
        return self._with(count_flops=on)

    def _with(self, **settings: Any) -> ScriptRunner:
        derived = ScriptRunner(self.script, self.args, dataclasses.replace(self.settings, **settings),
                               python=self.python, wait_idle_on=self.wait_idle_on, launch=self.launch, warm=self.warm)
        derived._numbers = self._numbers
        return derived

    def __call__(self, policy: Policy, label: str) -> TrialResult:
        if self.wait_idle_on is not None:
            warned: list[bool] = []

            def note(pids: list[int]) -> None:
                if not warned:
                    warned.append(True)
                    get_logger().info(f"waiting for {self.wait_idle_on.name} to be idle (other processes: {pids})")

            wait_until_idle(self.wait_idle_on, on_wait=note)
        number = next(self._numbers)
        # A directory per trial, removed as the trial ends. One kept for a runner's life was removed
        # by the garbage collector, whenever a derived runner was dropped: a Ctrl-C arriving then
        # was swallowed ("Exception ignored in: <finalize object>"), and the tune went on.
        with tempfile.TemporaryDirectory(prefix="mpadvise-trial-") as directory:
            spec = self.settings.spec(policy, os.path.join(directory, f"trial-{number}.json"), label)
            return run_trial(self.script, self.args, spec, timeout=self.settings.timeout, python=self.python,
                             launch=self.settings.launch(self.python, self.launch), warm=self.warm)


class FunctionRunner:
    """Run ``train_fn(mp)`` in this process once per candidate.

    ``train_fn`` receives the AppliedPolicy and uses it as a script would (``setup``,
    ``micro_batch_size``, ``autocast``, ``step``); it must build its model and data inside, so
    every candidate starts from the same seed.
    """

    def __init__(self, train_fn: Callable[[Any], Any], settings: TrialSettings) -> None:
        if settings.nproc_per_node > 1:
            raise MpadviseError(
                f"nproc_per_node={settings.nproc_per_node}: a function is tuned in this one process; tune a "
                f"script instead: mpadvise tune --nproc-per-node {settings.nproc_per_node} train.py"
            )
        self.train_fn = train_fn
        self.settings = settings

    @property
    def seed(self) -> int:
        return self.settings.seed

    def perturbed(self, perturb: str, draw: int = 0) -> FunctionRunner:
        """The same function, every trial's initial parameters perturbed once at ``setup()``."""
        return FunctionRunner(self.train_fn, dataclasses.replace(self.settings, perturb=perturb, perturb_draw=draw))

    @property
    def measure_steps(self) -> int:
        return self.settings.measure_steps

    def with_measure_steps(self, steps: int) -> FunctionRunner:
        """The same function, every trial measuring ``steps`` optimizer steps."""
        return FunctionRunner(self.train_fn, dataclasses.replace(self.settings, measure_steps=steps))

    def with_flop_count(self, on: bool = True) -> FunctionRunner:
        """The same function, every trial counting one step's FLOPs (or none)."""
        return FunctionRunner(self.train_fn, dataclasses.replace(self.settings, count_flops=on))

    def __call__(self, policy: Policy, label: str) -> TrialResult:
        profile = probes.profile_for(self.settings.device)
        with tempfile.TemporaryDirectory(prefix="mpadvise-trial-") as tmp:
            spec = self.settings.spec(policy, os.path.join(tmp, "result.json"), label)
            start = time.perf_counter()
            data, error = run_in_process(self.train_fn, spec, profile=profile)
            wall = time.perf_counter() - start
        return classify(
            data,
            exit_code=0 if error is None else 1,
            timed_out=False,
            stderr_tail=error or "",
            spec=spec,
            timeout=self.settings.timeout,
            wall_s=wall,
        )


@dataclass(frozen=True)
class Evaluation:
    """One candidate's result, judged against the fp32 reference."""

    label: str
    policy: Policy
    result: TrialResult
    verdict: Verdict | None
    timing: TimingSummary | None
    goodput: float | None
    speedup: float | None
    speed_verdict: str | None  # faster / slower / tie, against fp32
    final_loss_gap: float | None

    @property
    def stable(self) -> bool:
        return self.result.outcome == "ok" and self.verdict is not None and self.verdict.stable

    @property
    def outcome(self) -> str:
        if self.result.outcome != "ok":
            return self.result.outcome
        if self.verdict is not None and self.verdict.kind == "too_short":
            return "too-short"  # not judged: neither stable nor shown to be unstable
        return "ok" if self.verdict is None or self.verdict.stable else "unstable"

    @property
    def reason(self) -> str:
        if self.result.outcome != "ok":
            return self.result.reason
        return "" if self.verdict is None else self.verdict.reason

    def to_dict(self) -> dict[str, Any]:
        r = self.result
        return {
            "label": self.label,
            "mode": self.policy.mode,
            "policy": self.policy.to_dict(),
            "outcome": self.outcome,
            "stable": self.stable,
            "reason": self.reason,
            "verdict": None if self.verdict is None else self.verdict.to_dict(),
            "goodput": self.goodput,
            "speedup_vs_fp32": self.speedup,
            "speed_vs_fp32": self.speed_verdict,
            "final_loss_gap": self.final_loss_gap,
            "step_time": None if self.timing is None else self.timing.to_dict(),
            "peak_memory": r.peak_memory,
            "memory_kind": r.memory_kind,
            "skipped_steps": sum(1 for s in r.skipped if s),
            "steps": len(r.losses),
            "micro_batch": r.micro_batch,
            "grad_accum_steps": r.grad_accum_steps,
            "global_batch": r.global_batch,
            "user_batch": r.user_batch,
            "notes": list(r.notes),
            "ranks": r.ranks,
            "threads": r.threads,
            "fsdp": r.fsdp,
            "exit_code": r.exit_code,
            "stderr_tail": r.stderr_tail if self.result.outcome != "ok" else "",
            "wall_s": r.wall_s,
            "phases": r.phases,
            "losses": [json_float(v) for v in r.losses],
            "step_times": list(r.step_times),
        }


def curve_of(result: TrialResult, mode: str) -> TrialCurve:
    return TrialCurve(
        mode=mode,
        losses=result.losses,
        skipped=result.skipped,
        loss_scale=result.loss_scale if any(v is not None for v in result.loss_scale) else (),
        underflow=result.underflow if any(v is not None for v in result.underflow) else (),
        optimizer_eps=result.optimizer_eps,
    )


def samples_per_step(result: TrialResult) -> int | None:
    """Samples one optimizer step consumed (median over steps), or the reported global batch."""
    if result.samples:
        ordered = sorted(s for s in result.samples if s)
        if ordered:
            return ordered[len(ordered) // 2]
    return result.global_batch


def evaluate(
    label: str,
    policy: Policy,
    result: TrialResult,
    reference: TrialResult | None,
    *,
    thresholds: StabilityThresholds | None = None,
    replicate: TrialCurve | None = None,
) -> Evaluation:
    """Judge one result against the reference; a reference judged against itself is ``ok``.

    ``replicate`` (fp32 with perturbed initial parameters) widens the stability limits to its spread.
    """
    thresholds = thresholds or StabilityThresholds()
    summed = None if reference is None else summed_loss_split(result, reference)
    if summed is not None:
        result = result.with_outcome("unsupported", summed)
    if result.outcome != "ok" or not result.step_times:
        if result.outcome == "ok":  # ran, but the script ended before one full step was timed
            result = result.with_outcome("no-step", "the script ended before a step could be timed")
        return Evaluation(label, policy, result, None, None, None, None, None, None)
    timing = summarize(result.step_times, _warmup(result))
    good = _goodput(result, thresholds)
    verdict = None
    speedup = speed_verdict = gap = None
    if reference is not None and reference.outcome == "ok" and reference.step_times:
        verdict = judge(curve_of(result, policy.mode), curve_of(reference, "fp32"), thresholds,
                        replicate=replicate)
        gap = verdict.metrics.get("final_gap")
        speedup, speed_verdict = _speed(timing, good, reference, thresholds)
    return Evaluation(label, policy, result, verdict, timing, good, speedup, speed_verdict, gap)


def _speed(timing: TimingSummary, good: float | None, fp32: TrialResult,
           thresholds: StabilityThresholds) -> tuple[float | None, str]:
    """A trial's speed-up over the fp32 trial ``fp32``, and the speed verdict (faster, slower, tie)."""
    comparison = compare(timing, summarize(fp32.step_times, _warmup(fp32)))
    ref_good = _goodput(fp32, thresholds)
    # Goodput counts samples, so a candidate with another micro-batch compares fairly;
    # without sample counts, fall back to the step-time ratio.
    return (good / ref_good if good is not None and ref_good else comparison.ratio), comparison.verdict


def timed_against(ev: Evaluation, fp32: TrialResult, thresholds: StabilityThresholds | None = None) -> Evaluation:
    """``ev`` with its speed-up taken over another fp32 trial (one on as many threads as it ran
    on); its verdict stays the one against the reference."""
    if ev.timing is None or fp32.outcome != "ok" or not fp32.step_times:
        return ev
    speedup, speed_verdict = _speed(ev.timing, ev.goodput, fp32, thresholds or StabilityThresholds())
    return dataclasses.replace(ev, speedup=speedup, speed_verdict=speed_verdict)


def summed_loss_split(result: TrialResult, reference: TrialResult) -> str | None:
    """Why a split candidate cannot keep the script's optimisation when its loss is summed over
    the batch, or ``None``.

    ``step()`` divides each micro-batch's loss by the accumulation count, which keeps a mean-
    reduced loss's gradient. A loss summed over the batch is already smaller per micro-batch,
    and divided again its gradient shrinks by that count: the split trains at another learning
    rate. Both trials start from the same weights on the same data, so the first step shows it:
    a summed loss's micro-batches average to fp32's first loss divided by the count.
    """
    accum = result.grad_accum_steps or 1
    if accum < 2 or (reference.grad_accum_steps or 1) != 1 or not result.losses or not reference.losses:
        return None
    first, ref_first = result.losses[0], reference.losses[0]
    if not (math.isfinite(first) and math.isfinite(ref_first) and first > 0 and ref_first > 0):
        return None
    ratio = ref_first / first
    if abs(ratio / accum - 1.0) > 0.2:
        return None
    return (f"the script's loss is summed over the batch, not averaged: split into {accum} micro-batches its first "
            f"loss is {first:.4g} against fp32's {ref_first:.4g} on the whole batch ({ratio:.1f}x), so accumulating "
            f"would shrink the gradient {accum}x; use reduction='mean' to let a tune split the batch")


def _warmup(result: TrialResult) -> int:
    """The warm-up to drop, leaving at least one timed step for a short run."""
    return min(result.warmup_steps, max(0, len(result.step_times) - 1))


def _goodput(result: TrialResult, thresholds: StabilityThresholds) -> float | None:
    samples = samples_per_step(result)
    if not samples:
        return None
    return goodput(samples, result.step_times, result.skipped, _warmup(result), calibration_steps=thresholds.calibration_steps)


class ReferenceTrialError(MpadviseError):
    """The fp32 reference did not give a usable baseline: no comparison is possible."""


def check_reference(result: TrialResult) -> None:
    """Raise a one-line error when the fp32 reference cannot serve as the baseline."""
    if result.outcome != "ok":
        raise ReferenceTrialError(f"the fp32 reference trial failed ({result.outcome}): {result.reason}")
    bad = next((i for i, v in enumerate(result.losses) if not math.isfinite(v)), None)
    if bad is not None:
        raise ReferenceTrialError(
            f"no verdict is possible: the fp32 reference itself is not finite (loss {result.losses[bad]} "
            f"at step {bad}); lower the learning rate or fix the script, then try again"
        )
    if not result.step_times:
        raise ReferenceTrialError("the fp32 reference ended before one step could be timed; let the script run longer")


@dataclass(frozen=True)
class Replicate:
    """fp32 run again with the same seed and data, its initial parameters perturbed once.

    A candidate starts from fp32's own weights and sees fp32's own batches; it differs only
    numerically. So does the replicate: each parameter is multiplied once by ``1 + u * 2^-8``
    (one bf16 rounding) before the first step. How far it then drifts from fp32 is how much
    this workload amplifies a perturbation of precision's size, the noise a candidate's gap is
    judged against. A tune stores it with its study, so ``--resume`` reuses it.

    Attributes:
        seed: the seed it ran with (the reference's).
        losses: its loss per optimizer step; empty when it gave no usable curve.
        wall_s: how long its trial took, in seconds.
        note: why it gave no usable curve; empty when it did.
        reused: whether it was read back from a stored study rather than run now.
        perturb: the format whose rounding perturbed its initial parameters.
        identical: whether its losses are fp32's, bit for bit: the perturbation never reached
            the trained weights (the script set them after ``setup()``), so it measured no
            spread and the fixed limits stand alone.
        result: the trial's result when it ran in this process (never stored).
        draw: which draw of the perturbation: 0 for the replicate every comparison runs, 1 for
            the second one a narrow stall asks for (``Yardsticks.second_look``).
    """

    seed: int
    losses: tuple[float, ...] = ()
    wall_s: float = 0.0
    note: str = ""
    reused: bool = False
    perturb: str = REPLICATE_PERTURBATION
    identical: bool = False
    result: TrialResult | None = dataclasses.field(default=None, compare=False, repr=False)
    draw: int = 0

    @property
    def label(self) -> str:
        which = "replicate" if self.draw == 0 else f"replicate {self.draw + 1}"
        return f"fp32 ({which}, {self.perturb}-perturbed)"

    @property
    def curve(self) -> TrialCurve | None:
        """The curve that calibrates the verdicts, or ``None`` when there is no usable one."""
        return TrialCurve(mode="fp32", losses=self.losses) if self.losses and not self.note else None

    def to_dict(self, *, losses: bool = True) -> dict[str, Any]:
        """A JSON-ready dict (the losses left out with ``losses=False``); ``from_dict`` reads it."""
        data: dict[str, Any] = {"seed": self.seed, "perturb": self.perturb, "steps": len(self.losses),
                                "wall_s": self.wall_s, "note": self.note, "reused": self.reused,
                                "identical": self.identical, "draw": self.draw}
        if losses:
            data["losses"] = [json_float(v) for v in self.losses]
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Replicate | None:
        """Inverse of ``to_dict``; ``None`` for data that does not hold a usable replicate (a
        replicate stored without ``perturb`` ran under another seed, which measured the wrong
        noise, and is not reused)."""
        try:
            losses = tuple(float(v) for v in data["losses"])
            seed, wall = int(data["seed"]), float(data.get("wall_s") or 0.0)
            perturb = str(data["perturb"])
            draw = int(data.get("draw") or 0)
        except (KeyError, TypeError, ValueError):
            return None
        if data.get("note") or not losses or not all(math.isfinite(v) for v in losses):
            return None
        return cls(seed, losses, wall, perturb=perturb, identical=bool(data.get("identical")), draw=draw)

    @classmethod
    def from_result(cls, result: TrialResult, seed: int, reference: TrialResult,
                    perturb: str = REPLICATE_PERTURBATION, draw: int = 0) -> Replicate:
        """The replicate a trial gave; one that failed carries a note saying why, and is logged."""
        label = f"the {'second ' if draw else ''}fp32 replicate ({perturb}-perturbed)"
        bad = next((i for i, v in enumerate(result.losses) if not math.isfinite(v)), None)
        note = ""
        if result.outcome != "ok":
            note = f"{label} failed ({result.outcome}): {result.reason}"
        elif bad is not None:
            note = (f"{label} reached a {result.losses[bad]} loss at step {bad + 1}: fp32 itself diverges "
                    "after a perturbation the size of one rounding; a lower learning rate would make the "
                    "verdicts firmer")
        elif len(result.losses) < len(reference.losses):
            note = f"{label} recorded {len(result.losses)} steps, fewer than the reference's {len(reference.losses)}"
        if note:
            get_logger().warning(f"{note}; the stability verdicts use the fixed limits")
        identical = not note and tuple(result.losses[: len(reference.losses)]) == tuple(reference.losses)
        if identical:
            get_logger().warning(
                f"{label} trained bit for bit as fp32: its perturbation never reached the trained weights (does the "
                "script set them after setup(), from a checkpoint or its own initialisation?); the stability verdicts "
                "use the fixed limits")
        return cls(seed, () if note else tuple(result.losses), result.wall_s or 0.0, note, perturb=perturb,
                   identical=identical, result=result, draw=draw)


def run_replicate(
    runner: Runner,
    reference: TrialResult,
    *,
    stored: Mapping[str, Any] | None = None,
    on_start: Callable[[str], None] | None = None,
    draw: int = 0,
) -> Replicate | None:
    """fp32 again with its initial parameters perturbed, or the stored replicate of the same
    reference.

    Args:
        runner: the runner of the reference; one that cannot perturb (not ``Perturbable``)
            gets no replicate.
        reference: the fp32 reference's result.
        stored: a replicate kept with a study (``Replicate.to_dict``), reused when it has the
            same seed, the same perturbation and the reference's number of steps.
        on_start: called with the replicate's label before it runs.
        draw: which draw of the perturbation (0, or 1 for a second replicate).

    Returns:
        The replicate (possibly one with a note saying why it is unusable), or ``None``.
    """
    if not isinstance(runner, Perturbable):
        return None
    seed, perturb = runner.seed, REPLICATE_PERTURBATION
    kept = Replicate.from_dict(stored) if stored else None
    if (kept is not None and kept.seed == seed and kept.perturb == perturb and kept.draw == draw
            and len(kept.losses) == len(reference.losses)):
        return dataclasses.replace(kept, reused=True)
    label = Replicate(seed, perturb=perturb, draw=draw).label
    if on_start:
        on_start(label)
    runner = runner.perturbed(perturb, draw=draw) if draw else runner.perturbed(perturb)
    return Replicate.from_result(runner(Policy(mode="fp32"), label), seed, reference, perturb, draw)


class Reference(NamedTuple):
    """What ``run_reference`` measured: the fp32 result, the runner (its window extended
    when fp32 was still falling) that every later trial must use, and what was done."""

    result: TrialResult
    runner: Runner
    window_note: str


def run_reference(
    runner: Runner,
    *,
    thresholds: StabilityThresholds | None = None,
    on_start: Callable[[str], None] | None = None,
    deadline: float | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> Reference:
    """Run fp32, the yardstick; while its loss is still falling geometrically at the end of the
    window, run it again with twice the window, so the comparison sees where the curves level
    off (a 16-bit mode's loss floor shows only once fp32 has fallen below it).

    The window grows to at most ``MAX_WINDOW_GROWTH`` times what was asked, and only while the
    next, longer reference is expected to end before ``deadline`` (its last run's wall time,
    doubled). When it cannot grow, ``window_note`` says the window is short for this workload.

    Raises:
        MpadviseError: the reference failed or is not finite (no verdict is possible).
    """
    if on_start:
        on_start("fp32 (reference)")
    result = runner(Policy(mode="fp32"), "fp32")
    check_reference(result)
    if not isinstance(runner, Extendable):
        return Reference(result, runner, "")
    asked, note = runner.measure_steps, ""
    thresholds = thresholds or StabilityThresholds()
    while True:
        factor = still_falling(result.losses, thresholds.smoothing_window(len(result.losses)))
        if factor is None:
            return Reference(result, runner, note)
        steps = len(result.losses)
        longer = runner.measure_steps * 2
        too_long = longer > asked * MAX_WINDOW_GROWTH
        late = deadline is not None and clock() + 2.0 * (result.wall_s or 0.0) > deadline
        if too_long or late:
            why = (f"the window already grew to {MAX_WINDOW_GROWTH}x the {asked} steps asked" if too_long
                   else "the time budget leaves no room for a longer one")
            return Reference(result, runner, (
                f"the window is short for this workload: fp32's loss was still falling geometrically at its end "
                f"({factor:.1f}x over the last quarter of {steps} steps) and {why}; where the curves level off is "
                f"not seen, so a loss floor may pass; run with more --steps"))
        runner = runner.with_measure_steps(longer)
        note = (f"fp32's loss was still falling geometrically ({factor:.1f}x over the last quarter of {steps} "
                f"steps): every trial measures {longer} steps instead of {asked}, so the curves are compared "
                "where they level off")
        get_logger().info(note)
        if on_start:
            on_start(f"fp32 (reference, {longer} steps)")
        result = runner(Policy(mode="fp32"), "fp32")
        check_reference(result)


class Yardsticks:
    """fp32 and its replicate at every window length a comparison has used, and the judging of a
    candidate that extends the window while the candidate bends away from fp32.

    A stable candidate whose gap above fp32 more than doubled over the window's second half
    (``bending_away`` in its verdict) may be a stall or a floor that the window ended too soon to
    show. It runs again with twice the window, beside fp32 and the replicate at that window (run
    once per length, shared by every candidate), until it levels off, fails, or the window
    reaches ``MAX_WINDOW_GROWTH`` times what was asked or the time budget; then its verdict keeps
    the note that the window is short.

    A narrow stall is judged again against a second replicate (``second_look``).
    """

    def __init__(self, runner: Runner, reference: TrialResult, replicate: Replicate | None, *,
                 thresholds: StabilityThresholds | None = None, asked: int | None = None,
                 deadline: float | None = None, clock: Callable[[], float] = time.monotonic,
                 on_start: Callable[[str], None] | None = None) -> None:
        self.runner = runner
        self.thresholds = thresholds or StabilityThresholds()
        self.asked = asked if asked is not None else getattr(runner, "measure_steps", None)
        self.deadline, self.clock, self.on_start = deadline, clock, on_start
        self.steps = getattr(runner, "measure_steps", None)
        self._at: dict[int | None, tuple[TrialResult, TrialCurve | None]] = {
            self.steps: (reference, None if replicate is None else replicate.curve)}
        self._second: dict[int | None, Replicate | None] = {}
        self._timing: dict[tuple[int | None, int | None], TrialResult | None] = {}
        self.extended: list[str] = []

    def evaluate(self, label: str, policy: Policy, result: TrialResult) -> Evaluation:
        """Judge ``result`` against fp32 at its window, extending the window while it bends away."""
        reference, curve = self._at[self.steps]
        ev = evaluate(label, policy, result, reference, thresholds=self.thresholds, replicate=curve)
        steps = self.steps
        while self._bending(ev) and self._can_grow(steps, ev.result):
            steps = steps * 2  # type: ignore[operator]  # _can_grow checked it is an int
            at = self._yardstick(steps)
            if at is None:
                break
            reference, curve = at
            longer = f"{label} ({steps} steps)"
            self.extended.append(label)
            if self.on_start:
                self.on_start(longer)
            ran = self.runner.with_measure_steps(steps)(policy, longer)  # type: ignore[attr-defined]
            ev = evaluate(label, policy, ran, reference, thresholds=self.thresholds, replicate=curve)
        return self.on_its_threads(self.second_look(ev, steps), steps)

    def on_its_threads(self, ev: Evaluation, steps: int | None = None) -> Evaluation:
        """``ev`` with its speed-up over fp32 run on as many threads as it ran on, where that is
        not the reference's (a busy CPU changed the tune's threads after the reference ran):
        that fp32 runs once per window and thread count, shared by every candidate. The
        stability verdict stays the one against the reference."""
        steps = self.steps if steps is None else steps
        reference = self._at.get(steps, (None, None))[0]
        threads = ev.result.threads
        if reference is None or threads == reference.threads or ev.timing is None:
            return ev
        key = (steps, threads)
        if key not in self._timing:
            runner = self._runner_at(steps)
            if hasattr(runner, "with_threads"):
                runner = runner.with_threads(threads)
            count = default_threads() if threads is None else threads
            label = f"fp32 (reference, {count} thread{'s' if count != 1 else ''})"
            if self.on_start:
                self.on_start(label)
            fp32 = runner(Policy(mode="fp32"), label)
            self._timing[key] = fp32 if fp32.outcome == "ok" and fp32.step_times else None
        fp32 = self._timing[key]
        return ev if fp32 is None else timed_against(ev, fp32, self.thresholds)

    def second_replicate(self, steps: int | None = None) -> Replicate | None:
        """The second replicate at ``steps`` (the comparison's window when ``None``), if a narrow
        stall ran one there."""
        return self._second.get(self.steps if steps is None else steps)

    def second_look(self, ev: Evaluation, steps: int | None = None) -> Evaluation:
        """``ev`` judged again against a second replicate, when it is a narrow stall.

        A stall that ``SECOND_LOOK_MULTIPLE`` times fp32's measured spread would forgive may be
        one replicate's draw coming out small. A second replicate, perturbed by another draw,
        runs once per window (shared by every candidate), and the candidate is stable if it is
        stable against either: the limits then come from the wider of the two draws. Anything
        else is returned as it is.

        Args:
            ev: the evaluation against fp32 and the first replicate at ``steps``.
            steps: the window it was measured over; the comparison's own when ``None``.
        """
        steps = self.steps if steps is None else steps
        reference, curve = self._at.get(steps, (None, None))
        if reference is None or curve is None or not _narrow_stall(ev, reference, curve, self.thresholds):
            return ev
        if steps not in self._second:
            self._second[steps] = run_replicate(self._runner_at(steps), reference, on_start=self.on_start, draw=1)
        second = self._second[steps]
        if second is None or second.curve is None:
            return ev
        again = evaluate(ev.label, ev.policy, ev.result, reference, thresholds=self.thresholds, replicate=second.curve)
        return _judged_twice(ev, again, second)

    def _runner_at(self, steps: int | None) -> Runner:
        """The comparison's runner, measuring ``steps`` steps."""
        return self.runner if steps == self.steps else self.runner.with_measure_steps(steps)  # type: ignore[attr-defined]

    @staticmethod
    def _bending(ev: Evaluation) -> bool:
        return ev.stable and ev.verdict is not None and bool(ev.verdict.metrics.get("bending_away"))

    def _can_grow(self, steps: int | None, last: TrialResult) -> bool:
        if steps is None or self.asked is None or not isinstance(self.runner, Extendable):
            return False
        if steps * 2 > self.asked * MAX_WINDOW_GROWTH:
            return False
        # fp32, its replicate (unless run already) and the candidate, each twice as long as the last.
        cost = 3 * 2.0 * (last.wall_s or 0.0)
        return self.deadline is None or self.clock() + cost <= self.deadline

    def _yardstick(self, steps: int) -> tuple[TrialResult, TrialCurve | None] | None:
        """fp32 and its replicate measuring ``steps`` steps, run on first use; ``None`` when
        fp32 fails there (the shorter verdict then stands)."""
        if steps not in self._at:
            runner = self.runner.with_measure_steps(steps)  # type: ignore[attr-defined]
            label = f"fp32 (reference, {steps} steps)"
            if self.on_start:
                self.on_start(label)
            reference = runner(Policy(mode="fp32"), label)
            try:
                check_reference(reference)
            except ReferenceTrialError as exc:
                get_logger().warning(f"{label} failed, so the window stays shorter: {exc}")
                return None
            replicate = run_replicate(runner, reference, on_start=self.on_start)
            self._at[steps] = (reference, None if replicate is None else replicate.curve)
        return self._at[steps]


def _narrow_stall(ev: Evaluation, reference: TrialResult, replicate: TrialCurve,
                  thresholds: StabilityThresholds) -> bool:
    """Whether ``ev`` is a stall that ``SECOND_LOOK_MULTIPLE`` times the replicate's spread
    would forgive."""
    if ev.verdict is None or ev.verdict.kind != "stalled" or ev.result.outcome != "ok":
        return False
    wider = dataclasses.replace(thresholds, spread_multiplier=thresholds.spread_multiplier * SECOND_LOOK_MULTIPLE)
    return judge(curve_of(ev.result, ev.policy.mode), curve_of(reference, "fp32"), wider, replicate=replicate).stable


def _judged_twice(first: Evaluation, again: Evaluation, second: Replicate) -> Evaluation:
    """The evaluation against the replicate whose spread allows the candidate (the second's, when
    it is stable there; the first's otherwise), its reason saying both were run."""
    if first.verdict is None or again.verdict is None:
        return first
    if again.stable:
        base, clause = again, (f"; judged against {second.label}, since against the first replicate, which strayed "
                               f"less, it was {first.verdict.kind}")
    else:
        base, clause = first, f"; {second.label} strayed no further than that allows"
    verdict = base.verdict
    assert verdict is not None  # both were checked above
    verdict = dataclasses.replace(verdict, reason=verdict.reason + clause, metrics={**verdict.metrics, "replicates": 2})
    return dataclasses.replace(base, verdict=verdict)


class Comparison(NamedTuple):
    """What ``run_comparison`` measured: the reference, each candidate, and the replicate (and
    the second one, when a narrow stall ran it)."""

    reference: Evaluation
    evaluations: list[Evaluation]
    replicate: Replicate | None
    window_note: str = ""
    measure_steps: int | None = None
    second_replicate: Replicate | None = None

    def judged_against(self) -> dict[str, TrialCurve]:
        """The replicate curve each evaluation judged stable against the second replicate was
        judged with, by label (for a picture of the limits it met)."""
        second = None if self.second_replicate is None else self.second_replicate.curve
        if second is None:
            return {}
        return {ev.label: second for ev in self.evaluations
                if ev.stable and ev.verdict is not None and ev.verdict.metrics.get("replicates") == 2}


def run_comparison(
    runner: Runner,
    candidates: list[tuple[Policy, str]],
    *,
    thresholds: StabilityThresholds | None = None,
    on_start: Callable[[int, str], None] | None = None,
    on_done: Callable[[int, Evaluation], None] | None = None,
) -> Comparison:
    """Run the fp32 reference, its perturbed replicate, then each candidate, and
    judge each against the reference, with limits widened to the replicate's spread.

    Raises:
        MpadviseError: the reference failed or is not finite (no verdict is possible).
    """
    fp32 = Policy(mode="fp32")
    asked = runner.measure_steps if isinstance(runner, Extendable) else None
    ref_result, runner, window_note = run_reference(
        runner, thresholds=thresholds, on_start=None if on_start is None else lambda label: on_start(0, label))
    if on_done:
        on_done(0, evaluate("fp32", fp32, ref_result, ref_result, thresholds=thresholds))
    replicate = run_replicate(runner, ref_result, on_start=None if on_start is None else lambda label: on_start(1, label))
    if replicate is not None and replicate.result is not None and on_done:
        on_done(1, evaluate(replicate.label, fp32, replicate.result, None, thresholds=thresholds))
    reference = evaluate("fp32", fp32, ref_result, ref_result, thresholds=thresholds,
                         replicate=None if replicate is None else replicate.curve)
    evaluations = []
    first = 1 if replicate is None else 2
    index = first
    yardsticks = Yardsticks(runner, ref_result, replicate, thresholds=thresholds, asked=asked,
                            on_start=None if on_start is None else lambda label: on_start(index, label))
    for i, (policy, label) in enumerate(candidates, start=first):
        index = i
        if on_start:
            on_start(i, label)
        evaluation = yardsticks.evaluate(label, policy, runner(policy, label))
        evaluations.append(evaluation)
        if on_done:
            on_done(i, evaluation)
    steps = runner.measure_steps if isinstance(runner, Extendable) else None
    return Comparison(reference, evaluations, replicate, window_note, steps, yardsticks.second_replicate())
