"""What applies in place of a policy that does not fit this run, or that the guard left."""

from __future__ import annotations

from typing import TYPE_CHECKING

from policies import Policy, mode_classes, mode_facts, safe_default, safety_rank, supported_modes

if TYPE_CHECKING:
    from probes import HardwareProfile


def safe_fallback(tuned: Policy, profile: HardwareProfile) -> Policy:
    """What applies in place of a tuned policy that does not fit this run: the safer of the
    hardware's safe default and the tuned mode (by ``safety_rank``), where it runs here.

    A workload tuned to fp32 or tf32 is one whose 16-bit modes stalled or hit a loss floor:
    falling back to bf16-mixed because the script changed (even by a comment) would apply what
    it was tuned away from. Only the mode is kept, not what was measured on the old workload;
    modes safer than a safe default leave the model as it is, so switching works until setup()."""
    default = safe_default(profile)
    support = supported_modes(profile).get(tuned.mode)
    if safety_rank(tuned.mode) < safety_rank(default.mode) and support is not None and support.supported:
        return Policy(mode=tuned.mode)
    return default


def fallback_words(fallback: Policy, profile: HardwareProfile) -> tuple[str, str]:
    """How a warning names ``safe_fallback``'s answer (``"using the safe default bf16-mixed"``),
    and the source it is logged with (``"safe default for NVIDIA A100"``)."""
    default = safe_default(profile)
    if fallback.mode == default.mode:
        return f"using the safe default {default.mode}", f"safe default for {profile.name}"
    return (
        f"using {fallback.mode}, the tuned mode, safer than the safe default {default.mode}",
        f"{fallback.mode}, the tuned mode, safer than the safe default for {profile.name}",
    )


def guard_fallback(policy: Policy, profile: HardwareProfile) -> Policy | None:
    """The next safer policy the guard moves a run to, by the modes' facts, or ``None`` from full
    precision: FP8 and fp16-mixed to bf16-mixed; pure 16-bit to the same dtype mixed; any other
    16-bit autocast to full precision; a step the hardware lacks is passed over, down to the
    safest mode. Only the mode and the batch split carry over, not a loss scale measured for the
    old mode."""
    facts = mode_facts(policy.mode)
    supported = {name for name, support in supported_modes(profile).items() if support.supported}
    classes = [cls for cls in mode_classes() if cls.name in supported]
    safest = min(classes, key=lambda cls: cls.safety_rank)

    def mixed(family: str) -> str | None:
        for cls in classes:
            f = cls.facts()
            if f.autocast == family and f.weights == "fp32" and f.fp8_library is None:
                return cls.name
        return None

    if facts.weights != "fp32":
        target = mixed(facts.weights) or safest.name
    elif facts.fp8_library is not None or facts.autocast == "fp16":
        target = mixed("bf16") or safest.name
    elif facts.autocast is not None:
        target = safest.name
    else:
        return None
    if target == policy.mode:
        return None
    return Policy(mode=target, micro_batch_size=policy.micro_batch_size, grad_accum_steps=policy.grad_accum_steps)
