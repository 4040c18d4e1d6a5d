"""The trial protocol, parent side: start a training script in a subprocess under one candidate
policy, read its result file and classify what happened. It speaks only the plain-JSON spec and
result files, so it needs neither torch nor the policies; the child side is ``_child``.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from enum import Enum
from pathlib import Path
from typing import Any

from probes import MpadviseError

from ._proctree import TrialProcess, end_trial, launcher_argv, live_descendants, process_table
from ._proctree import descendants as descendants  # re-exported: the tree walk lived here
from ._ranks import EXITS_ENV
from ._timeline import breakdown, merge_timelines
from ._warm import THREADS_ENV, WarmLauncher, cold_command

OUTCOMES = ("ok", "oom", "unstable", "crash", "timeout", "unsupported", "no-step", "no-policy", "lost")
"""``unstable`` is decided later, against the fp32 reference; the rest are decided here. ``lost``
is a trial that timed out or was killed by a signal before its candidate was applied: no
verdict on the candidate, which a tune runs again."""

EXIT_NO_STEP = 97
"""Exit status of a child whose watchdog saw no ``step()`` in time."""
EXIT_UNSUPPORTED = 98
"""Exit status of a child asked to run a mode its hardware lacks."""
SIGKILL = int(getattr(signal, "SIGKILL", 9))  # Windows has no SIGKILL; the number is never seen there

# The child's environment, as the launcher (run_trial) leaves it and the child reads it.
TRIAL_SPEC_ENV = "MPADVISE_TRIAL_SPEC"
"""The path of the trial spec file: set by ``run_trial``, read by the child's ``spec_from_env``."""
POLICY_ENV = "MPADVISE_POLICY"
"""A config file that ``load_policy()`` applies; ``run_trial`` removes it from the child's
environment, since the spec decides the candidate and a leftover override must not."""
RANK_ENV = "RANK"
"""torchrun's global rank of a worker: which result file a rank of a multi-process trial writes."""
STACK_SIGNAL = "SIGUSR2"
"""The signal on which a trial process dumps its threads' stacks (``faulthandler``) to
``stack_dump_path`` of its result file; the parent sends it on a timeout, before the kill."""
STACK_PID_PREFIX = "pid "
"""The first line of a stack dump file: ``pid <N>``, the process to signal; the dump follows."""
STACK_WAIT_S = 2.0
"""Seconds a timed-out trial's parent waits for the stack dumps it asked for, before the kill."""


class Stage(str, Enum):
    """How far a trial child got: the ``stage`` of its result file, which the child rewrites as
    it goes and the parent classifies. A ``str``, so the file holds the plain value."""

    LOADED = "loaded"
    """``load_policy()`` (or a framework's boot) ran; no step began yet."""
    STEPPING = "stepping"
    """The first optimizer step began; the batch facts are written."""
    DONE = "done"
    """The measurements are written (``complete`` says whether the window was full)."""
    EXCEPTION = "exception"
    """The script raised; ``exception`` holds its type, message and time."""
    UNSUPPORTED = "unsupported"
    """The candidate cannot run here; ``reason`` says why."""
    NO_STEP = "no-step"
    """No step came within the first-step timeout of the candidate's application; the child
    ended itself."""

    def __str__(self) -> str:
        return self.value


# The measuring window of a trial, unless a tune or a comparison asks for another: the one
# declaration that the tune options, the trial settings and the spec's defaults all read.
DEFAULT_WARMUP_STEPS = 5
DEFAULT_MEASURE_STEPS = 40


@dataclass(frozen=True)
class ResultField:
    """One field of a trial's result file.

    Attributes:
        name: its key in the file.
        meaning: what it holds, for people.
        kept: the TrialResult field of the same name carries it; otherwise ``classify`` reads
            it to decide the outcome and drops it.
    """

    name: str
    meaning: str
    kept: bool = True


RESULT_FIELDS: tuple[ResultField, ...] = (
    ResultField("stage", "how far the child got (a Stage)", kept=False),
    ResultField("pid", "the child's process id", kept=False),
    ResultField("reason", "why the candidate cannot run here (stage unsupported)", kept=False),
    ResultField("exception", "what the script raised: type, message, time, rank", kept=False),
    ResultField("complete", "whether the measured window was full", kept=False),
    ResultField("losses", "per step: the loss (NaN and infinities as strings)"),
    ResultField("step_times", "per step: seconds, less the recorder's own work"),
    ResultField("loss_scale", "per step: the scale its backward ran with, or null"),
    ResultField("skipped", "per step: whether the scaler skipped it"),
    ResultField("underflow", "per sampled step: the fp16 gradient underflow fraction, else null"),
    ResultField("samples", "per step: samples it consumed"),
    ResultField("warmup_steps", "steps not timed"),
    ResultField("peak_memory", "bytes, or null where unknown"),
    ResultField("memory_kind", "what peak_memory measures (cuda-peak-allocated, cpu-peak-rss)"),
    ResultField("notes", "sentences for the trial's report"),
    ResultField("workload_fingerprint", "the workload's fingerprint (model, optimizer, batch, script)"),
    ResultField("model_signature", "the model's structure"),
    ResultField("fsdp", "whether the script asked for FSDP2's mixed precision"),
    ResultField("optimizer_eps", "the smallest eps of the optimizer's unfused param groups, or null"),
    ResultField("user_batch", "the batch the script asked for"),
    ResultField("micro_batch", "the batch one forward saw"),
    ResultField("grad_accum_steps", "micro-batches per optimizer step"),
    ResultField("global_batch", "samples per optimizer step"),
    ResultField("device", "the device the trial ran on"),
    ResultField("ranks", "how many processes' results were merged into this one"),
    ResultField("rank_progress", "a multi-process trial's merge: how far each rank got, for a reason", kept=False),
    ResultField("rank_waiting", "a multi-process trial's merge: a rank that had not applied the candidate", kept=False),
    ResultField("timeline", "when each part of the trial happened: TIMELINE_MARKS -> epoch seconds"),
    ResultField("flops_per_step", "FLOPs of one optimizer step (all micro-batches, all ranks), or null"),
    ResultField("flops_basis", "how flops_per_step was found: counted, or 6 x parameters x tokens; else null"),
)
"""The one declaration of the result file: the child writes only these fields
(``ResultWriter``) and the parent rejects a file that holds any other (``classify``)."""
RESULT_FIELD_NAMES = frozenset(f.name for f in RESULT_FIELDS)


def unknown_result_fields(data: Mapping[str, Any]) -> list[str]:
    """The keys of a result that ``RESULT_FIELDS`` does not declare, sorted."""
    return sorted(str(key) for key in data if key not in RESULT_FIELD_NAMES)


@dataclass(frozen=True)
class TrialSpec:
    """What one trial runs: the candidate, the measuring window and the limits.

    Attributes:
        policy: the candidate Policy as a plain dict (``Policy.to_dict()``).
        result_path: where the child writes its result JSON.
        seed: seeds torch/random/numpy at ``load_policy()``; the same for every trial of a tune
            so data order, initial weights and loss curves match step by step.
        warmup_steps: optimizer steps not timed (allocator growth, autotuning, compilation).
        measure_steps: optimizer steps timed after the warm-up.
        memory_limit: bytes; on CUDA a real per-process cap, on CPU a verdict on peak RSS.
        first_step_timeout: seconds from the candidate's application (``load_policy()``, or the
            framework's Trainer, Fabric or Accelerator built with it) to the first optimizer step
            before the child gives up (a script that never calls ``step()`` is detected, not
            waited out); time spent compiling with torch.compile is not counted.
        device: ``"cpu"``/``"cuda:N"`` override, or ``None`` for the default device.
        label: name of the trial for people (``"fp16-mixed static 1024 mb32"``).
        framework: the framework whose own settings and hooks apply the candidate and record
            the steps (``"lightning"``, ``"transformers"``...), or ``None`` for a script that
            calls ``load_policy()``.
        nproc_per_node: processes of the trial (torchrun's workers); with more than one, each
            rank writes its own result file (``rank_result_path``) and the parent merges them.
        perturb: ``None`` for a candidate; for the fp32 replicate, the format whose rounding
            perturbs the initial parameters once before the first step (``"bf16"``): the
            replicate then differs from the reference only numerically, as a candidate does.
        perturb_draw: which draw of that perturbation (0 for the first replicate, 1 for a
            second one perturbed independently); ignored without ``perturb``.
        threads: the threads torch's CPU ops may use (``torch.set_num_threads``), where other
            processes keep some of the cores busy; ``None`` leaves torch's own choice.
        count_flops: count the FLOPs of one whole optimizer step (the second, a warm-up step)
            with torch's FlopCounterMode, for ``flops_per_step``.
    """

    policy: dict[str, Any]
    result_path: str
    seed: int = 0
    warmup_steps: int = DEFAULT_WARMUP_STEPS
    measure_steps: int = DEFAULT_MEASURE_STEPS
    memory_limit: int | None = None
    first_step_timeout: float = 120.0
    device: str | None = None
    label: str = ""
    framework: str | None = None
    nproc_per_node: int = 1
    perturb: str | None = None
    perturb_draw: int = 0
    count_flops: bool = False
    threads: int | None = None

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> TrialSpec:
        """Read a spec that ``to_json`` wrote.

        Raises:
            MpadviseError: the spec holds a field that this version does not know.
        """
        data = json.loads(text)
        unknown = sorted(set(data) - {f.name for f in fields(cls)})
        if unknown:
            raise MpadviseError(
                f"the trial spec holds unknown fields {unknown}; the process that wrote it runs another "
                "version of mpadvise: run the trial with the same installation"
            )
        return cls(**data)


@dataclass(frozen=True)
class TrialResult:
    """What one trial measured, and how it ended.

    Per-step lists hold one entry per optimizer step from the first step (warm-up included,
    so loss curves compare from step 0); ``step_times`` is indexed the same way, and the
    timing statistics drop the first ``warmup_steps``. Every step is timed, less the
    recorder's own work in it (reading the loss scale, sampling gradients). ``loss_scale`` is
    the scale that step's backward ran with; ``underflow`` is sampled on some steps only
    (``None`` on the others, and outside fp16).

    A trial of several processes (``ranks`` > 1) holds its ranks' results merged by
    ``merge_rank_results``. ``fsdp`` says that the script asked for FSDP2's mixed precision
    (``mp.fsdp_mixed_precision()``), which makes the gradient reduction dtype searchable.

    ``flops_per_step`` is the work of one optimizer step (``None`` unless the spec asked to
    count it), and ``flops_basis`` says how it was found: ``"counted"`` (torch's FlopCounterMode
    over one whole warm-up step) or ``"6 x parameters x tokens"`` (the estimate for a model fed
    token ids, where counting failed).

    ``threads`` is the thread count the trial asked torch for (``TrialSpec.threads``), ``None``
    where it left torch's own choice.
    """

    outcome: str
    reason: str = ""
    label: str = ""
    policy: dict[str, Any] = field(default_factory=dict)
    exit_code: int | None = None
    stderr_tail: str = ""
    losses: tuple[float, ...] = ()
    step_times: tuple[float, ...] = ()
    loss_scale: tuple[float | None, ...] = ()
    skipped: tuple[bool, ...] = ()
    underflow: tuple[float | None, ...] = ()
    samples: tuple[int, ...] = ()
    warmup_steps: int = 0
    peak_memory: int | None = None
    memory_kind: str = ""
    user_batch: int | None = None
    micro_batch: int | None = None
    grad_accum_steps: int | None = None
    global_batch: int | None = None
    workload_fingerprint: str | None = None
    model_signature: str | None = None
    device: str = ""
    notes: tuple[str, ...] = ()
    wall_s: float = 0.0
    fsdp: bool = False
    optimizer_eps: float | None = None
    ranks: int = 1
    timeline: dict[str, float] = field(default_factory=dict)
    flops_per_step: float | None = None
    flops_basis: str | None = None
    threads: int | None = None

    @property
    def phases(self) -> dict[str, float | None]:
        """Seconds in each phase of the trial's life (``advisor.trial.PHASES``)."""
        return breakdown(self.timeline)

    @property
    def applied(self) -> bool:
        """Whether the candidate was applied (its timeline has ``policy_applied``); a trial that
        measured steps was, whatever its timeline holds (a result from before timelines)."""
        return "policy_applied" in self.timeline or bool(self.losses)

    @property
    def ran(self) -> bool:
        """Whether the trial produced measurements (ok, or unstable once judged)."""
        return self.outcome in ("ok", "unstable")

    def with_outcome(self, outcome: str, reason: str) -> TrialResult:
        return replace(self, outcome=outcome, reason=reason)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["losses"] = [json_float(v) for v in self.losses]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrialResult:
        """Read what ``to_dict`` wrote.

        Raises:
            ValueError: ``data`` holds a key that is not a field, naming it.
        """
        unknown = sorted(set(data) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"TrialResult has no fields {unknown}")
        kwargs = dict(data)
        for name in (
            "losses",
            "step_times",
            "loss_scale",
            "skipped",
            "underflow",
            "samples",
            "notes",
        ):
            if name in kwargs and kwargs[name] is not None:
                kwargs[name] = tuple(kwargs[name])
        kwargs["losses"] = tuple(float(v) for v in kwargs.get("losses", ()))
        return cls(**kwargs)


def json_float(value: float) -> float | str:
    """A loss for strict JSON, which has no NaN/Infinity: those become strings float() reads."""
    return value if math.isfinite(value) else str(value)


def parse_memory(text: str) -> int:
    """``"4GiB"``, ``"512MiB"``, ``"2G"``, ``"1500000000"`` -> bytes.

    Raises:
        MpadviseError: naming the value and the accepted forms.
    """
    units = {
        "": 1,
        "b": 1,
        "k": 10**3,
        "kb": 10**3,
        "kib": 2**10,
        "m": 10**6,
        "mb": 10**6,
        "mib": 2**20,
        "g": 10**9,
        "gb": 10**9,
        "gib": 2**30,
        "t": 10**12,
        "tb": 10**12,
        "tib": 2**40,
    }
    raw = str(text).strip().lower().replace(" ", "")
    number = raw.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = raw[len(number) :]
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if unit not in units or value <= 0:
        raise MpadviseError(
            f"memory limit {text!r} is not a size; expected e.g. 4GiB, 512MiB or 2000000000"
        )
    return int(value * units[unit])


def trial_environment(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment a trial runs in, but for its per-trial variables: ``env`` (default: this
    process's) with unbuffered output, and without a policy override (the spec decides; a
    leftover ``MPADVISE_POLICY`` must not). A warm server started ahead of the first trial
    (``WarmLauncher.prestart``) starts in it."""
    child_env = dict(os.environ if env is None else env)
    child_env["PYTHONUNBUFFERED"] = "1"
    child_env.pop(POLICY_ENV, None)
    return child_env


def run_trial(
    script: str | os.PathLike[str],
    args: list[str],
    spec: TrialSpec,
    *,
    timeout: float,
    python: str = sys.executable,
    env: dict[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    launch: Sequence[str] = (),
    warm: WarmLauncher | None = None,
) -> TrialResult:
    """Run ``python script args`` with ``spec`` injected; classify the outcome.

    ``launch`` goes between the interpreter and the script: a module that runs the script
    (``-m advisor.frameworks._boot lightning``, the rank launcher's ``advisor.trial._ranks``).

    With ``warm``, the trial is forked from its warm server, torch already imported, where that
    is as good as a fresh interpreter (``advisor.trial._warm``); otherwise, and wherever the
    server says no, it starts cold, in a fresh interpreter. Either way the timeline carries the
    parent's ``launched`` and ``exited`` marks.

    Subprocesses isolate out-of-memory, CUDA errors, segfaults and hangs. The child writes its
    measurements to ``spec.result_path``; stderr goes to a file whose tail is kept.

    Returns:
        A TrialResult whose outcome is one of ok, oom, crash, timeout, unsupported, no-step,
        no-policy (``unstable`` is judged later against the reference).
    """
    result_path = Path(spec.result_path)
    result_path.unlink(missing_ok=True)
    rank_paths = [Path(rank_result_path(result_path, r)) for r in range(spec.nproc_per_node)] if spec.nproc_per_node > 1 else []
    for path in rank_paths:
        path.unlink(missing_ok=True)
    stack_paths = [Path(stack_dump_path(path)) for path in rank_paths or [result_path]]
    for path in stack_paths:
        path.unlink(missing_ok=True)
    spec_file = result_path.with_suffix(".spec.json")
    spec_file.write_text(spec.to_json())
    child_env = trial_environment(env)
    child_env[TRIAL_SPEC_ENV] = str(spec_file)
    child_env.pop(THREADS_ENV, None)
    if spec.threads is not None and spec.nproc_per_node == 1:
        child_env[THREADS_ENV] = str(spec.threads)
    exits_path = Path(f"{result_path}.exits.json")
    exits_path.unlink(missing_ok=True)
    if rank_paths:
        child_env[EXITS_ENV] = str(exits_path)  # where the rank launcher records how each rank ended
    # The child starts in this process's memory cgroup: counting that cgroup's OOM kills before
    # and after tells a kill by the kernel's OOM killer from any other SIGKILL.
    oom_before = oom_kill_count()
    command = [*launch, str(script), *args]
    with tempfile.TemporaryFile("w+b") as err, tempfile.TemporaryFile("w+b") as out:
        launched, start = time.time(), time.perf_counter()
        proc: TrialProcess | None = None
        if warm is not None:
            proc = warm.start_trial(command, env=child_env, cwd=cwd, stdout=out, stderr=err, python=python,
                                    nproc_per_node=spec.nproc_per_node)
        if proc is None:
            launched, start = time.time(), time.perf_counter()
            # Under the launcher (Linux), every process the script starts stays below the trial,
            # even in a session of its own or once its parent has died, and none outlives the trial.
            proc = subprocess.Popen(
                [*launcher_argv(python), *cold_command(python, command, nproc_per_node=spec.nproc_per_node)],
                stdout=out,
                stderr=err,
                stdin=subprocess.DEVNULL,
                env=child_env,
                cwd=cwd,
                start_new_session=True,  # so a timeout can kill the script's own children too
            )
        timed_out, stacks = False, None
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            stacks = request_stack_dumps(stack_paths, proc.pid)  # where each process hung, before the kill
            end_trial(proc)
            code = proc.wait()
        except BaseException:
            end_trial(proc)
            proc.wait()
            raise
        exited, wall = time.time(), time.perf_counter() - start
        err.seek(0)
        tail = _tail(err.read())
    oom_after = oom_kill_count() if oom_before is not None else None
    if rank_paths:
        data = merge_rank_results([_read_json(path) for path in rank_paths], exits=_read_json(exits_path))
        exits_path.unlink(missing_ok=True)
    else:
        data = _read_json(result_path)
    spec_file.unlink(missing_ok=True)
    for path in stack_paths:
        path.unlink(missing_ok=True)
    return classify(
        data,
        exit_code=code,
        timed_out=timed_out,
        stacks=stacks,
        stderr_tail=tail,
        spec=spec,
        timeout=timeout,
        wall_s=wall,
        oom_kills=None if oom_after is None or oom_before is None else max(0, oom_after - oom_before),
        timeline={"launched": launched, "exited": exited},
    )


def classify(
    data: dict[str, Any] | None,
    *,
    exit_code: int | None,
    timed_out: bool,
    stderr_tail: str,
    spec: TrialSpec,
    timeout: float,
    wall_s: float = 0.0,
    oom_kills: int | None = None,
    timeline: Mapping[str, float] | None = None,
    stacks: Sequence[str | None] | None = None,
) -> TrialResult:
    """Decide the outcome of a finished child from its result file, exit code and stderr.

    A pure function of its inputs, so every outcome class is unit-testable without processes.

    A child that timed out, or died by a signal, before its candidate was applied (no
    ``policy_applied`` in its timeline) is ``lost``: nothing it did says anything of the
    candidate (a slow or failing machine, the script's own start-up), so a tune runs it again.
    A script that exited by itself without calling ``load_policy()`` stays ``no-policy``.

    Args:
        timeline: the parent's own marks of the trial (``launched``, ``exited``), added to the
            child's.
        stacks: on a timeout, each process's (rank's) stack dump taken before the kill
            (``request_stack_dumps``), ``None`` where none came: the reason names the process
            that hung (``stack_blame``).
        oom_kills: how many processes the kernel's OOM killer killed in the child's memory
            cgroup while it ran (``oom_kill_count`` before and after), or ``None`` where that
            is unknown. A child ended by SIGKILL while the count rose is out of memory; with
            no count, SIGKILL is a crash.

    A DataLoader worker that the OOM killer chose (often the largest process: each worker
    holds a copy of the dataset and its batches) dies by SIGKILL while the script lives on,
    and torch raises "DataLoader worker (pid N) is killed by signal: Killed." in the script,
    which then fails as a crash would. Such a trial is out of memory too, unless the cgroup's
    count was read and did not rise. Unlike the script itself (which a launcher or a failed
    peer's torchrun may kill), nothing in a trial sends SIGKILL to a worker but the OOM
    killer, so an unknown count still reads as out of memory.
    """
    unknown = unknown_result_fields(data or {})
    if unknown:
        return TrialResult(
            outcome="crash",
            reason=(f"the trial's result file holds unknown fields {unknown} (expected only those of "
                    "advisor.trial.RESULT_FIELDS); the script ran under another version of mpadvise: "
                    "run it with the same installation as the tune"),
            label=spec.label, policy=spec.policy, exit_code=exit_code, stderr_tail=stderr_tail, wall_s=wall_s,
            timeline=dict(timeline or {}),
        )
    result_file: dict[str, Any] = dict(data or {})
    stage = result_file.get("stage")
    exception = result_file.get("exception") or {}
    # What the TrialResult carries of the file; the rest (stage, exception...) only decides.
    base = {f.name: result_file[f.name] for f in RESULT_FIELDS if f.kept and f.name in result_file}
    base.update(
        exit_code=exit_code,
        stderr_tail=stderr_tail,
        policy=spec.policy,
        label=spec.label,
        wall_s=wall_s,
        timeline={**(result_file.get("timeline") or {}), **(timeline or {})},
        threads=spec.threads if spec.nproc_per_node == 1 else None,
    )
    if (timed_out or _by_signal(exit_code)) and _lost_before_application(stage, result_file, exception, base["timeline"]):
        outcome, reason = "lost", _lost_reason(
            None if exception.get("no_result") else stage, base["timeline"], spec, timed_out=timed_out, timeout=timeout, exit_code=exit_code, oom_kills=oom_kills,
            rank=exception.get("rank", result_file.get("rank_waiting")))
    elif timed_out:
        where = _stage_text(stage, result_file)
        if result_file.get("rank_progress"):
            where = "; ".join(result_file["rank_progress"])  # a multi-process trial: every rank's
        blame = stack_blame(stacks or [])
        if blame is None and stacks is not None and stage is not None:
            blame = "no process dumped its stack, so where it hung is unknown"
        outcome, reason = "timeout", f"no result within {timeout:g} s ({where}){': ' + blame if blame else ''}; the trial was killed"
    elif ((exit_code == -SIGKILL or (exception.get("killed") and exception.get("signal") in (None, "SIGKILL")))
          and oom_kills and stage != Stage.DONE):
        # A rank of a multi-process trial that stopped without an error of its own, while the
        # OOM killer was at work, was its victim, unless the rank launcher saw another signal.
        where = f"on rank {exception['rank']}" if exception.get("killed") else _stage_text(stage, result_file)
        outcome, reason = "oom", (
            f"out of memory: the kernel's OOM killer ended the script {where} (SIGKILL; its memory "
            f"cgroup counted {oom_kills} OOM kill{'s' if oom_kills != 1 else ''} meanwhile); "
            "use a smaller micro-batch or give the trial more memory"
        )
    elif stage != Stage.DONE and oom_kills != 0 and (worker := _killed_worker(stderr_tail, exception)) is not None:
        outcome, reason = "oom", _worker_oom_reason(worker, _stage_text(stage, result_file), oom_kills)
    else:
        outcome, reason = _outcome(stage, result_file, exception, exit_code, _last_line(stderr_tail), spec)
    return TrialResult.from_dict({**base, "outcome": outcome, "reason": reason})


def _by_signal(exit_code: int | None) -> bool:
    """Whether the child ended by a signal (``subprocess`` reports it as a negative status)."""
    return exit_code is not None and exit_code < 0


def _lost_before_application(stage: str | None, result_file: Mapping[str, Any], exception: Mapping[str, Any],
                             timeline: Mapping[str, float]) -> bool:
    """Whether a child that timed out or died by a signal had not applied the candidate yet.

    The timeline's ``policy_applied`` says it was; so does any stage that only an applied
    candidate reaches (a step, the first-step watchdog), for a result from before timelines.
    A candidate refused as unsupported, or a script's own exception, is an outcome in itself.
    """
    if "policy_applied" in timeline or result_file.get("losses"):
        return False
    if stage in (Stage.STEPPING, Stage.DONE, Stage.NO_STEP, Stage.UNSUPPORTED):
        return False
    return not (stage == Stage.EXCEPTION and not exception.get("killed"))


# What a person reads for the last mark a lost trial reached.
_MARK_WORDS = {"launched": "launched", "torch_imported": "torch imported"}


def _lost_reason(stage: str | None, timeline: Mapping[str, float], spec: TrialSpec, *, timed_out: bool,
                 timeout: float, exit_code: int | None, oom_kills: int | None, rank: int | None = None) -> str:
    """Why a trial is ``lost``: how it ended, and where it (its rank ``rank``) had got to."""
    how = f"no result within {timeout:g} s" if timed_out else f"killed by {_exit_text(exit_code)}"
    if rank is not None:
        how += f", rank {rank}"
    if stage is None:
        where = "before load_policy()" if spec.framework is None else "before the trial's boot started"
    elif spec.framework is None:
        where = "inside load_policy(), before the candidate was built"
    else:
        where = f"before the script built its {spec.framework} trainer with the candidate"
    marks = [(at, name) for name, at in timeline.items() if name in _MARK_WORDS and isinstance(at, (int, float))]
    launched = timeline.get("launched")
    if marks and isinstance(launched, (int, float)):
        at, name = max(marks)
        where += f"; last mark: {_MARK_WORDS[name]}, {at - launched:.1f} s after launch"
    oom = (f"; the kernel's OOM killer ended {oom_kills} process{'es' if oom_kills != 1 else ''} meanwhile"
           if oom_kills and not timed_out else "")
    return (f"lost before the candidate was applied ({how}, {where}{oom}): a failure of the machine or the "
            "script's start-up, not of the candidate")


# What torch's DataLoader raises in the script when a worker process died by a signal: the
# signal's strsignal() text ("Killed" is SIGKILL, the OOM killer's signal).
_WORKER_KILLED = re.compile(r"DataLoader worker \(pid (\d+)\) is killed by signal: Killed\b")


def _killed_worker(stderr_tail: str, exception: dict[str, Any]) -> str | None:
    """The pid of a DataLoader worker that died by SIGKILL, from the script's stderr or its
    recorded exception; ``None`` when none did."""
    for text in (stderr_tail, str(exception.get("message", ""))):
        found = _WORKER_KILLED.search(text)
        if found is not None:
            return found.group(1)
    return None


def _worker_oom_reason(pid: str, where: str, oom_kills: int | None) -> str:
    counted = (
        "" if oom_kills is None
        else f"; its memory cgroup counted {oom_kills} OOM kill{'s' if oom_kills != 1 else ''} meanwhile"
    )
    return (
        f"out of memory: DataLoader worker (pid {pid}) was killed by SIGKILL {where}, as the kernel's OOM "
        f"killer ends a process{counted}; use fewer DataLoader workers or a smaller micro-batch, or give "
        "the trial more memory"
    )


def _stage_text(stage: str | None, result_file: Mapping[str, Any]) -> str:
    """How far the child got, for a reason: the losses are only written once a trial finishes."""
    if result_file.get("losses"):
        return f"after {len(result_file['losses'])} steps"
    if stage is None:
        return "before load_policy()"
    return "after its first step()" if stage == Stage.STEPPING else "after load_policy(), before any step()"


def _outcome(
    stage: str | None,
    result_file: Mapping[str, Any],
    exception: dict[str, Any],
    exit_code: int | None,
    last_line: str,
    spec: TrialSpec,
) -> tuple[str, str]:
    """``(outcome, reason)`` of a child that ended by itself, from the last stage it reached."""
    if stage == Stage.UNSUPPORTED:
        return "unsupported", result_file.get("reason") or "mode not supported on this hardware"
    if stage == Stage.NO_STEP and result_file.get("reason"):
        return "no-step", str(result_file["reason"])  # the adapter's own line: what the script reached
    if stage == Stage.NO_STEP:
        what = (f"the script never called step() within {spec.first_step_timeout:g} s of the policy's application "
                "(load_policy())"
                if spec.framework is None else
                f"the script's {spec.framework} training ran no optimizer step within {spec.first_step_timeout:g} s "
                "of the policy's application (its trainer built with the candidate)")
        return "no-step", f"{what} (time spent compiling with torch.compile not counted)"
    if stage == Stage.EXCEPTION or (stage not in (None, Stage.DONE) and exit_code not in (0, None)):
        return _failure(exception, exit_code, last_line)
    if stage is None:
        if exit_code not in (0, None):
            return (
                "no-policy",
                f"the script failed before load_policy() (exit {_exit_text(exit_code)}): {last_line or 'no error message'}",
            )
        return "no-policy", "the script exited without calling advisor.load_policy()"
    if stage == Stage.LOADED or (stage == Stage.STEPPING and not result_file.get("losses")):
        if spec.framework is not None:
            return "no-step", f"the script ended before its {spec.framework} training ran an optimizer step"
        return "no-step", "the script ended without calling step(); call mp.step(loss, optimizer) in the training loop"
    if stage == Stage.STEPPING:
        return (
            "crash",
            f"the script stopped after {len(result_file['losses'])} steps without finishing the trial (exit {_exit_text(exit_code)})",
        )
    # stage == Stage.DONE
    peak = result_file.get("peak_memory")
    if spec.memory_limit is not None and peak is not None and peak > spec.memory_limit:
        return "oom", f"peak memory {peak / 2**20:.0f} MiB exceeds the limit {spec.memory_limit / 2**20:.0f} MiB"
    return "ok", ""


def _failure(exception: dict[str, Any], exit_code: int | None, last_line: str) -> tuple[str, str]:
    """``(outcome, reason)`` of a child that raised: out of memory, our own error, or a crash."""
    kind = exception.get("type", "")
    message = exception.get("message", "") or last_line
    rank = exception.get("rank")
    on_rank = "" if rank is None else f" on rank {rank}"  # a multi-process trial names the rank
    if (
        "OutOfMemoryError" in kind
        or kind == "MemoryError"
        or "out of memory" in message.lower()
        or "can't allocate memory" in message.lower()  # torch's CPU allocator
    ):
        return "oom", f"out of memory{on_rank}: {message}".strip()
    if kind == "MpadviseError":
        return "crash", message
    what = f"{kind}: {message}" if kind else (message or "no error message")
    return "crash", f"the script crashed{on_rank} (exit {_exit_text(exit_code)}): {what}"


def _exit_text(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return str(code)


def oom_kill_count(pid: int | str = "self", *, proc: str | os.PathLike[str] = "/proc") -> int | None:
    """How many processes the kernel's OOM killer has killed in ``pid``'s memory cgroup.

    Read from cgroup v2's ``memory.events`` or, where memory is on a v1 hierarchy, from
    ``memory.oom_control`` (both count kills by any OOM killer, the cgroup's own or the
    system's). Compare two readings: the count only grows.

    Returns:
        The count, or ``None`` where it cannot be read (not Linux, no memory cgroup mounted,
        no access, a kernel older than 4.13).
    """
    root = Path(proc)
    try:
        cgroups = (root / str(pid) / "cgroup").read_text()
        mounts = (root / "self" / "mountinfo").read_text()
    except OSError:
        return None
    for version, directory in memory_cgroup_dirs(cgroups, mounts):
        name = "memory.events" if version == 2 else "memory.oom_control"
        try:
            text = (directory / name).read_text()
        except OSError:
            continue
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill" and value.strip().isdigit():
                return int(value)
    return None


def memory_cgroup_dirs(cgroups: str, mountinfo: str) -> list[tuple[int, Path]]:
    """The directories of a process's memory cgroup: ``(2, dir)`` on the unified hierarchy,
    ``(1, dir)`` on a v1 memory hierarchy, in that order.

    Args:
        cgroups: the text of ``/proc/<pid>/cgroup`` (``hierarchy:controllers:path`` lines).
        mountinfo: the text of ``/proc/self/mountinfo``, where the hierarchies are mounted.
    """
    paths: dict[int, str] = {}
    for line in cgroups.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            paths[2] = parts[2]
        elif "memory" in parts[1].split(","):
            paths[1] = parts[2]
    found = []
    for version in (2, 1):
        if version not in paths:
            continue
        for mount_root, mount_point in _cgroup_mounts(mountinfo, version):
            # A mount may show a subtree only (a container's view): its root is that subtree.
            relative = os.path.relpath(paths[version], mount_root)
            if relative == ".." or relative.startswith("../"):
                continue
            found.append((version, Path(mount_point) / relative if relative != "." else Path(mount_point)))
    return found


def _cgroup_mounts(mountinfo: str, version: int) -> list[tuple[str, str]]:
    """``(root, mount point)`` of each mount of the cgroup2 file system (``version`` 2), or of a
    v1 cgroup hierarchy with the memory controller (``version`` 1)."""
    mounts = []
    for line in mountinfo.splitlines():
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 5 or len(tail) < 3:
            continue
        fstype, options = tail[0], tail[2].split(",")
        if (version == 2 and fstype == "cgroup2") or (version == 1 and fstype == "cgroup" and "memory" in options):
            mounts.append((_unescape(fields[3]), _unescape(fields[4])))
    return mounts


def _unescape(field: str) -> str:
    """A mountinfo path: the kernel writes space, tab, newline and backslash as octal escapes."""
    for code in ("040", "011", "012", "134"):
        field = field.replace("\\" + code, chr(int(code, 8)))
    return field


def rank_result_path(result_path: str | os.PathLike[str], rank: int) -> str:
    """Where rank ``rank`` of a multi-process trial writes its result: ``<result>.rank<R>``."""
    return f"{os.fspath(result_path)}.rank{rank}"


def stack_dump_path(result_path: str | os.PathLike[str]) -> str:
    """Where the trial process writing ``result_path`` dumps its stacks: ``<result>.stack``."""
    return f"{os.fspath(result_path)}.stack"


@dataclass(frozen=True)
class StackFrame:
    """One frame of a ``faulthandler`` dump: the file, line and function it was at."""

    file: str
    line: int
    function: str

    @property
    def in_torch(self) -> bool:
        """Whether the frame is torch's own code (a collective, the autograd engine...)."""
        return "/torch/" in self.file.replace(os.sep, "/")

    def __str__(self) -> str:
        return f"{os.path.basename(self.file)} line {self.line} ({self.function})"


_DUMP_FRAME = re.compile(r'^\s*File "(?P<file>.*)", line (?P<line>\d+) in (?P<function>.*)$')
_DUMP_THREAD = re.compile(r"^(Current thread|Thread) 0x[0-9a-fA-F]+ \(most recent call first\):$")


def main_frame(dump: str) -> StackFrame | None:
    """The innermost frame of the main thread in a ``faulthandler`` dump of every thread.

    faulthandler lists threads newest first (``Thread 0x... (most recent call first):``, the
    one that took the signal marked ``Current thread``), so the main thread, the first started,
    is the last listed; a dump of one thread is that thread. ``None`` when the dump holds no
    thread, or the main thread had no Python frame (``<no Python frame>``).
    """
    blocks: list[list[str]] = []
    for line in dump.splitlines():
        if _DUMP_THREAD.match(line.strip()):
            blocks.append([])
        elif blocks:
            blocks[-1].append(line)
    if not blocks:
        return None
    for line in blocks[-1]:
        found = _DUMP_FRAME.match(line)
        if found is not None:
            return StackFrame(found["file"], int(found["line"]), found["function"])
    return None


def stack_blame(dumps: Sequence[str | None]) -> str | None:
    """Which process of a timed-out trial hung, from each one's stack dump (index = rank;
    ``None`` where none arrived); ``None`` when no dump holds a frame.

    A process whose main thread was in torch's own code waited (in a collective, for a peer,
    or in the autograd engine); one elsewhere (the script, another library) hung there. With
    several ranks, those that hung are named first, then those that waited for them.
    """
    frames = [None if dump is None else main_frame(dump) for dump in dumps]
    if not any(frames):
        return None
    if len(frames) == 1:
        frame = frames[0]
        if frame is not None and frame.in_torch:
            return f"the script was waiting in torch (a collective or the autograd engine) at {frame}"
        return f"the script hung in {frame}"
    hung = [(rank, frame) for rank, frame in enumerate(frames) if frame is not None and not frame.in_torch]
    waited = [rank for rank, frame in enumerate(frames) if frame is not None and frame.in_torch]
    silent = [rank for rank, frame in enumerate(frames) if frame is None]
    parts = []
    if hung:
        text = "; ".join(f"rank {rank} hung in {frame}" for rank, frame in hung)
        if waited:
            them = "it" if len(hung) == 1 else "them"
            text += f" while {_ranks_text(waited)} waited for {them} in torch"
        parts.append(text)
    else:
        parts.append(f"{'every rank' if not silent else _ranks_text(waited)} waited in torch (a collective or the "
                     "autograd engine), none in the script")
    if silent:
        parts.append(f"{_ranks_text(silent)} dumped no stack")
    return "; ".join(parts)


def _ranks_text(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def request_stack_dumps(paths: Sequence[Path], root: int, *, wait_s: float = STACK_WAIT_S) -> list[str | None]:
    """Ask each trial process below ``root`` that registered a stack dump (``paths``: one per
    process, each starting ``pid <N>``) to write it (``STACK_SIGNAL``), and read the dumps.

    Only a pid that runs below ``root`` is signalled (a process that ended may have left its
    pid to another). Waits up to ``wait_s`` until every dump asked for is written (not empty,
    and no longer growing).

    Returns:
        Each path's dump (index as ``paths``), ``None`` where none came.
    """
    sig = getattr(signal, STACK_SIGNAL, None)
    below = set(live_descendants(process_table(), root)) if sig is not None else set()
    headers: dict[int, int] = {}
    for index, path in enumerate(paths):
        try:
            first = path.read_text().partition("\n")[0]
        except (OSError, UnicodeDecodeError):
            continue
        pid = first[len(STACK_PID_PREFIX):]
        if first.startswith(STACK_PID_PREFIX) and pid.isdigit() and int(pid) in below:
            try:
                os.kill(int(pid), sig)  # type: ignore[arg-type]
            except (ProcessLookupError, PermissionError):
                continue
            headers[index] = len(first) + 1
    deadline, sizes = time.monotonic() + wait_s, {}
    while headers:
        now = {index: _size(paths[index]) for index in headers}
        if all(size > headers[index] for index, size in now.items()) and now == sizes:
            break  # every dump is written and none grew since the last look
        if time.monotonic() >= deadline:
            break
        sizes = now
        time.sleep(0.05)
    dumps: list[str | None] = [None] * len(paths)
    for index, skip in headers.items():
        try:
            text = paths[index].read_text(errors="replace")[skip:]
        except OSError:
            continue
        dumps[index] = text if text.strip() else None
    return dumps


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def merge_rank_results(ranks: Sequence[Mapping[str, Any] | None],
                       exits: Mapping[str, Any] | None = None) -> dict[str, Any] | None:
    """One trial result from the result files of its ranks, in the form one process writes.

    A pure function of the files' contents (index = rank; ``None`` for a rank that wrote none)
    and of the rank launcher's record of how each rank ended (``exits``: ``advisor.trial._ranks``
    writes it; ``None`` where there is none, a trial killed on a timeout). A rank that failed
    makes the trial fail, and the exception names the rank:

    * with the record, the rank that ended first with a failure of its own (not one the
      launcher stopped after it): its own exception if it raised one; else its exit status or
      signal, as a rank that stopped without an error of its own (``killed``, with the
      ``signal``): a rank ended by ``os._exit`` or a signal (the OOM killer's SIGKILL) is blamed,
      not the healthy peer that lost its connection to it afterwards;
    * else the earliest exception (ranks that lost a peer fail after it, with a communication
      error of their own), a rank the hardware cannot run the mode on, one that never stepped,
      one that wrote nothing, or one that stopped while others finished.

    When no rank failed but not all finished (a timeout), the result is that of a rank that had
    not applied the candidate yet, if one had not (the trial is then ``lost``), else rank 0's;
    ``rank_progress`` says how far each rank got. When every rank finished:

    * step times: per step, the slowest rank's (a synchronous step waits for it);
    * losses: per step, the mean over ranks weighted by their samples, which is the loss of
      the global batch and less noisy than one rank's share; a NaN or infinite loss on any
      rank makes the step's loss that value (a note names the rank where the first came);
    * skipped steps: must agree (every rank's optimizer steps or none does); otherwise the
      trial fails, naming the first step and ranks that disagree;
    * samples: summed over ranks (goodput counts the whole node); peak memory: the largest;
      underflow: the mean of the ranks' samples; notes: every rank's, once;
    * everything else (the batch facts, the loss scale, fingerprints, device): rank 0's.

    Returns:
        The merged result, with ``ranks`` set; ``None`` when no rank wrote anything.
    """
    present = {rank: dict(data) for rank, data in enumerate(ranks) if data}
    if not present:
        return None
    failed = _failed_rank(ranks, present, exits)
    if failed is not None:
        return {**failed, "ranks": len(ranks)}
    if any(data.get("stage") != Stage.DONE for data in present.values()):
        progress = [f"rank {rank} {_stage_text((data or {}).get('stage'), data or {})}" for rank, data in enumerate(ranks)]
        waiting = [rank for rank, data in enumerate(ranks) if not _applied(data)]
        chosen = {**(ranks[waiting[0]] or {}), "rank_waiting": waiting[0]} if waiting else present[min(present)]
        return {**chosen, "ranks": len(ranks), "rank_progress": progress}
    return _merge_finished(ranks, present)


def _applied(data: Mapping[str, Any] | None) -> bool:
    """Whether a rank's result shows its candidate applied."""
    return bool(data) and ("policy_applied" in (data.get("timeline") or {}) or bool(data.get("losses")))


def _first_failure(exits: Mapping[str, Any] | None) -> tuple[int, Mapping[str, Any]] | None:
    """The rank that ended first with a failure of its own, from the launcher's record."""
    if not isinstance(exits, Mapping):
        return None
    for ended in exits.get("ended") or []:
        if isinstance(ended, Mapping) and ended.get("status") not in (0, None) and not ended.get("stopped"):
            return int(ended["rank"]), ended
    return None


def _ended_text(ended: Mapping[str, Any]) -> str:
    if ended.get("signal"):
        return f"was killed by {ended['signal']}"
    return f"exited with status {ended.get('status')}"


def _failed_rank(ranks: Sequence[Mapping[str, Any] | None], present: dict[int, dict[str, Any]],
                 exits: Mapping[str, Any] | None = None) -> dict[str, Any] | None:
    """The result of the rank that made a multi-process trial fail, or ``None`` if none did."""
    first = _first_failure(exits)
    if first is not None:
        rank, ended = first
        data = present.get(rank, {})
        stage, exception = data.get("stage"), data.get("exception") or {}
        if stage == Stage.EXCEPTION and not exception.get("killed"):
            return {**data, "exception": {**exception, "rank": rank}}
        if stage in (Stage.UNSUPPORTED, Stage.NO_STEP):
            return data
        message = (f"rank {rank} {_ended_text(ended)} {_stage_text(stage, data)} without an error of its own; "
                   "its peers were stopped after it")
        return {**data, "stage": Stage.EXCEPTION,
                "exception": {"type": "", "message": message, "rank": rank, "killed": True, "signal": ended.get("signal"),
                              "no_result": not data}}
    raised = [(data.get("exception") or {}, rank) for rank, data in present.items() if data.get("stage") == Stage.EXCEPTION]
    if raised:
        exception, rank = min(raised, key=lambda item: (_number(item[0].get("at")), item[1]))
        return {**present[rank], "exception": {**exception, "rank": rank}}
    for stage in (Stage.UNSUPPORTED, Stage.NO_STEP):
        for data in present.values():
            if data.get("stage") == stage:
                return data
    missing = [rank for rank, data in enumerate(ranks) if not data]
    finished = [rank for rank, data in present.items() if data.get("stage") == Stage.DONE]
    stopped = [rank for rank in present if rank not in finished]
    if missing:
        rank = missing[0]
        message = f"rank {rank} wrote no result: it ended, or was ended, before calling advisor.load_policy()"
        # The rank's own (empty) result: it had not applied the candidate, which decides ``lost``.
        return {"stage": Stage.EXCEPTION,
                "exception": {"type": "", "message": message, "rank": rank, "killed": True, "no_result": True}}
    elif finished and stopped:
        rank = stopped[0]
        message = (f"rank {rank} stopped {_stage_text(present[rank].get('stage'), present[rank])} without an error "
                   f"of its own, while rank {finished[0]} finished (killed by a signal, or ended by its launcher)")
    else:
        return None
    base = present[min(present)]
    return {**base, "stage": Stage.EXCEPTION, "exception": {"type": "", "message": message, "rank": rank, "killed": True}}


def _merge_finished(ranks: Sequence[Mapping[str, Any] | None], present: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """The merged result of ranks that all finished (see ``merge_rank_results``)."""
    order = sorted(present)
    first = present[order[0]]
    steps = min(len(present[r].get("losses") or []) for r in order)

    def column(name: str, rank: int) -> list[Any]:
        values = list(present[rank].get(name) or [])
        return values[:steps] + [None] * (steps - len(values))

    skipped = {r: [bool(v) for v in column("skipped", r)] for r in order}
    for step in range(steps):
        decisions = {r: skipped[r][step] for r in order}
        if len(set(decisions.values())) > 1:
            took = [r for r, s in decisions.items() if not s]
            skip = [r for r, s in decisions.items() if s]
            message = (f"the ranks disagree on skipped steps: step {step} was skipped on rank "
                       f"{', '.join(map(str, skip))} but taken on rank {', '.join(map(str, took))}, so their "
                       "weights no longer match; the loss scaler must decide on every rank's gradients alike")
            return {**first, "stage": Stage.EXCEPTION, "ranks": len(ranks),
                    "exception": {"type": "MpadviseError", "message": message, "rank": skip[0]}}
    losses, samples, times, underflow = [], [], [], []
    for step in range(steps):
        values = [float(column("losses", r)[step]) for r in order]
        counts = [column("samples", r)[step] for r in order]
        bad = [v for v in values if not math.isfinite(v)]
        if bad:
            losses.append(next((v for v in bad if math.isnan(v)), bad[0]))
        elif all(isinstance(c, int) and c > 0 for c in counts):
            losses.append(sum(v * c for v, c in zip(values, counts)) / sum(counts))
        else:
            losses.append(sum(values) / len(values))
        samples.append(sum(c for c in counts if isinstance(c, int)))
        step_times = [t for t in (column("step_times", r)[step] for r in order) if t is not None]
        times.append(max(step_times) if step_times else None)
        fractions = [u for u in (column("underflow", r)[step] for r in order) if u is not None]
        underflow.append(sum(fractions) / len(fractions) if fractions else None)
    peaks = [present[r].get("peak_memory") for r in order if present[r].get("peak_memory") is not None]
    notes = list(dict.fromkeys(n for r in order for n in present[r].get("notes") or []))
    first_bad = _first_non_finite(present, order, steps)
    if first_bad is not None:
        step, culprits = first_bad
        notes.append(f"the first non-finite loss came at step {step} on rank {', '.join(map(str, culprits))}")
    complete = all(present[r].get("complete", True) for r in order) and all(
        len(present[r].get("losses") or []) == steps for r in order)
    return {
        **first,
        "losses": [json_float(v) for v in losses],
        "step_times": [t for t in times if t is not None],
        "samples": samples,
        "skipped": skipped[order[0]],
        "loss_scale": column("loss_scale", order[0]),
        "underflow": underflow,
        "peak_memory": max(peaks) if peaks else None,
        "notes": notes,
        "complete": complete,
        "fsdp": any(present[r].get("fsdp") for r in order),
        "ranks": len(ranks),
        "timeline": merge_timelines([present[r].get("timeline") or {} for r in order]),
        **_merged_flops([present[r] for r in order]),
    }


def _first_non_finite(present: Mapping[int, Mapping[str, Any]], order: Sequence[int],
                      steps: int) -> tuple[int, list[int]] | None:
    """The first step at which some rank's loss was NaN or infinite, and those ranks (in DDP
    the others follow one step later, once the all-reduce has spread it)."""
    for step in range(steps):
        bad = [r for r in order if not math.isfinite(float((present[r].get("losses") or [])[step]))]
        if bad:
            return step, bad
    return None


def _merged_flops(ranks: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The node's FLOPs per step: the sum of every rank's (each counts its own share of the
    batch), as samples are summed; unknown unless every rank has a number."""
    counts = [data.get("flops_per_step") for data in ranks]
    if not counts or not all(isinstance(c, (int, float)) and not isinstance(c, bool) for c in counts):
        return {"flops_per_step": None, "flops_basis": None} if any("flops_per_step" in d for d in ranks) else {}
    return {"flops_per_step": float(sum(counts)), "flops_basis": ranks[0].get("flops_basis")}


def _number(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.inf


# torchrun ends a failed run with a report of its own: its traceback, then each worker's exit.
_LAUNCHER_FAILURE = "torch.distributed.elastic.multiprocessing.errors.ChildFailedError"


def _tail(raw: bytes, max_chars: int = 4000, max_lines: int = 30) -> str:
    text = _without_launcher_report(raw.decode("utf-8", errors="replace"))
    # torchao prints loader warnings for kernels this machine cannot use; they are not the error.
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return "\n".join(lines[-max_lines:])[-max_chars:]


def _without_launcher_report(text: str) -> str:
    """stderr without torchrun's closing report, which would fill the tail and push the
    failing rank's own traceback out; the trial's reason names the rank already."""
    at = text.rfind(_LAUNCHER_FAILURE)
    if at < 0:
        return text
    start = text.rfind("Traceback (most recent call last):", 0, at)
    return text[: start if start >= 0 else at]


def _last_line(tail: str) -> str:
    for line in reversed(tail.splitlines()):
        line = line.strip()
        if line and not line.startswith(("mpadvise:", "W1", "I1")):
            return line
    return ""


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
