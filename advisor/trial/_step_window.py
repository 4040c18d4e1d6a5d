"""What both trial recorders (``_child``) share: the measured window of optimizer steps, the
result file, the ways a trial child ends, its first-step watchdog (not counting torch.compile's
compiling), the FLOPs of one optimizer step, the seeds and the fp32 replicate's perturbation."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import random
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from probes import UnsupportedHere

from ._device import DeviceClock
from ._schema import EXIT_NO_STEP, Stage, TrialSpec, json_float, unknown_result_fields
from ._timeline import mark, marks

# How often the no-step watchdog looks at the clock and at torch.compile: a compilation is seen
# within this long of its start, and the thread stops at the first step, before any timing.
NO_STEP_POLL_S = 0.25


class CompileActivity:
    """Whether torch.compile is compiling now, without importing it: Dynamo's start and end
    callbacks (registered at each look, as ``torch._dynamo.reset()`` drops them) and its count."""

    def __init__(self) -> None:
        self._compiling = False

    def _started(self, *_: Any) -> None:  # newer torch passes a CallbackArgs, older torch nothing
        self._compiling = True

    def _ended(self, *_: Any) -> None:
        self._compiling = False

    def compiling(self) -> bool:
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
    """Calls ``on_expire`` once when ``timeout`` seconds pass without a step. torch.compile
    compiles inside the first forward, which can take minutes, so the deadline is never earlier
    than ``timeout`` after the latest moment a compilation was seen running (the trial's own
    timeout still bounds one that never ends)."""

    def __init__(self, timeout: float, on_expire: Callable[[], None], *,
                 activity: CompileActivity | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout = timeout
        self._on_expire = on_expire
        self._activity = activity or CompileActivity()
        self._clock = clock
        self._poll_s = min(NO_STEP_POLL_S, timeout / 4)
        self._deadline = clock() + timeout
        self._stop = threading.Event()

    def start(self) -> None:
        threading.Thread(target=self._watch, name="mpadvise-no-step", daemon=True).start()

    def cancel(self) -> None:
        self._stop.set()

    def expired(self) -> bool:
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


# The relative size of the fp32 replicate's one perturbation, by the format it stands for: a bf16
# rounding errs by at most 2^-8 of the value. How far the replicate drifts is how much this workload
# amplifies a perturbation of precision's size (docs/stability.md, "Calibration to the workload").
PERTURBATIONS: dict[str, float] = {"bf16": 2.0**-8}


def seed_everything(seed: int) -> None:
    import torch

    random.seed(seed)
    torch.manual_seed(seed)
    with contextlib.suppress(ImportError):  # numpy is optional for torch
        import numpy as np

        np.random.seed(seed)


def perturbation_seed(seed: int, draw: int) -> int:
    """The seed of a replicate's perturbation: the trial's for draw 0, another for each later."""
    if isinstance(draw, bool) or not isinstance(draw, int) or draw < 0:
        raise ValueError(f"perturb draw: {draw!r} is not allowed; expected a whole number >= 0")
    return (seed + 1_000_003 * draw) % 2**63


def perturb_parameters(model: Any, *, perturb: str, seed: int, draw: int = 0) -> None:
    """Multiply every floating-point parameter once by ``1 + u * e``, ``u`` uniform in [-1, 1] and
    ``e`` from ``PERTURBATIONS``. A private generator leaves torch's global random state
    untouched, and every rank perturbs its replica alike."""
    import torch

    size = PERTURBATIONS.get(perturb)
    if size is None:
        raise ValueError(f"perturb: {perturb!r} is not a known perturbation; expected one of {sorted(PERTURBATIONS)}")
    generator = torch.Generator(device="cpu").manual_seed(perturbation_seed(seed, draw))
    with torch.no_grad():
        for parameter in model.parameters():
            if not parameter.is_floating_point() or parameter.numel() == 0:
                continue
            u = torch.rand(parameter.shape, generator=generator, dtype=torch.float64) * 2.0 - 1.0
            factor = (1.0 + size * u).to(device=parameter.device, dtype=torch.float32)
            parameter.mul_(factor.to(parameter.dtype))


# The optimizer step whose FLOPs are counted (``spec.count_flops``): the second, so that the
# first step's compilation, autotuning and allocator growth are not inside the count. It must
# be a warm-up step: counting slows the step it counts, and no measured step may carry that.
FLOPS_STEP = 2
# 2 FLOPs per multiply-add, the backward twice the forward, per trainable parameter and token.
FLOPS_ESTIMATE = "6 x parameters x tokens"


class StepFlops:
    """Counts the FLOPs of optimizer step ``FLOPS_STEP``, all its micro-batches: torch's
    ``FlopCounterMode`` is entered at the end of the step before and left at the end of the
    counted one, whatever framework runs the loop."""

    def __init__(self) -> None:
        self.flops: int | None = None
        self.error: str | None = None
        self.tokens = 0
        self.integer_input: bool | None = None
        self.parameters = 0
        self._model: Any = None
        self._counter: Any = None
        self._counting = self._done = False

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
        """Count the token ids the first ``model``'s training forwards take in the counted step."""
        if self._model is not None or not hasattr(model, "register_forward_pre_hook"):
            return
        self._model = model

        def pre_hook(module: Any, args: Any, kwargs: Any) -> None:
            import torch

            if not torch.is_grad_enabled():
                return  # an evaluation forward, not the training step's
            values = [*args, kwargs.get("input_ids"), *kwargs.values()]
            first = next((v for v in values if isinstance(v, torch.Tensor)), None)
            if first is None:
                return
            integer = not (first.is_floating_point() or first.is_complex()) and first.dtype != torch.bool
            if self.integer_input is None:
                self.integer_input = integer
            if self._counting and integer:
                self.tokens += first.numel()

        model.register_forward_pre_hook(pre_hook, with_kwargs=True)

    def start(self) -> None:
        if self._counting or self._done:
            return
        self._counting = True  # tokens are read even where the counter cannot be entered
        try:
            self._counter = _guarded_flop_counter()
            self._counter.__enter__()
        except Exception as exc:  # counting is a measurement of the trial, never its failure
            self._counter, self.error = None, f"{type(exc).__name__}: {exc}"

    def stop(self, *, discard: bool = False) -> None:
        """Leave the counter (``discard``: the trial ended inside the step)."""
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


def _guarded_flop_counter() -> Any:
    """torch's FlopCounterMode (quiet) that keeps an error of its counting as ``failure``."""
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


class TrialComplete(BaseException):
    """Ends an in-process trial once measured (not an Exception: ``except Exception`` misses it)."""


class ResultWriter:
    """Writes the result file atomically, so the parent never reads half a file."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self.data: dict[str, Any] = {}

    def write(self, **fields: Any) -> None:
        """Add ``fields`` (each declared in ``RESULT_FIELDS``) to the result and write it whole."""
        unknown = unknown_result_fields(fields)
        if unknown:
            raise ValueError(f"the trial result has no fields {unknown}; declare them in RESULT_FIELDS")
        self.data.update(fields, timeline=marks())
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.data, default=str))
        tmp.replace(self.path)

    def exception(self, exc: BaseException) -> None:
        """Write what the script raised, timed: the first rank to fail is blamed, not its peers."""
        message = str(exc).splitlines()[0] if str(exc) else ""
        self.write(stage=Stage.EXCEPTION, exception={"type": type(exc).__name__, "message": message,
                                                     "at": time.time()})


def install_excepthook(writer: ResultWriter) -> None:
    previous = sys.excepthook

    def hook(exc_type: type[BaseException], exc: BaseException, tb: Any) -> None:
        if issubclass(exc_type, UnsupportedHere):
            writer.write(stage=Stage.UNSUPPORTED, reason=str(exc))
        elif not issubclass(exc_type, KeyboardInterrupt):
            writer.exception(exc)
        previous(exc_type, exc, tb)

    sys.excepthook = hook


def end_trial_process(code: int) -> NoReturn:
    """End the trial child now: the result is written."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class StepWindow:
    """The measured window of optimizer steps, timed on one DeviceClock, and the three ways a trial
    child ends (the window is full; no step came in time; the script ended first). A subclass sets
    ``clock``, ``notes``, ``workload_fingerprint``, ``model_signature``, ``fsdp`` and ``batch``."""

    clock: DeviceClock
    in_process = False
    optimizer_eps: float | None = None
    # What a framework adapter says of a script that reached no step (the plain torch adapter:
    # what it did reach), written as the result's reason and printed; None for the default reason.
    no_step_reason: Callable[[], str] | None = None

    def __init__(self, spec: TrialSpec, writer: ResultWriter) -> None:
        self.spec, self.writer = spec, writer
        self.losses: list[Any] = []  # loss tensors, read once at the end (no sync per step)
        self.loss_scale: list[float | None] = []
        self.skipped: list[bool] = []
        self.samples: list[int] = []
        self.marks: list[Any] = []  # one time mark (float or CUDA event) per step boundary
        self.pauses: list[tuple[Any, Any] | None] = []  # per step: marks around the recorder's own work
        self.begun = False  # the first optimizer step has begun
        self._perturbed = self._finished = False
        self._watchdog: NoStepWatchdog | None = None
        self._flops = StepFlops() if spec.count_flops and spec.warmup_steps >= FLOPS_STEP else None

    def _peak_memory(self) -> tuple[int | None, str]:
        return self.clock.peak_memory()

    def _underflow(self) -> tuple[list[float | None], str | None]:  # per step, and a note
        return [None] * len(self.losses), None

    def finish(self, *, complete: bool) -> None:
        """Write the result; with ``complete`` also end the process (in process: the function)."""
        if self._finished:
            return
        self._finished = True
        if self._flops is not None:
            self._flops.stop(discard=True)  # a run that ended inside the counted step counted part of it
        self.clock.sync()
        self.writer.write(**result_payload(self, complete=complete))
        if complete:
            if self.in_process:
                raise TrialComplete
            end_trial_process(0)

    def start(self) -> None:
        """Keep a short run's steps at exit (the watchdog waits for ``policy_applied``)."""
        atexit.register(self._at_exit)

    def policy_applied(self) -> None:
        """The candidate is applied: mark it, and in a child process give the script
        ``spec.first_step_timeout`` from now (not from the process's start: imports and the
        script's own set-up are no part of the candidate's cost) to its first optimizer step."""
        mark("policy_applied")
        if self.in_process:
            return  # no watchdog: the caller owns this process
        # Written at once: a child ended before its first step (a timeout, a signal, a peer
        # rank's failure) was past the candidate's application, which decides ``lost``.
        self.writer.write()
        if self._watchdog is None and not self.begun:
            self._watchdog = NoStepWatchdog(self.spec.first_step_timeout, self._no_step)
            self._watchdog.start()

    def watch_model(self, model: Any) -> None:  # for the FLOP estimate where counting fails
        if self._flops is not None:
            self._flops.watch(model)

    def _perturb(self, model: Any) -> bool:
        """The fp32 replicate's one perturbation of the initial parameters; whether it ran now."""
        if not self.spec.perturb or self._perturbed:
            return False
        self._perturbed, spec = True, self.spec
        perturb_parameters(model, perturb=spec.perturb, seed=spec.seed, draw=spec.perturb_draw)
        return True

    def _begin(self, batch: dict[str, Any]) -> None:
        """The first optimizer step begins: its batch facts written, the clock's first mark."""
        self.begun = True
        if self._watchdog is not None:
            self._watchdog.cancel()
        self.writer.write(stage=Stage.STEPPING, **batch)
        self.clock.sync()
        self.marks.append(self.clock.mark())
        if self.spec.warmup_steps == 0:
            mark("warmup_done")

    def _end_of_step(self, steps: int) -> None:
        """Mark the end of optimizer step number ``steps``; a full window ends the trial. The FLOP
        counter runs between the marks of the counted step, so its cost falls in no other step."""
        flops, warmup = self._flops, self.spec.warmup_steps
        if flops is not None and steps == FLOPS_STEP:
            flops.stop()
        if steps == warmup or (steps == 1 and warmup > 1):
            self.clock.sync()  # edge of the measured window; the first step's end, for its mark
        self.marks.append(self.clock.mark())
        if steps == 1:
            mark("first_step")
        if steps == warmup:
            mark("warmup_done")
        if flops is not None and steps == FLOPS_STEP - 1:
            flops.start()
        if steps >= warmup + self.spec.measure_steps:
            self.clock.sync()
            mark("measured_done")
            self.finish(complete=True)

    def _no_step(self) -> None:
        reason = self.no_step_reason() if self.no_step_reason is not None else None
        if reason:
            sys.stderr.write(f"mpadvise: {reason}\n")
        self.writer.write(stage=Stage.NO_STEP, **({"reason": reason} if reason else {}))
        end_trial_process(EXIT_NO_STEP)

    def _at_exit(self) -> None:
        # The script ended by itself before the measured window was full: keep what it measured.
        if self.begun and not self._finished and self.writer.data.get("stage") not in (
                Stage.EXCEPTION, Stage.UNSUPPORTED):
            self.finish(complete=False)


def result_payload(window: StepWindow, *, complete: bool) -> dict[str, Any]:
    """The result file's measurements (stage ``done``), from what ``window`` recorded."""
    peak, kind = window._peak_memory()
    losses = [float(v) for v in window.losses]
    underflow, note = window._underflow()
    flops_per_step, flops_basis = (None, None) if window._flops is None else window._flops.result()
    extra = (StepFlops.note_for(window.spec, window._flops), note)
    notes = [*window.notes, *(n for n in extra if n is not None)]
    # Seconds between consecutive marks, each less its step's pause (the recorder's own work).
    pauses = [*window.pauses, *[None] * len(window.marks)]
    step_times = [max(0.0, DeviceClock.elapsed(a, b) - (DeviceClock.elapsed(*p) if p else 0.0))
                  for a, b, p in zip(window.marks, window.marks[1:], pauses)]
    return {
        "stage": Stage.DONE,
        "complete": complete,
        "losses": [json_float(v) for v in losses],
        "step_times": step_times[: len(losses)],
        "loss_scale": window.loss_scale,
        "skipped": window.skipped,
        "underflow": underflow,
        "samples": window.samples,
        "warmup_steps": window.spec.warmup_steps,
        "peak_memory": peak,
        "memory_kind": kind,
        "notes": notes,
        "workload_fingerprint": window.workload_fingerprint,
        "model_signature": window.model_signature,
        "fsdp": window.fsdp,
        "optimizer_eps": window.optimizer_eps,
        "flops_per_step": flops_per_step,
        "flops_basis": flops_basis,
        **window.batch,
    }
