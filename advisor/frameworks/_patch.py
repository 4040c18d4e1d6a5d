"""How an adapter changes a framework in place: each method wrapped once, and the mode's
process-wide switches held for the life of the trial's process (the trial is the process)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from policies import Policy, create_mode

if TYPE_CHECKING:
    import torch

# Marks a function an adapter has wrapped, so that a second install wraps it no more.
PATCHED = "__mpadvise_patched__"

# The switches a policy sets (TF32) for the rest of the process: never left.
_HELD_SWITCHES = contextlib.ExitStack()


def wrap_once(owner: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Replace ``owner.name`` in place by ``make(original)``, unless it is wrapped already."""
    original = getattr(owner, name)
    if getattr(original, PATCHED, False):
        return
    wrapped = functools.wraps(original)(make(original))
    setattr(wrapped, PATCHED, True)
    setattr(owner, name, wrapped)


def hold_switches(policy: Policy, device: str | torch.device) -> None:
    """Set ``policy``'s process switches on ``device`` for the rest of the process."""
    import torch

    _HELD_SWITCHES.enter_context(create_mode(policy, torch.device(device)).process_switches())
