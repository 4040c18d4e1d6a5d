"""What applies in place of a policy that does not fit this run, or that the guard left."""

from __future__ import annotations

from typing import TYPE_CHECKING

from policies import Policy, safe_default, safety_rank, supported_modes

if TYPE_CHECKING:
    from probes import HardwareProfile


def safe_fallback(tuned: Policy, profile: HardwareProfile) -> Policy:
    """What applies in place of a tuned policy that does not fit this run: the safer of the
    hardware's safe default and the tuned mode, by ``policies.safety_rank``.

    A tune leaves the safe default only for a faster mode that stays stable, or for a safer
    one when the default failed: a workload tuned to fp32 or tf32 is one whose 16-bit modes hit
    a loss floor or stalled. Falling back from it to bf16-mixed (on bf16 hardware) because the
    script changed, even by a comment, would apply exactly the mode it was tuned away from. So
    a tuned mode safer than the default is kept, where it runs here. Only the mode: the
    micro-batch, loss scale and ``[tuned_on]`` were measured on the workload that no longer
    fits. Modes safer than a safe default are full precision or mixed ones, which leave the
    model as it is, so the switch is possible until ``setup()`` converted it.

    Args:
        tuned: the tuned policy that does not apply.
        profile: the hardware this run trains on.

    Returns:
        ``Policy(mode=tuned.mode)`` when that mode is safer than the safe default and runs
        here; otherwise the safe default.
    """
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
