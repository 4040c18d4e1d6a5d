"""The run stage: a runner turns a Policy into a TrialResult. ``ScriptRunner`` runs the user's
script in a subprocess, ``FunctionRunner`` a function in this process (``advisor.tune``)."""

from __future__ import annotations

import copy
import dataclasses
import itertools
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import probes
from advisor._entry import module_argv
from advisor._log import get_logger
from advisor.trial import (
    DEFAULT_MEASURE_STEPS,
    DEFAULT_WARMUP_STEPS,
    RUN_MODULE,
    TrialResult,
    TrialSpec,
    WarmLauncher,
    classify,
    framework_preload,
    ranks_argv,
    run_in_process,
    run_trial,
    trial_environment,
)
from advisor.tune._options import TuneOptions, check_rank_device
from policies import Policy
from probes import HardwareProfile, MpadviseError


class Runner(Protocol):
    def __call__(self, policy: Policy, label: str) -> TrialResult: ...


@runtime_checkable
class Perturbable(Protocol):
    """A runner that can perturb the initial parameters once (fp32's replicate); one without this
    (a test's fake) gets no replicate."""

    seed: int

    def __call__(self, policy: Policy, label: str) -> TrialResult: ...

    def perturbed(self, perturb: str, draw: int = 0) -> Runner: ...


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

    def __post_init__(self) -> None:
        for name in ("warmup_steps", "measure_steps", "nproc_per_node"):
            value = getattr(self, name)
            least = 0 if name == "warmup_steps" else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise MpadviseError(f"{name.replace('_', '-')}: {value!r} is not allowed; expected a whole number >= {least}")
        check_rank_device(self.nproc_per_node, self.device)

    @classmethod
    def for_tune(cls, options: TuneOptions) -> TrialSettings:
        return cls(warmup_steps=options.warmup, measure_steps=options.steps, seed=options.seed,
                   memory_limit=options.memory_limit_bytes, timeout=options.timeout,
                   first_step_timeout=options.first_step_timeout, device=options.device,
                   framework=options.framework, nproc_per_node=options.nproc_per_node)

    def spec(self, policy: Policy, result_path: str, label: str) -> TrialSpec:
        shared = {k: v for k, v in dataclasses.asdict(self).items() if k != "timeout"}
        return TrialSpec(policy=policy.to_dict(), result_path=result_path, label=label, **shared)

    def launch(self, python: str, launch: Sequence[str] = ()) -> tuple[str, ...]:
        """What goes between the interpreter and the script: ``launch`` for one process; for
        several, the trial's own rank launcher (no elastic agent, no restarts: a failure is the
        trial's outcome), each rank running what a one-process trial runs."""
        if self.nproc_per_node == 1:
            return tuple(launch)
        return (*ranks_argv(self.nproc_per_node), python, *module_argv(RUN_MODULE), *launch)


@runtime_checkable
class Extendable(Protocol):
    """A runner whose measured window can grow (``run_reference`` extends a short one)."""

    measure_steps: int

    def __call__(self, policy: Policy, label: str) -> TrialResult: ...

    def with_measure_steps(self, steps: int) -> Runner: ...


# Set (by the daemon) to make every trial wait until no other process computes on its GPU.
WAIT_IDLE_ENV = "MPADVISE_WAIT_IDLE_GPU"
# An hour outlasts a colleague's short job; a day-long run is better met with a clear error.
WAIT_IDLE_MAX_S = 3600.0


def wait_until_idle(
    profile: HardwareProfile | None, *, poll_s: float = 5.0, max_wait_s: float = WAIT_IDLE_MAX_S,
    on_wait: Callable[[list[int]], None] | None = None, sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Block until NVML shows no other compute process on the profile's GPU (no-op on a CPU; this
    process's own tree never counts), at most ``max_wait_s`` seconds; ``on_wait`` (default: one
    line logged) hears of each wait."""
    if profile is None or not profile.is_cuda:
        return
    start, said = clock(), False
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
        elif not said:
            said = True
            get_logger().info(f"waiting for {profile.name} to be idle (other processes: {pids})")
        sleep(min(poll_s, max_wait_s - waited))


def prestarted_launcher(script: str | os.PathLike[str], args: Sequence[str], launch: Sequence[str] = (), *,
                        nproc_per_node: int = 1, python: str | None = None) -> WarmLauncher:
    """A warm launcher for a script's trials, started now so that it imports while the caller does
    its own slow work (the probe, the matmul benchmark)."""
    warm = WarmLauncher(python or sys.executable, preload=framework_preload(launch))
    warm.prestart([*launch, os.fspath(script), *args], env=trial_environment(), nproc_per_node=nproc_per_node)
    return warm


class _Derives:
    """Derived runners: the same workload with other settings, sharing the rest (a warm server)."""

    settings: TrialSettings

    def _with(self, **settings: Any) -> Any:
        derived = copy.copy(self)
        derived.settings = dataclasses.replace(self.settings, **settings)
        return derived

    @property
    def seed(self) -> int:
        return self.settings.seed

    @property
    def measure_steps(self) -> int:
        return self.settings.measure_steps

    def perturbed(self, perturb: str, draw: int = 0) -> Any:
        return self._with(perturb=perturb, perturb_draw=draw)

    def with_measure_steps(self, steps: int) -> Any:
        return self._with(measure_steps=steps)

    def with_flop_count(self, on: bool = True) -> Any:
        return self._with(count_flops=on)


class ScriptRunner(_Derives):
    """Run ``python script args`` once per candidate, each in its own process forked from a warm
    server shared with the derived runners (``close()`` ends it). With ``wait_idle_on`` (a CUDA
    profile), each trial first waits until that GPU is idle."""

    def __init__(
        self, script: str | os.PathLike[str], args: list[str], settings: TrialSettings, *, python: str | None = None,
        wait_idle_on: HardwareProfile | None = None, launch: Sequence[str] = (), warm: WarmLauncher | None = None,
    ) -> None:
        self.script = Path(script)
        self.args = list(args)
        self.settings = settings
        self.python = python or sys.executable
        self.wait_idle_on = wait_idle_on
        self.launch = tuple(launch)
        self.warm = warm if warm is not None else WarmLauncher(self.python, preload=framework_preload(self.launch))
        # Trials are numbered across this runner and those derived from it.
        self._numbers = itertools.count(1)

    def close(self) -> None:
        self.warm.close()

    def __enter__(self) -> ScriptRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __call__(self, policy: Policy, label: str) -> TrialResult:
        wait_until_idle(self.wait_idle_on)
        number = next(self._numbers)
        # A directory per trial: one kept for a runner's life was removed by the garbage collector,
        # and a Ctrl-C arriving then was swallowed ("Exception ignored in: <finalize object>").
        with tempfile.TemporaryDirectory(prefix="mpadvise-trial-") as directory:
            spec = self.settings.spec(policy, os.path.join(directory, f"trial-{number}.json"), label)
            return run_trial(self.script, self.args, spec, timeout=self.settings.timeout, python=self.python,
                             launch=self.settings.launch(self.python, self.launch), warm=self.warm)


class FunctionRunner(_Derives):
    """Run ``train_fn(mp)`` in this process once per candidate (it builds its model and data inside,
    so every candidate starts from the same seed)."""

    def __init__(self, train_fn: Callable[[Any], Any], settings: TrialSettings) -> None:
        if settings.nproc_per_node > 1:
            raise MpadviseError(
                f"nproc_per_node={settings.nproc_per_node}: a function is tuned in this one process; tune a "
                f"script instead: mpadvise tune --nproc-per-node {settings.nproc_per_node} train.py"
            )
        self.train_fn = train_fn
        self.settings = settings

    def __call__(self, policy: Policy, label: str) -> TrialResult:
        profile = probes.profile_for(self.settings.device)
        with tempfile.TemporaryDirectory(prefix="mpadvise-trial-") as tmp:
            spec = self.settings.spec(policy, os.path.join(tmp, "result.json"), label)
            start = time.perf_counter()
            data, error = run_in_process(self.train_fn, spec, profile=profile)
            wall = time.perf_counter() - start
        return classify(data, exit_code=0 if error is None else 1, timed_out=False, stderr_tail=error or "",
                        spec=spec, timeout=self.settings.timeout, wall_s=wall)


def limit_memory(result: TrialResult, memory_limit: int | None) -> TrialResult:
    if memory_limit is not None and result.outcome == "ok" and result.peak_memory and result.peak_memory > memory_limit:
        return result.with_outcome(
            "oom", f"peak memory {result.peak_memory / 2**20:.0f} MiB exceeds the limit {memory_limit / 2**20:.0f} MiB")
    return result
