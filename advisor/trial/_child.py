"""Inside a trial's child process: what ``load_policy()`` does when a candidate is injected, one
trial run in this process (``run_in_process``), and the two recorders of its steps.

``TrialRecorder`` is fed by the loop API's ``step()``. Its own work inside a step runs between
two time marks, cut out of the step's time: a trial times the user's step, not its measuring. It
samples what fp16 may lose of the optimizer: the gradients' underflow and the smallest ``eps``.
``FrameworkRecorder`` is fed by a framework adapter's hooks."""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from advisor.runtime import AppliedPolicy, StepObserver, Workload
from policies import Policy, PolicyError, mode_facts, supported_modes
from probes import HardwareProfile, UnsupportedHere

from ._device import DeviceClock, TrialDevice
from ._schema import EXIT_UNSUPPORTED, RANK_ENV, TRIAL_SPEC_ENV, Stage, TrialSpec, rank_result_path
from ._stacks import register_stack_dump
from ._step_window import (
    ResultWriter,
    StepWindow,
    TrialComplete,
    end_trial_process,
    install_excepthook,
    seed_everything,
)
from ._timeline import clear, mark

if TYPE_CHECKING:
    import torch


# fp16's smallest subnormal: a gradient whose |g| * loss_scale is below it rounds to zero in an
# fp16 backward (Micikevicius et al. 2018 measured about 5% of weight gradients there unscaled).
FP16_MIN_SUBNORMAL = 2.0**-24
FP16_MIN_NORMAL = 2.0**-14  # below it fp16 holds fewer significant bits
# 2^16 sampled values put the sampling error of a fraction near 5% below 0.1 percentage points.
UNDERFLOW_SAMPLE = 2**16
# Sampled on every 4th optimizer step (from step 0): it moves with the loss scale, which changes
# over tens of steps, and sampling costs device work.
UNDERFLOW_EVERY = 4


def optimizer_eps(optimizer: Any) -> float | None:
    """The smallest ``eps`` among the optimizer's unfused param groups (a ``fused`` one computes
    in fp32), or ``None``: an eps that rounds to zero in fp16 makes pure fp16's Adam divide by 0."""
    values = [group["eps"] for group in getattr(optimizer, "param_groups", ())
              if isinstance(group.get("eps"), (int, float)) and not isinstance(group.get("eps"), bool)
              and not group.get("fused")]
    return float(min(values)) if values else None


def gradients(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's gradients; under FSDP2 this rank's shards (not whole, gathered DTensors)."""
    import torch

    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
    return [g for g in local if g.layout == torch.strided]  # sparse gradients have no flat view


def underflow_counts(grads: list[torch.Tensor], *, scale: float,
                     budget: int = UNDERFLOW_SAMPLE) -> torch.Tensor | None:
    """Count sampled gradient values that an fp16 backward lost, or would lose, to underflow:
    ``[already flushed, would flush, counted]`` as a tensor on the gradients' device (no host
    sync; read it when the trial ends), or ``None`` without gradients.

    The sample takes every ``stride``-th value of all gradients laid end to end; non-finite
    values are left out. "Would flush": nonzero, but below 2^-24 once scaled (a gradient held
    in more precision than fp16). "Already flushed": zeros, which are also what fp32 computes
    for a dead ReLU or an embedding row not in the batch; so a tensor's zeros count as flushed
    only where most of its nonzero values lie below 2^-14 (at fp16's edge), or where it has no
    nonzero value and no tensor shows values in fp16's normal range (the whole gradient
    flushed). Both errors of this rule stay below the underflow limit's 5% where it matters."""
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
    """One line on both kinds of underflow over the sampled steps, or None when none was lost."""
    flushed, would_flush, counted = (sum(c[i] for c in counts) for i in range(3))
    if not counted or not flushed + would_flush:
        return None
    return (
        f"fp16 gradient underflow over {len(counts)} sampled steps: {flushed / counted:.1%} of the sampled "
        f"gradient values had already flushed to zero, {would_flush / counted:.1%} would flush at the loss scale in use"
    )


def _fraction(counts: torch.Tensor) -> float | None:
    flushed, would_flush, counted = (int(v) for v in counts.tolist())
    return (flushed + would_flush) / counted if counted else None


class TrialRecorder(StepObserver, StepWindow):
    def __init__(self, spec: TrialSpec, writer: ResultWriter, *, in_process: bool = False) -> None:
        StepWindow.__init__(self, spec, writer)
        self.in_process = in_process
        self.applied: AppliedPolicy | None = None
        self.underflow: list[Any] = []  # [flushed, nonzero] count tensors, read once at the end
        self._in_step: dict[str, Any] = {}  # what after_backward measured, until after_step keeps it
        self._micro_losses: list[Any] = []
        self._micro_samples = 0
        self.clock = DeviceClock(None)
        self._device: TrialDevice | None = None  # from attach(): the device made current, its memory

    def attach(self, applied: AppliedPolicy) -> None:
        self.applied = applied
        self._device = TrialDevice(applied.device, memory_limit=self.spec.memory_limit, in_process=self.in_process)
        self.clock = self._device.clock
        if not self.in_process:  # in process, the caller owns the process and its exit
            self.start()
        self.policy_applied()

    def after_setup(self, applied: AppliedPolicy, model: Any) -> None:
        # After the mode converted the model (fp32 leaves it as it is), before any step used it.
        self._perturb(model)
        self.watch_model(model)

    def before_step(self, applied: AppliedPolicy) -> None:
        if not self.begun:
            self._begin(batch_facts(applied))

    def after_backward(self, applied: AppliedPolicy, optimizer: torch.optim.Optimizer) -> None:
        # The recorder's own work, between two marks cut out of the step's time. Here, not after
        # the optimizer step: a loss-scaling mode syncs the device just after this point anyway
        # (to read the overflow flag), so reading the scale and sampling add no wait of their own.
        start = self.clock.mark()
        if not self.losses:
            self.optimizer_eps = optimizer_eps(optimizer)
        scale = applied.loss_scale()
        counts = None
        facts = mode_facts(applied.mode)
        if "fp16" in (facts.autocast, facts.weights) and len(self.losses) % UNDERFLOW_EVERY == 0:
            counts = underflow_counts(gradients(optimizer), scale=scale or 1.0)
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

    def _peak_memory(self) -> tuple[int | None, str]:
        return self.clock.peak_memory() if self._device is None else self._device.peak_memory()

    def _underflow(self) -> tuple[list[float | None], str | None]:
        sampled = [[int(v) for v in c.tolist()] for c in self.underflow if c is not None]
        return [None if c is None else _fraction(c) for c in self.underflow], underflow_note(sampled)

    # What the result says of the workload, read from the applied policy (attached before any step).
    notes = property(lambda self: list(self.applied.notes))
    workload_fingerprint = property(lambda self: self.applied.workload_fingerprint)
    model_signature = property(lambda self: self.applied.model_signature)
    fsdp = property(lambda self: self.applied.fsdp)
    batch = property(lambda self: batch_facts(self.applied))

    def close(self) -> None:
        """Stop the RSS sampler and a FLOP count in progress, and give back the current device."""
        if self._flops is not None:
            self._flops.stop(discard=True)  # the training function raised inside the counted step
        if self._device is not None:
            self._device.close()


def batch_facts(applied: AppliedPolicy) -> dict[str, Any]:
    return {"user_batch": applied.user_batch, "micro_batch": applied.policy.micro_batch_size or applied.user_batch,
            "grad_accum_steps": applied.grad_accum_steps, "global_batch": applied.global_batch,
            "device": str(applied.device)}


class FrameworkRecorder(StepWindow):
    def __init__(self, spec: TrialSpec, writer: ResultWriter, *, device: Any = "cpu") -> None:
        super().__init__(spec, writer)
        self.set_device(device)
        self.notes: list[str] = []
        self.batch: dict[str, Any] = {}
        self.workload_fingerprint: str | None = None
        self.model_signature: str | None = None
        self.fsdp = False  # asked for through mp.fsdp_mixed_precision(), which a framework script never calls

    def set_device(self, device: Any) -> None:
        """The device the framework trains on: CUDA events time its steps, else the host clock."""
        self.device = str(device)
        self.clock = DeviceClock(self.device if self.device.startswith("cuda") else None)

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)

    def begin(self, *, user_batch: int | None, micro_batch: int | None, grad_accum_steps: int | None) -> None:
        """The first batch starts: the clock's first mark (later calls do nothing)."""
        if self.begun:
            return
        mark("policy_applied")  # unless the adapter saw the object built: it runs the candidate now
        accum = grad_accum_steps or 1
        global_batch = None if micro_batch is None else micro_batch * accum
        self.batch = {"user_batch": user_batch, "micro_batch": micro_batch, "grad_accum_steps": accum,
                      "global_batch": global_batch, "device": self.device}
        self._begin(self.batch)

    def perturb(self, model: Any) -> None:
        """The fp32 replicate's one perturbation, before the first training forward."""
        if model is not None and hasattr(model, "parameters") and self._perturb(model):
            self.note(f"fp32 replicate: initial parameters perturbed once by a {self.spec.perturb} rounding")

    def workload(self, model: Any, optimizer: Any | None, *, global_batch: int | None) -> None:
        """Fingerprint the workload (the script's model, optimizer and global batch), once."""
        if self.workload_fingerprint is not None:
            return
        script = sys.argv[0] if sys.argv and sys.argv[0] else None
        work = Workload.of(model, optimizer, global_batch=global_batch, script=script, args=sys.argv[1:])
        self.workload_fingerprint = work.fingerprint()
        self.model_signature = work.model
        self.optimizer_eps = optimizer_eps(optimizer)

    def step(self, *, loss: Any, loss_scale: float | None = None, skipped: bool = False,
             samples: int | None = None) -> None:
        """One optimizer step ended: its loss averaged over its micro-batches (not divided by the
        accumulation count), the scale its backward ran with, whether the scaler skipped it."""
        if self._finished or not self.begun:
            return
        self.losses.append(loss.detach().clone() if hasattr(loss, "detach") else loss)
        self.loss_scale.append(loss_scale)
        self.skipped.append(bool(skipped))
        self.samples.append(int(samples or self.batch.get("global_batch") or 0))
        self._end_of_step(len(self.losses))


def recorder_for(spec: TrialSpec) -> FrameworkRecorder:
    writer = ResultWriter(spec.result_path)
    writer.write(stage=Stage.LOADED, pid=os.getpid())
    return FrameworkRecorder(spec, writer, device=spec.device or "cpu")


_CHILD_APPLIED: AppliedPolicy | None = None


def spec_from_env() -> TrialSpec | None:
    """The trial spec injected into this process (a rank's, with its own result file), or None."""
    path = os.environ.get(TRIAL_SPEC_ENV)
    if not path:
        return None
    spec = TrialSpec.from_json(Path(path).read_text())
    if spec.nproc_per_node > 1:
        rank = os.environ.get(RANK_ENV, "0")
        spec = dataclasses.replace(spec, result_path=rank_result_path(spec.result_path, int(rank) if rank.isdigit() else 0))
    register_stack_dump(spec.result_path)
    return spec


def applied_for_trial(spec: TrialSpec, *, profile: HardwareProfile, device: str | None) -> AppliedPolicy:
    """The injected candidate applied, its recorder attached; unsupported: exit EXIT_UNSUPPORTED."""
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


def trial_candidate(spec: TrialSpec, writer: ResultWriter, *, profile: HardwareProfile,
                    refusal: Callable[[Policy], str | None] | None = None) -> Policy | None:
    """The injected candidate, or None (written ``unsupported``) when it, or ``refusal`` (a
    framework's limits, judged before the hardware's support), says it cannot run here."""
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


def _build(spec: TrialSpec, writer: ResultWriter, *, profile: HardwareProfile, device: str | None,
           in_process: bool) -> AppliedPolicy | None:
    policy = trial_candidate(spec, writer, profile=profile)
    if policy is None:
        return None
    seed_everything(spec.seed)
    recorder = TrialRecorder(spec, writer, in_process=in_process)
    applied = AppliedPolicy(policy, profile=profile, source=f"trial {spec.label or policy.mode}", device=device, observer=recorder)
    recorder.attach(applied)
    return applied


def run_in_process(train_fn: Any, spec: TrialSpec, *, profile: HardwareProfile) -> tuple[dict[str, Any], str | None]:
    """Run ``train_fn(mp)`` as one trial in this process: the result data, and any error text."""
    import gc
    import traceback

    # An earlier trial's model and data may still be held by reference cycles (the frames of
    # the exception that ended it): free them, or they count in this trial's memory.
    gc.collect()
    clear()  # this process ran earlier trials: their marks are not this one's
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
        writer.exception(exc)
        error = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    else:
        if recorder.begun:
            recorder.finish(complete=False)
    finally:
        recorder.close()
    return writer.data, error
