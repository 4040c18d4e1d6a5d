"""Switching an ``AppliedPolicy`` to another policy in place: a fallback, or the guard's move."""

from __future__ import annotations

import shlex
import sys
from typing import TYPE_CHECKING

from advisor._log import get_logger
from advisor.runtime._fallback import fallback_words, guard_fallback, safe_fallback
from advisor.runtime._guard import GuardEvent
from policies import Policy, create_mode, mode_facts, safe_default

if TYPE_CHECKING:
    import torch

    from advisor.runtime._applied import AppliedPolicy


def switch_to(applied: AppliedPolicy, policy: Policy, source: str) -> None:
    """Apply ``policy`` in place of the current one (the model not converted for it yet)."""
    # Switches entered by `with load_policy() as mp:` belong to the old mode: restore them
    # (innermost first) and enter the new mode's in the same nesting.
    stack = applied._switch_stack
    depth = len(stack)
    while stack:
        stack.pop().close()
    applied.policy, applied.source = policy, source
    applied._mode = create_mode(policy, applied.device)
    for _ in range(depth):
        applied.__enter__()


def fall_back(applied: AppliedPolicy, why: str, why_args: tuple[str, ...] | None = None) -> None:
    """Replace the policy by ``safe_fallback``, warning once; only while the model is
    unconverted. A micro-batch already handed out stays, so the global batch does not change.
    ``why_args``: this run's arguments, when the tune ran with others."""
    policy, profile, check = applied.policy, applied.profile, applied._check
    fallback = safe_fallback(policy, profile)
    using, source = fallback_words(fallback, profile)
    split = check.split
    kept = f"; keeping {split.describe()}" if split is not None and split.accum > 1 else ""
    if fallback.describe() == policy.describe():
        # The fallback is the tuned policy's own mode with nothing else tuned: the mode
        # stays, and the line says so rather than "fp32 instead of fp32".
        default = safe_default(profile).mode
        why_safe = "the safe default here" if fallback.mode == default else f"safer than the safe default {default}"
        instead = f"keeping {fallback.mode} from {applied.source}: {why_safe}"
    else:
        instead = f"{using} instead of {policy.describe()} from {applied.source}"
    if why_args is None:
        retune = "run `mpadvise tune` again"
    else:  # the arguments are what changed: the tune of this script with them
        script = sys.argv[0] if sys.argv and sys.argv[0] else "SCRIPT"
        tail = f" -- {shlex.join(why_args)}" if why_args else ""
        retune = f"`mpadvise tune {shlex.quote(script)}{tail}` tunes for these arguments"
    get_logger().warning(f"{why}; {retune}; {instead}{kept}")
    check.mismatch_reported = True
    switch_to(applied, fallback, f"{source} ({why})")


def guard_tripped(applied: AppliedPolicy, signal: str, onset: int, detail: str) -> None:
    """Act on a tripped guard: warn once, or move in place to ``guard_fallback``'s policy.
    torchao's FP8 layers are put back as Linears; Transformer Engine's hold Parameters of their
    own, which the optimizer does not, so there the event asks for a restart."""
    guard, old = applied.guard, applied.policy.mode
    target = guard_fallback(applied.policy, applied.profile)
    action = "warned"
    in_place = mode_facts(old).fp8_library is None or hasattr(applied._mode, "revert_module")
    if guard.setting == "fallback" and target is not None:
        action = "fell back" if in_place else "restart needed"
    event = GuardEvent(signal, onset, applied.optimizer_steps, old, None if target is None else target.mode,
                       action, detail)
    if action == "fell back" and target is not None:
        if applied.model is not None and mode_facts(old).fp8_library is not None:
            applied._mode.revert_module(applied.model)
        if applied.model is not None and mode_facts(old).weights != "fp32":
            upcast_in_place(applied.model, applied.optimizer)
        switch_to(applied, target, f"{target.mode}, the guard's fallback from {old} ({signal})")
        guard.rearm()
        guard.trend_on = guard_fallback(target, applied.profile) is not None
    guard.record(event)
    get_logger().warning(event.line())
    if applied.on_guard_event is not None:
        applied.on_guard_event(event)


def upcast_in_place(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """Make every parameter and its optimizer state fp32 in place (the same Parameter objects)."""
    import torch

    for parameter in model.parameters():
        if parameter.is_floating_point() and parameter.dtype != torch.float32:
            parameter.data = parameter.data.float()
            parameter.grad = None
    for state in optimizer.state.values() if optimizer is not None else ():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dim() > 0:
                state[key] = value.float()
