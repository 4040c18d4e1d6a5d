"""The running script's path and arguments, and how a warning names what changed in them."""

from __future__ import annotations

import shlex
import sys
from collections.abc import Sequence
from dataclasses import replace

from advisor import _paths
from advisor.runtime._workload import WorkloadMismatch
from policies import Difference


def _script_path() -> str | None:
    script = _paths.current_script()
    return str(script) if script is not None else None


def _script_args() -> tuple[str, ...]:
    """The running script's command-line arguments (none in a REPL or notebook)."""
    return tuple(sys.argv[1:]) if _paths.current_script() is not None else ()


SCRIPT_ARGS = "script arguments"
"""The fact a :class:`Difference` names when a tune recorded other arguments than this run's."""


def _shown_args(args: Sequence[str]) -> str:
    """``"--epochs 1"``, or ``"(none)"``."""
    return shlex.join(args) if args else "(none)"


def _with_args(mismatch: WorkloadMismatch | None, tuned: Sequence[str], here: Sequence[str], *,
               optimizer_now: str = "", world_size_now: int = 1) -> WorkloadMismatch:
    """``mismatch`` (``None``: nothing else changed) with the arguments' difference added."""
    args = Difference(SCRIPT_ARGS, _shown_args(tuned), _shown_args(here))
    if mismatch is None:
        return WorkloadMismatch((args,), (), optimizer_now, tuple(here), world_size_now)
    # "script arguments" is no longer a fact the tune did not record.
    unrecorded = tuple(name for name in mismatch.unrecorded if name != SCRIPT_ARGS)
    return replace(mismatch, differences=(*mismatch.differences, args), unrecorded=unrecorded, args_now=tuple(here))


def _args_now(mismatch: WorkloadMismatch) -> tuple[str, ...] | None:
    """This run's arguments, when ``mismatch`` names them as changed since tuning."""
    for difference in mismatch.differences:
        if difference.what == SCRIPT_ARGS:
            return _script_args()
    return None


def _retune_hint(args: tuple[str, ...] | None) -> str:
    """What to run: the tune of this script with this run's ``args``, when they are what
    changed; otherwise ``mpadvise tune`` again."""
    if args is None:
        return "run `mpadvise tune` again"
    script = sys.argv[0] if sys.argv and sys.argv[0] else "SCRIPT"
    tail = f" -- {shlex.join(args)}" if args else ""
    return f"`mpadvise tune {shlex.quote(script)}{tail}` tunes for these arguments"
