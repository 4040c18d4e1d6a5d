"""The trial protocol's schema, shared by parent and child: ``TrialSpec``, ``Stage``, the result
file's fields (``RESULT_FIELDS``), ``TrialResult``, the child's environment and exit statuses."""

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
"""``unstable`` is judged later, against the fp32 reference; ``lost``: ended before the candidate
was applied (no verdict, a tune runs it again)."""

EXIT_NO_STEP = 97  # the child's watchdog saw no step() in time
EXIT_UNSUPPORTED = 98  # the child was asked to run a mode its hardware lacks


# The child's environment, as the launcher (run_trial) leaves it and the child reads it.
TRIAL_SPEC_ENV = "MPADVISE_TRIAL_SPEC"  # the trial spec file's path
# A config file that load_policy() applies; run_trial removes it: the spec decides the candidate.
POLICY_ENV = "MPADVISE_POLICY"
RANK_ENV = "RANK"  # which result file a rank of a multi-process trial writes


class Stage(str, Enum):
    """How far a trial child got: its result file's ``stage`` (a str: the file holds the value)."""

    LOADED = "loaded"  # load_policy() (or a framework's boot) ran; no step began yet
    STEPPING = "stepping"  # the first optimizer step began; the batch facts are written
    DONE = "done"  # the measurements are written
    EXCEPTION = "exception"  # the script raised; ``exception`` holds its type, message and time
    UNSUPPORTED = "unsupported"  # the candidate cannot run here; ``reason`` says why
    NO_STEP = "no-step"  # no step within the first-step timeout; the child ended itself

    def __str__(self) -> str:
        return self.value


# A trial's measuring window unless a tune asks for another (the tune options' defaults too).
DEFAULT_WARMUP_STEPS = 5
DEFAULT_MEASURE_STEPS = 40


@dataclass(frozen=True)
class ResultField:
    """One field of a trial's result file; ``kept``: the TrialResult field of that name has it."""

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


def unknown_result_fields(data: Mapping[str, Any]) -> list[str]:
    return sorted(str(key) for key in set(data) - {f.name for f in RESULT_FIELDS})


@dataclass(frozen=True)
class TrialSpec:
    """What one trial runs: the candidate, the measuring window and the limits.

    ``seed`` is the same for every trial of a tune, so data order, initial weights and loss
    curves match step by step. ``memory_limit`` (bytes) is a real cap on CUDA, a verdict on
    peak RSS on a CPU. ``first_step_timeout`` counts from the candidate's application, not
    counting torch.compile's compilation. ``framework`` is ``None`` for a script that calls
    ``load_policy()``. ``perturb`` is ``None`` for a candidate; for the fp32 replicate, the
    format whose rounding perturbs the initial parameters once (``perturb_draw``: which draw)."""

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
        data = json.loads(text)
        unknown = sorted(set(data) - {f.name for f in fields(cls)})
        if unknown:
            raise MpadviseError(f"the trial spec holds unknown fields {unknown}; the process that wrote "
                                "it runs another version of mpadvise: run the trial with the same installation")
        return cls(**data)


@dataclass(frozen=True)
class TrialResult:
    """What one trial measured, and how it ended.

    Per-step lists hold one entry per optimizer step from the first (warm-up included, so loss
    curves compare from step 0); the timing statistics drop the first ``warmup_steps``.
    ``underflow`` is sampled on some steps only (``None`` on the others, and outside fp16)."""

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
        return breakdown(self.timeline)

    @property
    def applied(self) -> bool:
        """Whether the candidate was applied (a trial that measured steps was)."""
        return "policy_applied" in self.timeline or bool(self.losses)

    def with_outcome(self, outcome: str, reason: str) -> TrialResult:
        return replace(self, outcome=outcome, reason=reason)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["losses"] = [json_float(v) for v in self.losses]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrialResult:
        kwargs = dict(data)
        for name in ("step_times", "loss_scale", "skipped", "underflow", "samples", "notes"):
            if kwargs.get(name) is not None:
                kwargs[name] = tuple(kwargs[name])
        kwargs["losses"] = tuple(float(v) for v in kwargs.get("losses", ()))
        return cls(**kwargs)


def json_float(value: float) -> float | str:
    """A loss for strict JSON, which has no NaN/Infinity: those become strings float() reads."""
    return value if math.isfinite(value) else str(value)


def parse_memory(text: str) -> int:
    """``"4GiB"``, ``"512MiB"``, ``"2G"``, ``"1500000000"`` -> bytes."""
    units = {"": 1, "b": 1}
    for power, letter in enumerate("kmgt", start=1):
        units.update({letter: 10 ** (3 * power), letter + "b": 10 ** (3 * power), letter + "ib": 2 ** (10 * power)})
    raw = str(text).strip().lower().replace(" ", "")
    number = raw.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = raw[len(number) :]
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if unit not in units or value <= 0:
        raise MpadviseError(f"memory limit {text!r} is not a size; expected e.g. 4GiB, 512MiB or 2000000000")
    return int(value * units[unit])


def rank_result_path(result_path: str | os.PathLike[str], rank: int) -> str:
    return f"{os.fspath(result_path)}.rank{rank}"


def stage_text(stage: str | None, result_file: Mapping[str, Any]) -> str:
    """How far the child got, for a reason: the losses are only written once a trial finishes."""
    if result_file.get("losses"):
        return f"after {len(result_file['losses'])} steps"
    if stage is None:
        return "before load_policy()"
    return "after its first step()" if stage == Stage.STEPPING else "after load_policy(), before any step()"
