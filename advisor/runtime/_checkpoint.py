"""``AppliedPolicy.state_dict`` and ``load_state_dict``: the precision state a checkpoint keeps."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from advisor._log import get_logger
from probes import MpadviseError

if TYPE_CHECKING:
    from advisor.runtime._applied import AppliedPolicy


def precision_state(applied: AppliedPolicy) -> dict[str, Any]:
    """The loss scaler, FP8 state, accumulation position, step counts and guard of ``applied``."""
    done = applied._micro.done
    if done:
        get_logger().warning(
            f"state_dict() taken after {done} of {applied.grad_accum_steps} accumulated "
            "micro-batches: their gradients are not in a checkpoint; save after a step() that returned True"
        )
    return {
        "mode": applied.policy.mode,
        "micro_step": done,
        "optimizer_steps": applied.optimizer_steps,
        "skipped_steps": applied.skipped_steps,
        "mode_state": applied._mode.state_dict(),
        "guard": applied.guard.state_dict(),
    }


def load_precision_state(applied: AppliedPolicy, state: dict[str, Any]) -> None:
    """Restore into ``applied`` what ``precision_state`` returned; a checkpoint of another mode
    restores only the guard, with one warning."""
    if not isinstance(state, dict) or "mode" not in state:
        raise MpadviseError("load_state_dict: expected the dict returned by state_dict()")
    if "guard" in state:
        applied.guard.load_state_dict(state["guard"])
    if state["mode"] != applied.policy.mode:
        get_logger().warning(
            f"checkpoint precision state is from mode {state['mode']!r}, this run uses "
            f"{applied.policy.mode!r}: its loss-scale/FP8 state is not restored"
        )
        return
    applied._micro.done = int(state.get("micro_step", 0))
    applied.optimizer_steps = int(state.get("optimizer_steps", 0))
    applied.skipped_steps = int(state.get("skipped_steps", 0))
    applied._mode.load_state_dict(state.get("mode_state", {}))
