"""``AppliedPolicy.step``: backward, gradient accumulation, unscale, clip, the optimizer step,
and the guard's look at it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from advisor.runtime._setup import fsdp_policy_refusal
from advisor.runtime._split import step_samples
from advisor.runtime._switch import guard_tripped
from probes import MpadviseError

if TYPE_CHECKING:
    import torch

    from advisor.runtime._applied import AppliedPolicy


@dataclass
class MicroSteps:
    """Where the current optimizer step stands."""

    done: int = 0
    seen_batches: list[int] = field(default_factory=list)
    fsdp_checked: bool = False


def micro_step_samples(applied: AppliedPolicy) -> int | None:
    """Samples the current micro-step trains on, for goodput (see ``step_samples``)."""
    split, seen = applied._check.split, applied._micro.seen_batches
    if split is None:
        return step_samples(seen, asked=None, micro=None)
    return step_samples(seen, asked=applied._check.user_batch, micro=split.micro)


def train_step(applied: AppliedPolicy, loss: torch.Tensor, optimizer: torch.optim.Optimizer) -> bool:
    """``AppliedPolicy.step``'s work. The loss is read back (one device sync) only where the
    guard is on. False on accumulation micro-steps and skipped steps."""
    import torch

    micro = applied._micro
    if not micro.fsdp_checked:
        # By the first step every fully_shard has run; once is enough.
        micro.fsdp_checked = True
        if applied.model is not None:
            refusal = fsdp_policy_refusal(applied.model, applied.policy)
            if refusal is not None:
                raise MpadviseError(refusal)
    observer, mode, policy, guard = applied._observer, applied._mode, applied.policy, applied.guard
    if observer is not None:
        observer.before_step(applied)
    accum = applied.grad_accum_steps
    with mode.process_switches():
        mode.backward(loss / accum if accum > 1 else loss)
        micro.done += 1
        if micro.done < accum:
            if observer is not None:
                observer.after_step(applied, loss=loss, stepped=False, optimizer_step=False)
            return False
        micro.done = 0
        if policy.grad_clip_norm is not None or observer is not None:
            mode.unscale(optimizer)
        if observer is not None:
            observer.after_backward(applied, optimizer)
        if policy.grad_clip_norm is not None:
            params = [p for group in optimizer.param_groups for p in group["params"]]
            torch.nn.utils.clip_grad_norm_(params, policy.grad_clip_norm)
        value = float(loss.detach()) if guard.active else 0.0  # the loss value's one sync
        # A non-finite loss under fallback is never applied: a scaler skips it itself.
        withheld = guard.setting == "fallback" and not math.isfinite(value) and mode.loss_scale() is None
        if guard.active:  # a sample of the 16-bit weights, every few steps, to see updates lost
            guard.probe.before(applied.optimizer_steps + 1, (p for g in optimizer.param_groups for p in g["params"]))
        stepped = False if withheld else mode.optimizer_step(optimizer)
        lost = guard.probe.lost() if guard.active else None
        optimizer.zero_grad(set_to_none=True)
    applied.optimizer_steps += 1
    if not stepped:
        applied.skipped_steps += 1
    if observer is not None:
        observer.after_step(applied, loss=loss, stepped=stepped, optimizer_step=True)
    if guard.active:
        tripped = guard.observe(applied.optimizer_steps, loss=value, applied=stepped or withheld,
                                # The scale falls only on a skipped step: reading it then spares the
                                # applied steps a second device sync.
                                loss_scale=None if stepped else applied.loss_scale(), lost=lost if stepped else None)
        if tripped is not None:
            guard_tripped(applied, *tripped)
    return stepped
