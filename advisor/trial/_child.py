"""Inside a trial's child process: what ``load_policy()`` does when ``mpadvise tune`` or
``mpadvise trial`` injected a candidate, and the recorder that ``step()`` feeds.

The recorder times optimizer steps (the device synchronised at the edges of the measured
window; CUDA events in between), records loss, loss scale, skipped steps, fp16 gradient
underflow and peak memory, then writes the result file and ends the process. Its own work
inside a step (reading the loss scale, sampling gradients) runs between two time marks, and
that interval is cut out of the step's time: a trial times the user's step, not its measuring.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
import random
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from advisor.runtime import AppliedPolicy, StepObserver
from policies import Policy, PolicyError, mode_facts, supported_modes
from probes import HardwareProfile, UnsupportedHere

from ._schema import (
    EXIT_NO_STEP,
    EXIT_UNSUPPORTED,
    RANK_ENV,
    TRIAL_SPEC_ENV,
    Stage,
    TrialSpec,
    json_float,
    rank_result_path,
    unknown_result_fields,
)
from ._stacks import register_stack_dump
from ._timeline import clear as clear_marks
from ._timeline import mark, marks

if TYPE_CHECKING:
    import torch

# fp16's smallest subnormal value. A gradient whose scaled magnitude |g| * loss_scale is below
# it rounds to zero in an fp16 backward: the loss Micikevicius et al. (2018) measured (about 5%
# of weight gradients below 2^-24 without scaling) and StabilityThresholds.max_underflow_fraction
# bounds.
FP16_MIN_SUBNORMAL = 2.0**-24
# fp16's smallest normal value. Below it fp16 holds fewer significant bits, down to none at
# FP16_MIN_SUBNORMAL: a gradient whose values mostly lie there sits at the edge of what fp16
# can hold, and its zeros are values that fell off it (underflow_counts).
FP16_MIN_NORMAL = 2.0**-14
# Gradient values sampled on a sampled step, spread over all gradients in proportion to their
# size, so that each tensor weighs what its share of the values weighs. 2^16 values put the
# sampling error of a fraction near 5% below 0.1 percentage points.
UNDERFLOW_SAMPLE = 2**16
# The underflow is sampled on every UNDERFLOW_EVERY-th optimizer step (from step 0): it moves
# with the loss scale, which changes over tens of steps, and sampling costs device work. With
# the default 45-step trial that is 12 samples, 7 of them after the 16 calibration steps.
UNDERFLOW_EVERY = 4
# How often the RSS is sampled where the high-water mark cannot be reset: often enough to see
# an allocation that lives for a step, rarely enough to cost nothing measurable.
RSS_SAMPLE_S = 0.005
# How often the no-step watchdog looks at the clock and at torch.compile: a compilation is seen
# within this long of its start, and the thread stops at the first step, before any timing.
NO_STEP_POLL_S = 0.25
# The relative size of the one perturbation the fp32 replicate's initial parameters get, by
# the format it stands for: a bf16 rounding errs by at most half a unit in the last of its 8
# significant bits, 2^-8 of the value. A candidate in that format starts from the same weights
# and sees the same batches as fp32, and differs from it by roundings of about that size; the
# replicate differs by one, once, so how far it drifts is how much this workload amplifies
# a perturbation of precision's size (docs/stability.md, "Calibration to the workload").
PERTURBATIONS: dict[str, float] = {"bf16": 2.0**-8}
# The optimizer step whose FLOPs are counted (``spec.count_flops``): the second, so that the
# first step's compilation, autotuning and allocator growth are not inside the count. It must
# be a warm-up step: counting slows the step it counts, and no measured step may carry that.
FLOPS_STEP = 2
FLOPS_ESTIMATE = "6 x parameters x tokens"
"""The ``flops_basis`` of the estimate for a model fed token ids: 2 FLOPs per multiply-add,
the backward twice the forward, per trainable parameter and token."""
_CHILD_APPLIED: AppliedPolicy | None = None


class TrialComplete(BaseException):
    """Ends an in-process trial once its window is measured (a BaseException, so that a
    training function's ``except Exception`` does not swallow it)."""


def spec_from_env() -> TrialSpec | None:
    """The trial spec injected into this process, or ``None`` in a plain run.

    In a trial of several processes, each rank (torchrun's ``RANK``) gets the spec with its
    own result file, which the parent merges with the others.
    """
    path = os.environ.get(TRIAL_SPEC_ENV)
    if not path:
        return None
    spec = TrialSpec.from_json(Path(path).read_text())
    if spec.nproc_per_node > 1:
        rank = os.environ.get(RANK_ENV, "0")
        spec = dataclasses.replace(spec, result_path=rank_result_path(spec.result_path, int(rank) if rank.isdigit() else 0))
    register_stack_dump(spec.result_path)
    return spec


class ResultWriter:
    """Writes the result file atomically, so the parent never reads half a file."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self.data: dict[str, Any] = {}

    def write(self, **fields: Any) -> None:
        """Add ``fields`` to the result and write it whole.

        Raises:
            ValueError: a field that ``RESULT_FIELDS`` does not declare, which the parent
                would reject.
        """
        unknown = unknown_result_fields(fields)
        if unknown:
            raise ValueError(f"the trial result has no fields {unknown}; declare them in RESULT_FIELDS")
        self.data.update(fields, timeline=marks())
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.data, default=str))
        tmp.replace(self.path)


def seed_everything(seed: int) -> None:
    """Same seed in every trial: data order and initial weights match, curves compare."""
    import torch

    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np
    except ImportError:  # numpy is optional for torch
        pass
    else:
        np.random.seed(seed)


_DRAW_STRIDE = 1_000_003


def perturbation_seed(seed: int, draw: int) -> int:
    """The seed of a replicate's perturbation: the trial's own for the first draw (0), another
    for each later draw, so that two replicates of one reference are perturbed independently."""
    if isinstance(draw, bool) or not isinstance(draw, int) or draw < 0:
        raise ValueError(f"perturb draw: {draw!r} is not allowed; expected a whole number >= 0")
    return (seed + _DRAW_STRIDE * draw) % 2**63


def perturb_parameters(model: Any, *, perturb: str, seed: int, draw: int = 0) -> int:
    """Multiply every floating-point parameter once by ``1 + u * e``, ``u`` uniform in [-1, 1].

    ``e`` is the relative rounding error of the format ``perturb`` names (``PERTURBATIONS``).
    The draws come from a private generator seeded with ``seed`` (and ``draw``, for a second
    replicate perturbed otherwise: ``perturbation_seed``), so torch's global random state,
    which the script's data order and dropout masks come from, is left untouched, and every
    rank of a multi-process trial perturbs its replica alike.

    Returns:
        How many parameter values were perturbed.
    """
    import torch

    size = PERTURBATIONS.get(perturb)
    if size is None:
        raise ValueError(f"perturb: {perturb!r} is not a known perturbation; expected one of {sorted(PERTURBATIONS)}")
    generator = torch.Generator(device="cpu").manual_seed(perturbation_seed(seed, draw))
    count = 0
    with torch.no_grad():
        for parameter in model.parameters():
            if not parameter.is_floating_point() or parameter.numel() == 0:
                continue
            u = torch.rand(parameter.shape, generator=generator, dtype=torch.float64) * 2.0 - 1.0
            factor = (1.0 + size * u).to(device=parameter.device, dtype=torch.float32)
            parameter.mul_(factor.to(parameter.dtype) if parameter.dtype != torch.float32 else factor)
            count += parameter.numel()
    return count


def applied_for_trial(spec: TrialSpec, *, profile: HardwareProfile, device: str | None) -> AppliedPolicy:
    """Build the AppliedPolicy for the injected candidate, with a recorder attached.

    In the trial child process: an unsupported candidate ends the process with
    ``EXIT_UNSUPPORTED``; uncaught exceptions are recorded for the parent.
    """
    global _CHILD_APPLIED
    if _CHILD_APPLIED is not None:  # a script that calls load_policy() twice gets one recorder
        return _CHILD_APPLIED
    writer = ResultWriter(spec.result_path)
    writer.write(stage=Stage.LOADED, pid=os.getpid())
    install_excepthook(writer)
    applied = _build(spec, writer, profile=profile, device=device, in_process=False)
    if applied is None:
        end_trial_process(EXIT_UNSUPPORTED)
    _CHILD_APPLIED = applied
    return applied


def trial_candidate(
    spec: TrialSpec,
    writer: ResultWriter,
    *,
    profile: HardwareProfile,
    refusal: Callable[[Policy], str | None] | None = None,
) -> Policy | None:
    """The injected candidate, or ``None`` (with the reason written as ``unsupported``) when it
    cannot run here.

    Args:
        refusal: why the script's way of training cannot apply a policy (a framework's
            limits), judged before the hardware's support; ``None`` when it can apply any.
    """
    try:
        policy = Policy.from_dict(spec.policy, source="trial spec")
    except PolicyError as exc:
        writer.write(stage=Stage.UNSUPPORTED, reason=str(exc))
        return None
    reason = refusal(policy) if refusal is not None else None
    if reason is None:
        # The policy's own support: an FP8 recipe the device cannot run stops here, before a trial.
        support = supported_modes(profile, policy)[policy.mode]
        if not support.supported:
            reason = f"{policy.mode} cannot run on {profile.name}: {support.reason}"
    if reason is not None:
        writer.write(stage=Stage.UNSUPPORTED, reason=reason)
        return None
    return policy


def _build(
    spec: TrialSpec, writer: ResultWriter, *, profile: HardwareProfile, device: str | None, in_process: bool
) -> AppliedPolicy | None:
    policy = trial_candidate(spec, writer, profile=profile)
    if policy is None:
        return None
    seed_everything(spec.seed)
    recorder = TrialRecorder(spec, writer, in_process=in_process)
    applied = AppliedPolicy(policy, profile=profile, source=f"trial {spec.label or policy.mode}", device=device, observer=recorder)
    recorder.attach(applied)
    return applied


def run_in_process(train_fn: Any, spec: TrialSpec, *, profile: HardwareProfile) -> tuple[dict[str, Any], str | None]:
    """Run ``train_fn(mp)`` as one trial in this process.

    Returns:
        The result data (as a child would have written it) and the error text when
        ``train_fn`` raised, else ``None``.
    """
    import gc
    import traceback

    # An earlier trial's model and data may still be held by reference cycles (the frames of
    # the exception that ended it): free them, or they count in this trial's memory.
    gc.collect()
    clear_marks()  # this process ran earlier trials: their marks are not this one's
    writer = ResultWriter(spec.result_path)
    writer.write(stage=Stage.LOADED)
    applied = _build(spec, writer, profile=profile, device=spec.device, in_process=True)
    if applied is None:
        return writer.data, None
    recorder = applied._observer
    assert isinstance(recorder, TrialRecorder)
    error = None
    try:
        train_fn(applied)
    except TrialComplete:
        pass
    except UnsupportedHere as exc:
        writer.write(stage=Stage.UNSUPPORTED, reason=str(exc))
    except Exception as exc:  # the trial's outcome, not ours: classify it
        message = str(exc).splitlines()[0] if str(exc) else ""
        writer.write(stage=Stage.EXCEPTION, exception={"type": type(exc).__name__, "message": message, "at": time.time()})
        error = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    else:
        if recorder._stepped_once:
            recorder.finish(complete=False)
    finally:
        recorder.close()
    return writer.data, error


class StepWindow:
    """What both trial recorders (the loop API's and a framework's) share: the measured window
    of optimizer steps, timed on one DeviceClock, and the three ways a trial child ends (the
    window is full; no step came in time; the script ended before the window was full).

    A subclass sets ``spec``, ``writer``, ``marks``, ``clock``, ``_finished``, ``_watchdog``,
    ``_flops`` (``StepFlops.for_spec``) and what it recorded (per step: ``losses``,
    ``loss_scale``, ``skipped``, ``samples``; of the workload: ``notes``,
    ``workload_fingerprint``, ``model_signature``, ``fsdp``, ``batch``), and says whether the
    first step has begun (``_stepping``) and how long each step took (``_step_times``).
    ``result_payload`` turns that state into the result file's measurements.

    Both mark the trial's timeline alike (``advisor.trial._timeline``): ``policy_applied`` when
    the candidate is applied (which starts the first-step watchdog), then ``first_step``,
    ``warmup_done`` and ``measured_done`` at the ends of those optimizer steps.
    """

    spec: TrialSpec
    writer: ResultWriter
    marks: list[Any]
    clock: DeviceClock
    losses: list[Any]
    loss_scale: list[float | None]
    skipped: list[bool]
    samples: list[int]
    in_process = False
    optimizer_eps: float | None = None
    _finished: bool
    _watchdog: NoStepWatchdog | None
    _flops: StepFlops | None

    def _stepping(self) -> bool:
        raise NotImplementedError(f"{type(self).__qualname__} does not say whether it has begun; define _stepping()")

    def _step_times(self) -> list[float]:
        raise NotImplementedError(f"{type(self).__qualname__} does not say how long its steps took; define _step_times()")

    def _peak_memory(self) -> tuple[int | None, str]:
        """The trial's peak memory and its kind (``cuda-peak-allocated``, ``cpu-peak-rss``)."""
        return self.clock.peak_memory()

    def _underflow(self) -> tuple[list[float | None], str | None]:
        """Per step, the fp16 gradient underflow fraction (``None`` where not sampled), and a
        note on it for the report (``None`` without one)."""
        return [None] * len(self.losses), None

    def result_payload(self, *, complete: bool) -> dict[str, Any]:
        """The result file's measurements (stage ``done``), from what this recorder recorded.

        Args:
            complete: whether the measured window was full.
        """
        peak, kind = self._peak_memory()
        losses = [float(v) for v in self.losses]
        underflow, note = self._underflow()
        notes = list(self.notes)
        flops_per_step, flops_basis = (None, None) if self._flops is None else self._flops.result()
        flops_note = StepFlops.note_for(self.spec, self._flops)
        if flops_note is not None:
            notes.append(flops_note)
        return {
            "stage": Stage.DONE,
            "complete": complete,
            "losses": [json_float(v) for v in losses],
            "step_times": self._step_times()[: len(losses)],
            "loss_scale": self.loss_scale,
            "skipped": self.skipped,
            "underflow": underflow,
            "samples": self.samples,
            "warmup_steps": self.spec.warmup_steps,
            "peak_memory": peak,
            "memory_kind": kind,
            "notes": notes if note is None else [*notes, note],
            "workload_fingerprint": self.workload_fingerprint,
            "model_signature": self.model_signature,
            "fsdp": self.fsdp,
            "optimizer_eps": self.optimizer_eps,
            "flops_per_step": flops_per_step,
            "flops_basis": flops_basis,
            **self.batch,
        }

    def finish(self, *, complete: bool) -> None:
        """Write the result; with ``complete`` also end the trial (it has its data): the process,
        or in process the training function (``TrialComplete``)."""
        if self._finished:
            return
        self._finished = True
        if self._flops is not None:
            self._flops.stop(discard=True)  # a run that ended inside the counted step counted part of it
        self.clock.sync()
        self.writer.write(**self.result_payload(complete=complete))
        if complete:
            if self.in_process:
                raise TrialComplete
            end_trial_process(0)

    def _keep_short_run(self) -> None:
        """In a child process: a script that ends before the window is full keeps its steps."""
        atexit.register(self._at_exit)

    def _policy_applied(self, *, watch: bool) -> None:
        """The candidate is applied: mark it, and with ``watch`` (a child process) give the script
        ``spec.first_step_timeout`` from now to reach its first optimizer step.

        The watchdog counts from here, not from the process's start: imports, the script's data
        preparation and a framework's own set-up before that are no part of the candidate's cost.
        """
        mark("policy_applied")
        if watch:
            # Written at once: a child ended before its first step (a timeout, a signal, a peer
            # rank's failure) was past the candidate's application, which decides ``lost``.
            self.writer.write()
        if watch and self._watchdog is None and not self._stepping():
            self._watchdog = NoStepWatchdog(self.spec.first_step_timeout, self._no_step)
            self._watchdog.start()

    def watch_model(self, model: Any) -> None:
        """The model the script trains: its first forward's input says whether it is fed token
        ids, for the FLOP estimate where counting fails (only with ``spec.count_flops``)."""
        if self._flops is not None:
            self._flops.watch(model)

    def _open_window(self) -> None:
        """The first optimizer step begins: the clock's first mark (without a warm-up, also the
        edge of the measured window)."""
        self.clock.sync()
        self.marks.append(self.clock.mark())
        if self.spec.warmup_steps == 0:
            mark("warmup_done")

    def _end_of_step(self, steps: int) -> None:
        """Mark the end of optimizer step number ``steps``; a full window ends the trial.

        The FLOP counter (``spec.count_flops``) is entered just after the mark that ends the step
        before the counted one and left just before the counted step's own mark, so that its
        cost falls inside that warm-up step and in no other.
        """
        flops, warmup = self._flops, self.spec.warmup_steps
        if flops is not None and steps == flops.step:
            flops.stop()
        if steps == warmup or (steps == 1 and warmup > 1):
            self.clock.sync()  # edge of the measured window; the first step's end, for its mark
        self.marks.append(self.clock.mark())
        if steps == 1:
            mark("first_step")
        if steps == warmup:
            mark("warmup_done")
        if flops is not None and steps == flops.step - 1:
            flops.start()
        if steps >= warmup + self.spec.measure_steps:
            self.clock.sync()
            mark("measured_done")
            self.finish(complete=True)

    # What a framework adapter says of a script that reached no step (the plain torch adapter:
    # what it did reach), written as the result's reason and printed; None for the default reason.
    no_step_reason: Callable[[], str] | None = None

    def _no_step(self) -> None:
        reason = self.no_step_reason() if self.no_step_reason is not None else None
        if reason:
            sys.stderr.write(f"mpadvise: {reason}\n")
        self.writer.write(stage=Stage.NO_STEP, **({"reason": reason} if reason else {}))
        end_trial_process(EXIT_NO_STEP)

    def _at_exit(self) -> None:
        # The script ended by itself before the measured window was full: keep what it measured.
        if self._stepping() and not self._finished and self.writer.data.get("stage") not in (
                Stage.EXCEPTION, Stage.UNSUPPORTED):
            self.finish(complete=False)


class TrialRecorder(StepObserver, StepWindow):
    """Records every optimizer step of a trial and ends the process after the measured window.

    Per step it keeps the loss, the loss scale that scaled the step's backward, whether the
    scaler skipped it, and (fp16, every ``UNDERFLOW_EVERY``-th step) the underflow counts.
    """

    def __init__(self, spec: TrialSpec, writer: ResultWriter, *, in_process: bool = False) -> None:
        self.spec = spec
        self.in_process = in_process
        self.writer = writer
        self.applied: AppliedPolicy | None = None
        self.losses: list[Any] = []  # loss tensors, read once at the end (no sync per step)
        self.loss_scale: list[float | None] = []
        self.skipped: list[bool] = []
        self.underflow: list[Any] = []  # [flushed, nonzero] count tensors, read once at the end
        self.samples: list[int] = []
        self.marks: list[Any] = []  # one time mark (float or CUDA event) per step boundary
        self.pauses: list[tuple[Any, Any] | None] = []  # per step: marks around the recorder's own work
        self._in_step: dict[str, Any] = {}  # what after_backward measured, until after_step keeps it
        self._micro_losses: list[Any] = []
        self._micro_samples = 0
        self._stepped_once = False
        self._perturbed = False
        self._finished = False
        self._watchdog: NoStepWatchdog | None = None
        self._cuda = False
        self.clock = DeviceClock(None)
        self._previous_device: int | None = None  # in process: the current device to give back
        self._rss: TrialPeakRss | None = None
        self._flops = StepFlops.for_spec(spec)

    def attach(self, applied: AppliedPolicy) -> None:
        import torch

        self.applied = applied
        self._cuda = applied.device.type == "cuda"
        self.clock = DeviceClock(applied.device if self._cuda else None)
        if self._cuda:
            self._use_device(applied.device)
            if self.spec.memory_limit:
                total = torch.cuda.get_device_properties(applied.device).total_memory
                torch.cuda.set_per_process_memory_fraction(min(1.0, self.spec.memory_limit / total), applied.device)
            torch.cuda.reset_peak_memory_stats(applied.device)
        if self.in_process:
            if not self._cuda:
                # This process outlives the trial, so its lifetime peak RSS is not the trial's.
                self._rss = TrialPeakRss()
                self._rss.start()
            self._policy_applied(watch=False)  # no watchdog or exit hooks: the caller owns this process
            return
        self._keep_short_run()
        self._policy_applied(watch=True)

    def _use_device(self, device: torch.device) -> None:
        """Make the trial's device the current one while the trial runs.

        CUDA events, ``synchronize()`` and whatever names ``"cuda"`` without an index (a
        script's ``.cuda()``, torch.compile's and CUDA graphs' own allocations and streams)
        use the current device, which is device 0 until something sets it. A child process
        belongs to its trial and keeps the setting; an in-process trial gives it back in
        ``close()``.
        """
        import torch

        if device.index is None:  # plain "cuda" already means the current device
            return
        if self.in_process:
            self._previous_device = torch.cuda.current_device()
        torch.cuda.set_device(device)

    # ---- StepObserver -----------------------------------------------------------------------

    def after_setup(self, applied: AppliedPolicy, model: Any) -> None:
        # The replicate's one perturbation: after the mode converted the model (fp32 leaves it
        # as it is), before any step has used it.
        if self.spec.perturb and not self._perturbed:
            self._perturbed = True
            perturb_parameters(model, perturb=self.spec.perturb, seed=self.spec.seed, draw=self.spec.perturb_draw)
        self.watch_model(model)

    def before_step(self, applied: AppliedPolicy) -> None:
        if not self._stepped_once:
            self._stepped_once = True
            if self._watchdog is not None:
                self._watchdog.cancel()
            self.writer.write(stage=Stage.STEPPING, **self._batch_facts(applied))
            self._open_window()

    def after_backward(self, applied: AppliedPolicy, optimizer: torch.optim.Optimizer) -> None:
        # Everything here is the recorder's, not the user's: it runs between two marks that
        # finish() cuts out of the step's time. Here rather than after the optimizer step,
        # because a loss-scaling mode synchronises the device just after this point anyway
        # (to read the overflow flag), so the scale's read and the sampling add no wait of
        # their own to the rest of the step.
        start = self.clock.mark()
        if not self.losses:
            self.optimizer_eps = optimizer_eps(optimizer)
        scale = applied.loss_scale()
        counts = None
        facts = mode_facts(applied.mode)
        if "fp16" in (facts.autocast, facts.weights) and len(self.losses) % UNDERFLOW_EVERY == 0:
            counts = underflow_counts(_gradients(optimizer), scale=scale or 1.0)
        self._in_step = {"loss_scale": scale, "underflow": counts, "pause": (start, self.clock.mark())}

    def after_step(self, applied: AppliedPolicy, *, loss: Any, stepped: bool, optimizer_step: bool) -> None:
        # A copy, not a view: under torch.compile(mode="reduce-overhead") the loss lives in a
        # CUDA graph's output memory, which the next replay overwrites (or frees, so that
        # reading it raises). The copy is one scalar kernel, queued without a host sync.
        self._micro_losses.append(loss.detach().clone())
        self._micro_samples += applied.micro_step_samples or 0
        if not optimizer_step:
            return
        micro = self._micro_losses
        self.losses.append(micro[0] if len(micro) == 1 else sum(m.float() for m in micro) / len(micro))
        self.samples.append(self._micro_samples)
        self._micro_losses, self._micro_samples = [], 0
        measured, self._in_step = self._in_step, {}
        self.loss_scale.append(measured.get("loss_scale"))
        self.underflow.append(measured.get("underflow"))
        self.pauses.append(measured.get("pause"))
        self.skipped.append(not stepped)
        self._end_of_step(len(self.losses))

    # ---- measuring ----------------------------------------------------------------------------

    def _stepping(self) -> bool:
        return self._stepped_once

    def _step_times(self) -> list[float]:
        """Seconds per step, less the recorder's own work in it."""
        times = []
        for i, (a, b) in enumerate(zip(self.marks, self.marks[1:])):
            pause = self.pauses[i] if i < len(self.pauses) else None
            own = DeviceClock.elapsed(*pause) if pause is not None else 0.0
            times.append(max(0.0, DeviceClock.elapsed(a, b) - own))
        return times

    def _peak_memory(self) -> tuple[int | None, str]:
        if self._rss is not None and not self._cuda:
            return self._rss.stop(), "cpu-peak-rss"
        return self.clock.peak_memory()

    def _underflow(self) -> tuple[list[float | None], str | None]:
        counts = [[int(v) for v in c.tolist()] for c in self.underflow if c is not None]
        return [None if c is None else _fraction(c) for c in self.underflow], underflow_note(counts)

    def _applied(self) -> AppliedPolicy:
        if self.applied is None:
            raise RuntimeError("the trial recorder was never attached to an AppliedPolicy")
        return self.applied

    # ---- what the result says of the workload, read from the applied policy ----------------

    @property
    def notes(self) -> list[str]:
        return list(self._applied().notes)

    @property
    def workload_fingerprint(self) -> str | None:
        return self._applied().workload_fingerprint

    @property
    def model_signature(self) -> str | None:
        return self._applied().model_signature

    @property
    def fsdp(self) -> bool:
        return self._applied().fsdp

    @property
    def batch(self) -> dict[str, Any]:
        return self._batch_facts(self._applied())

    def _batch_facts(self, applied: AppliedPolicy) -> dict[str, Any]:
        return {
            "user_batch": applied.user_batch,
            "micro_batch": applied.policy.micro_batch_size or applied.user_batch,
            "grad_accum_steps": applied.grad_accum_steps,
            "global_batch": applied.global_batch,
            "device": str(applied.device),
        }

    def close(self) -> None:
        """Stop what runs beside the trial (the RSS sampler, a FLOP count in progress) and give
        back the current device, however the trial ended."""
        if self._flops is not None:
            self._flops.stop(discard=True)  # the training function raised inside the counted step
        if self._rss is not None:
            self._rss.stop()
        if self._previous_device is not None:
            import torch

            torch.cuda.set_device(self._previous_device)
            self._previous_device = None

class StepFlops:
    """Counts the FLOPs of one whole optimizer step of a trial: forward, backward and optimizer,
    over all of the step's micro-batches.

    torch's ``FlopCounterMode`` is entered at the end of the step before (``start``) and left at
    the end of the counted step (``stop``), so it sees everything the process computes in
    between, whatever framework runs the loop. It counts matmuls, convolutions and attention
    from their shapes, the work that dominates training; element-wise work is not counted.

    Where counting fails (it raised, or counted nothing: work the counter does not know) and the
    model's first training forward took an integer tensor (token ids), the step's work is
    estimated as 6 x trainable parameters x tokens (2 FLOPs per multiply-add, the backward twice
    the forward), the tokens being those the counted step's forwards took.

    Args:
        step: the optimizer step to count (from 1); the one before it must end first.
    """

    def __init__(self, step: int = FLOPS_STEP) -> None:
        self.step = step
        self.flops: int | None = None
        self.error: str | None = None
        self.tokens = 0
        self.integer_input: bool | None = None
        self.parameters = 0
        self._model: Any = None
        self._counter: Any = None
        self._counting = False
        self._done = False

    @classmethod
    def for_spec(cls, spec: TrialSpec) -> StepFlops | None:
        """The counter a trial asks for (``spec.count_flops``), or ``None``: not asked, or a
        warm-up too short to hold the counted step."""
        if not spec.count_flops or spec.warmup_steps < FLOPS_STEP:
            return None
        return cls()

    @staticmethod
    def note_for(spec: TrialSpec, flops: StepFlops | None) -> str | None:
        """A sentence for the trial's report where FLOPs were asked for and not counted."""
        if not spec.count_flops:
            return None
        if flops is None:
            return (f"FLOPs per step not counted: the warm-up has {spec.warmup_steps} steps, and the counted step "
                    f"(step {FLOPS_STEP}) must be one of them; run with --warmup {FLOPS_STEP} or more")
        if not flops._done or (flops.flops and flops.error is None):
            return None
        why = flops.error or "torch's FLOP counter counted nothing in the step"
        if flops.result()[1] == FLOPS_ESTIMATE:
            return f"FLOPs per step estimated as {FLOPS_ESTIMATE} ({flops.tokens} tokens): counting failed: {why}"
        return f"FLOPs per step not known: counting failed ({why}), and the model is not fed token ids"

    def watch(self, model: Any) -> None:
        """Read the training forwards of ``model`` (the first one given): whether the first took
        token ids, and how many tokens the counted step's forwards took."""
        if self._model is not None or not hasattr(model, "register_forward_pre_hook"):
            return
        self._model = model

        def pre_hook(module: Any, args: Any, kwargs: Any) -> None:
            import torch

            if not torch.is_grad_enabled():
                return  # an evaluation forward, not the training step's
            first = _first_tensor(args, kwargs)
            if first is None:
                return
            integer = not (first.is_floating_point() or first.is_complex()) and first.dtype != torch.bool
            if self.integer_input is None:
                self.integer_input = integer
            if self._counting and integer:
                self.tokens += first.numel()

        model.register_forward_pre_hook(pre_hook, with_kwargs=True)

    def start(self) -> None:
        """Enter the counter: the counted step begins."""
        if self._counting or self._done:
            return
        self._counting = True  # tokens are read even where the counter cannot be entered
        try:
            counter = _guarded_flop_counter()
            counter.__enter__()
        except Exception as exc:  # counting is a measurement of the trial, never its failure
            self.error = f"{type(exc).__name__}: {exc}"
            return
        self._counter = counter

    def stop(self, *, discard: bool = False) -> None:
        """Leave the counter: the counted step ended (with ``discard``, the trial ended inside
        it, and what was counted is not a whole step)."""
        if not self._counting:
            return
        self._counting, self._done = False, not discard
        counter, self._counter = self._counter, None
        if counter is not None:
            try:
                counter.__exit__(None, None, None)
                self.flops = int(counter.get_total_flops())
            except Exception as exc:
                self.error = self.error or f"{type(exc).__name__}: {exc}"
            self.error = self.error or counter.failure
        if self._model is not None:
            self.parameters = sum(p.numel() for p in self._model.parameters() if p.requires_grad)

    def result(self) -> tuple[float | None, str | None]:
        """``(flops_per_step, flops_basis)``: counted, estimated, or ``(None, None)``."""
        if not self._done:
            return None, None
        if self.flops and self.error is None:
            return float(self.flops), "counted"
        if self.integer_input and self.tokens and self.parameters:
            return 6.0 * self.parameters * self.tokens, FLOPS_ESTIMATE
        return None, None


def _first_tensor(args: Any, kwargs: Any) -> Any:
    """A forward's first input tensor: the first positional one, else ``input_ids`` (how a Hugging
    Face model is called), else the first keyword one; ``None`` without one."""
    import torch

    for value in args:
        if isinstance(value, torch.Tensor):
            return value
    if isinstance(kwargs.get("input_ids"), torch.Tensor):
        return kwargs["input_ids"]
    return next((v for v in kwargs.values() if isinstance(v, torch.Tensor)), None)


def _guarded_flop_counter() -> Any:
    """torch's FlopCounterMode (quiet) whose counting of one operation cannot fail the script's
    step: an error is kept as ``failure`` (the count is then incomplete) and the operation's
    result passes on."""
    from torch.utils.flop_counter import FlopCounterMode

    class GuardedFlopCounter(FlopCounterMode):
        failure: str | None = None

        def _count_flops(self, func_packet: Any, out: Any, args: Any, kwargs: Any) -> Any:
            try:
                return super()._count_flops(func_packet, out, args, kwargs)
            except Exception as exc:
                if self.failure is None:
                    self.failure = f"counting {func_packet} raised {type(exc).__name__}: {exc}"
                return out

    return GuardedFlopCounter(display=False)


class DeviceClock:
    """Time marks and peak memory on one device: CUDA events on its stream, else the host clock.

    Args:
        device: the CUDA device a trial runs on, or ``None`` for the CPU.
    """

    def __init__(self, device: Any | None) -> None:
        self.device = device

    def mark(self) -> Any:
        if self.device is None:
            return time.perf_counter()
        import torch

        # On the trial device's stream, whatever the current device is by now: an event on
        # another device's stream would time that device's (absent) work.
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def sync(self) -> None:
        if self.device is not None:
            import torch

            torch.cuda.synchronize(self.device)

    @staticmethod
    def elapsed(a: Any, b: Any) -> float:
        """Seconds between two marks of one clock."""
        return a.elapsed_time(b) / 1e3 if hasattr(a, "elapsed_time") else b - a

    def peak_memory(self) -> tuple[int | None, str]:
        """The CUDA peak allocated, or this process's lifetime peak RSS on a CPU; and its kind."""
        if self.device is not None:
            import torch

            return int(torch.cuda.max_memory_allocated(self.device)), "cuda-peak-allocated"
        rss = _lifetime_peak_rss()
        return (None, "") if rss is None else (rss, "cpu-peak-rss")


class CompileActivity:
    """Whether torch.compile is compiling in this process now, found without importing it.

    Dynamo runs start and end callbacks around each compilation (tracing a frame, a backward
    compiled lazily, a CUDA graph recorded), counting nested ones as one. ``torch.compile``
    imports Dynamo before it compiles anything, so the first look after that registers the
    callbacks here, and registers them again after ``torch._dynamo.reset()`` cleared them. A
    compilation already running when they were registered is seen through Dynamo's count of
    pending compilations, where this torch has it.
    """

    def __init__(self) -> None:
        self._compiling = False

    def _started(self, *_: Any) -> None:  # newer torch passes a CallbackArgs, older torch nothing
        self._compiling = True

    def _ended(self, *_: Any) -> None:
        self._compiling = False

    def compiling(self) -> bool:
        """True while a compilation runs; False too where torch.compile was never imported."""
        handler = getattr(sys.modules.get("torch._dynamo"), "callback_handler", None)
        if handler is None:  # no torch.compile in this process (or its import has not got there)
            return False
        try:
            if self._started not in handler.start_callbacks:
                handler.register_start_callback(self._started)
                handler.register_end_callback(self._ended)
        except (AttributeError, TypeError):  # a torch whose callbacks look otherwise
            return False
        pending = getattr(handler, "_CompilationCallbackHandler__pending_callbacks_counter", 0)
        return self._compiling or (isinstance(pending, int) and pending > 0)


class NoStepWatchdog:
    """Calls ``on_expire`` once when ``timeout`` seconds pass without a step, not counting the
    time torch.compile spends compiling.

    torch.compile compiles inside the first forward, before the first ``step()``; on a large
    model, or with ``mode="max-autotune"``, that alone can take minutes, and a deadline counted
    from ``load_policy()`` would end a healthy trial as "no-step". So the deadline moves while
    a compilation runs: it is never earlier than ``timeout`` after the latest moment the
    watchdog saw one running, and the script has the whole timeout to reach its first step
    after its last compilation. A compilation that never ends is still bounded by the trial's
    overall timeout, which the parent process enforces.
    """

    def __init__(
        self,
        timeout: float,
        on_expire: Callable[[], None],
        *,
        activity: CompileActivity | None = None,
        clock: Callable[[], float] = time.monotonic,
        poll_s: float | None = None,
    ) -> None:
        self.timeout = timeout
        self._on_expire = on_expire
        self._activity = activity or CompileActivity()
        self._clock = clock
        self._poll_s = poll_s if poll_s is not None else min(NO_STEP_POLL_S, timeout / 4)
        self._deadline = clock() + timeout
        self._stop = threading.Event()

    def start(self) -> None:
        threading.Thread(target=self._watch, name="mpadvise-no-step", daemon=True).start()

    def cancel(self) -> None:
        """Stop watching (the script stepped)."""
        self._stop.set()

    def expired(self) -> bool:
        """One look: whether the time is up, moving the deadline if a compilation runs."""
        now = self._clock()
        if self._activity.compiling():
            self._deadline = max(self._deadline, now + self.timeout)
            return False
        return now >= self._deadline

    def _watch(self) -> None:
        while not self._stop.wait(self._poll_s):
            if self.expired():
                if not self._stop.is_set():
                    self._on_expire()
                return


def optimizer_eps(optimizer: Any) -> float | None:
    """The smallest ``eps`` among the optimizer's param groups that compute in their own dtype
    (a ``fused`` group computes in fp32), or ``None`` where no group has a numeric one.

    A verdict reads it: an eps that rounds to zero in fp16 makes pure fp16's Adam divide by zero.
    """
    values = [group["eps"] for group in getattr(optimizer, "param_groups", ())
              if isinstance(group.get("eps"), (int, float)) and not isinstance(group.get("eps"), bool)
              and not group.get("fused")]
    return float(min(values)) if values else None


def _gradients(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's gradients; under FSDP2 this rank's shards of them (a DTensor's local
    part: sampling the whole tensor would gather it from every rank)."""
    import torch

    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
    return [g for g in local if g.layout == torch.strided]  # sparse gradients have no flat view


def underflow_counts(grads: list[torch.Tensor], *, scale: float, budget: int = UNDERFLOW_SAMPLE) -> torch.Tensor | None:
    """Count sampled gradient values that an fp16 backward lost, or would lose, to underflow.

    The sample is systematic over all gradients laid end to end (every ``stride``-th value), so
    each tensor contributes in proportion to its size. Non-finite values (a step the scaler
    skips) are left out. Two kinds of value are lost:

    * would flush: nonzero, but below fp16's smallest subnormal 2^-24 once multiplied by the
      loss scale. Only a gradient held in more precision than fp16 shows these (a layer that
      runs in fp32 under autocast); it would lose them in fp16.
    * already flushed: zeros. A gradient that came through an fp16 operation (every autocast
      matmul, every layer of fp16-true) holds the values that flushed as exact zeros, so with
      99.9% of such a gradient flushed, the nonzero values alone showed 0% lost. But exact
      zeros are also what fp32 computes for a dead ReLU unit, an embedding row not in the
      batch or an input feature that is zero, which no loss scale changes. The two are told
      apart per gradient tensor: a flush takes the values below 2^-24, so where a tensor's
      nonzero values mostly lie in fp16's subnormal range (below 2^-14, where it keeps fewer
      significant bits), the tensor sits at fp16's edge and its zeros count as flushed; where
      they mostly lie in fp16's normal range, its zeros are structural and are left out, as
      exact zeros that fp32 would produce too. A tensor with no nonzero value sampled counts as
      flushed only when no tensor shows values in the normal range (the whole gradient
      flushed); beside healthy tensors it is more likely a sparse one (an embedding table).

    The verdict uses both: their sum over the values counted (the nonzero ones and the zeros
    counted as flushed), since both are gradient that an fp16 backward at this scale does not
    deliver. The median rule undercounts a partial flush of a tensor whose values spread over
    many binades (a few percent at most while its median stays above 2^-14) and overcounts a
    tensor at fp16's edge that also has structural zeros; both err by less than the underflow
    limit's 5% in the cases that matter.

    Args:
        grads: the unscaled gradients, on one device.
        scale: the loss scale the backward ran with (1.0 without scaling).
        budget: about how many values to sample (between ``budget`` and twice that).

    Returns:
        ``[already flushed, would flush, counted]`` as a tensor on the gradients' device, so
        that sampling adds no host synchronisation (read it when the trial ends), or ``None``
        without gradients.
    """
    import torch

    total = sum(g.numel() for g in grads)
    if not total:
        return None
    stride = max(1, total // budget)
    device = grads[0].device
    pieces, owners, offset = [], [], 0
    with torch.no_grad():
        for g in grads:
            first = -offset % stride  # where the global every-stride-th sequence enters this tensor
            if first < g.numel():
                pieces.append(g.detach().reshape(-1)[first::stride].to(device=device, dtype=torch.float32))
                owners.append(torch.full((pieces[-1].numel(),), len(owners), device=device))
            offset += g.numel()
        scaled = torch.cat(pieces).abs_().mul_(scale)  # cat copies: the gradients are not touched
        tensor_of = torch.cat(owners)

        def per_tensor(values: torch.Tensor) -> torch.Tensor:
            # index_add_ rather than bincount, which reads the largest index back to the host.
            counts = torch.zeros(len(owners), dtype=torch.long, device=device)
            return counts.index_add_(0, tensor_of, values.long())

        nonzero = (scaled > 0) & torch.isfinite(scaled)
        would_flush = nonzero & (scaled < FP16_MIN_SUBNORMAL)
        zeros, values, low = per_tensor(scaled == 0), per_tensor(nonzero), per_tensor(nonzero & (scaled < FP16_MIN_NORMAL))
        at_edge = (values > 0) & (2 * low > values)  # most of its values are subnormal in fp16
        healthy = (values > 0) & ~at_edge
        empty = values == 0
        flushed = (zeros * at_edge).sum() + (zeros * empty).sum() * (healthy.sum() == 0)
        return torch.stack([flushed, would_flush.sum(), nonzero.sum() + flushed])


def underflow_note(counts: list[list[int]]) -> str | None:
    """One line with both kinds of underflow over a trial's sampled steps, or ``None`` when no
    sampled value was lost.

    Args:
        counts: ``underflow_counts``'s ``[already flushed, would flush, counted]`` per sampled step.
    """
    flushed, would_flush, counted = (sum(c[i] for c in counts) for i in range(3))
    if not counted or not flushed + would_flush:
        return None
    return (
        f"fp16 gradient underflow over {len(counts)} sampled steps: {flushed / counted:.1%} of the sampled "
        f"gradient values had already flushed to zero, {would_flush / counted:.1%} would flush at the loss scale in use"
    )


def _fraction(counts: torch.Tensor) -> float | None:
    """The share of counted values lost to underflow (already flushed or would flush)."""
    flushed, would_flush, counted = (int(v) for v in counts.tolist())
    return (flushed + would_flush) / counted if counted else None


def reset_peak_rss() -> bool:
    """Reset this process's RSS high-water mark (VmHWM) to its current RSS; False where Linux
    does not allow it (not Linux, a kernel before 4.0, no write access to clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # 5 resets the peak RSS only; 1-4 would clear page-referenced bits
    except OSError:
        return False
    return _status_bytes("VmHWM") is not None


def _status_bytes(field: str) -> int | None:
    """A ``kB`` field of ``/proc/self/status`` in bytes, or ``None`` where there is none."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _current_rss() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def _lifetime_peak_rss() -> int | None:
    try:
        import resource
    except ImportError:  # not on Windows
        return None
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # Linux reports KiB, macOS bytes


class TrialPeakRss:
    """The peak RSS of this process from ``start()`` to ``stop()``: one in-process trial's own.

    Linux keeps the high-water mark (VmHWM) for the life of the process, and writing 5 to
    ``/proc/self/clear_refs`` resets it to the current RSS: the mark read at the end is then
    this trial's peak, exactly and at no cost while it runs. Where that is not allowed, the
    peak comes from two cheaper facts: a lifetime peak (``ru_maxrss``) that rose during the
    trial was set by it, and is exact; otherwise a thread samples the current RSS every
    ``RSS_SAMPLE_S`` (a lower bound that can miss a spike shorter than that). Without either
    (no /proc), the peak is unknown (``None``) unless the lifetime peak rose.
    """

    def __init__(self) -> None:
        self._hwm = False
        self._lifetime_at_start: int | None = None
        self._sampled = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._peak: int | None = None
        self._stopped = False

    def start(self) -> None:
        if reset_peak_rss():
            self._hwm = True
            return
        self._lifetime_at_start = _lifetime_peak_rss()
        self._sampled = _current_rss() or 0
        if self._sampled:
            self._thread = threading.Thread(target=self._sample, name="mpadvise-rss", daemon=True)
            self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(RSS_SAMPLE_S):
            self._sampled = max(self._sampled, _current_rss() or 0)

    def stop(self) -> int | None:
        """The trial's peak in bytes (the same value on every later call), or ``None`` if unknown."""
        if self._stopped:
            return self._peak
        self._stopped = True
        if self._hwm:
            self._peak = _status_bytes("VmHWM")
            return self._peak
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._sampled = max(self._sampled, _current_rss() or 0)
        lifetime = _lifetime_peak_rss()
        if lifetime is not None and self._lifetime_at_start is not None and lifetime > self._lifetime_at_start:
            self._peak = lifetime
        else:
            self._peak = self._sampled or None
        return self._peak


def install_excepthook(writer: ResultWriter) -> None:
    previous = sys.excepthook

    def hook(exc_type: type[BaseException], exc: BaseException, tb: Any) -> None:
        if issubclass(exc_type, UnsupportedHere):
            writer.write(stage=Stage.UNSUPPORTED, reason=str(exc))
        elif not issubclass(exc_type, KeyboardInterrupt):
            # The time tells the rank that failed first from those that lost it as a peer.
            writer.write(stage=Stage.EXCEPTION, exception={"type": exc_type.__name__, "message": str(exc).splitlines()[0] if str(exc) else "",
                                                       "at": time.time()})
        previous(exc_type, exc, tb)

    sys.excepthook = hook


def end_trial_process(code: int) -> NoReturn:
    """End the trial child now: the result is written, the script's remaining work is not needed."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
