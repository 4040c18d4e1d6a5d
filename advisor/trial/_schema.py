"""The trial protocol's schema, shared by the parent and the child: what a trial runs
(``TrialSpec``), how far its child got (``Stage``), the result file's fields (declared once in
``RESULT_FIELDS``) and what the parent makes of it (``TrialResult``), with the child's
environment and exit statuses named once for both sides. Plain data: no torch, no processes.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from enum import Enum
from typing import Any

from probes import MpadviseError

from ._timeline import breakdown

OUTCOMES = ("ok", "oom", "unstable", "crash", "timeout", "unsupported", "no-step", "no-policy", "lost")
"""``unstable`` is decided later, against the fp32 reference; the rest by ``classify``. ``lost``
is a trial that timed out or was killed by a signal before its candidate was applied: no
verdict on the candidate, which a tune runs again."""

EXIT_NO_STEP = 97
"""Exit status of a child whose watchdog saw no ``step()`` in time."""
EXIT_UNSUPPORTED = 98
"""Exit status of a child asked to run a mode its hardware lacks."""


# The child's environment, as the launcher (run_trial) leaves it and the child reads it.
TRIAL_SPEC_ENV = "MPADVISE_TRIAL_SPEC"
"""The path of the trial spec file: set by ``run_trial``, read by the child's ``spec_from_env``."""
POLICY_ENV = "MPADVISE_POLICY"
"""A config file that ``load_policy()`` applies; ``run_trial`` removes it from the child's
environment, since the spec decides the candidate and a leftover override must not."""
RANK_ENV = "RANK"
"""torchrun's global rank of a worker: which result file a rank of a multi-process trial writes."""


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


def rank_result_path(result_path: str | os.PathLike[str], rank: int) -> str:
    """Where rank ``rank`` of a multi-process trial writes its result: ``<result>.rank<R>``."""
    return f"{os.fspath(result_path)}.rank{rank}"


def stage_text(stage: str | None, result_file: Mapping[str, Any]) -> str:
    """How far the child got, for a reason: the losses are only written once a trial finishes."""
    if result_file.get("losses"):
        return f"after {len(result_file['losses'])} steps"
    if stage is None:
        return "before load_policy()"
    return "after its first step()" if stage == Stage.STEPPING else "after load_policy(), before any step()"
