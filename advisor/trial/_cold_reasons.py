"""When a trial starts cold, in a fresh interpreter, instead of forked from the warm server:
pure decisions on the command, the environment and the server's state (``cold_reason``,
``environment_reason``, ``server_refusal``), and what a warm server preloads for a framework
(``framework_preload``).
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Mapping, Sequence

from ._python_command import parse_command

WARM_ENV = "MPADVISE_WARM_TRIALS"
"""``0`` starts every trial in a fresh interpreter (the cold launch), as before warm trials."""
PER_TRIAL_PREFIXES: tuple[str, ...] = ("MPADVISE_",)
"""Variables a trial's environment may set differently from the server's: the project's own,
which it reads when a trial uses them, never at import."""
PER_TRIAL_NAMES: frozenset[str] = frozenset({"PWD", "OLDPWD"})
"""More such variables: a shell's record of the working directory, which the request carries."""


def is_per_trial(name: str) -> bool:
    """Whether a variable may differ between a trial's environment and the warm server's."""
    return name in PER_TRIAL_NAMES or name.startswith(PER_TRIAL_PREFIXES)


def environment_difference(server: Mapping[str, str], trial: Mapping[str, str]) -> list[str]:
    """The variables, other than per-trial ones, that the trial's environment sets differently
    from the server's start-up environment (set in one only, or to another value); sorted."""
    names = set(server) | set(trial)
    return sorted(n for n in names if not is_per_trial(n) and server.get(n) != trial.get(n))


def warm_switched_off(environ: Mapping[str, str]) -> bool:
    """Whether ``MPADVISE_WARM_TRIALS`` asks for cold trials (``0``, ``false``, ``no``, ``off``)."""
    return environ.get(WARM_ENV, "").strip().lower() in ("0", "false", "no", "off")


def cold_reason(
    command: Sequence[str],
    *,
    environ: Mapping[str, str],
    nproc_per_node: int = 1,
    platform: str = sys.platform,
    can_fork: bool = hasattr(os, "fork"),
) -> str | None:
    """Why a trial must start in a fresh interpreter, whatever the server; ``None`` when it may
    be forked.

    Args:
        command: what follows the interpreter on the trial's command line.
        environ: the environment the parent runs in, and the trial's (either may hold the switch).
        nproc_per_node: processes of the trial; the rank launcher (``_ranks``) starts its own.
        platform, can_fork: ``sys.platform`` and whether ``os.fork`` exists; a test passes others.
    """
    if warm_switched_off(environ):
        return f"{WARM_ENV}={environ.get(WARM_ENV)} starts every trial cold"
    if not platform.startswith("linux") or not can_fork:
        return f"warm trials need Linux's fork and child subreaper; this is {platform}"
    if nproc_per_node > 1:
        return (f"a trial of {nproc_per_node} processes starts its ranks from its own launcher (in torchrun's "
                "place), which starts each one itself")
    if parse_command(command) is None:
        return f"the command {list(command)[:4]} is not one a forked interpreter runs as python would"
    return None


def environment_reason(server: Mapping[str, str], trial: Mapping[str, str]) -> str | None:
    """Why a trial in environment ``trial`` cannot be forked from a server started in ``server``."""
    differ = environment_difference(server, trial)
    if not differ:
        return None
    shown = ", ".join(differ[:5]) + (f" and {len(differ) - 5} more" if len(differ) > 5 else "")
    return (f"the trial's environment differs from the warm server's in {shown}, which torch or a "
            "library may have read at import")


def server_refusal(threads: int, cuda_initialized: bool) -> str | None:
    """Why the server must not fork (a fork copies one thread and a CUDA context that the child
    cannot use); ``None`` when it may."""
    if cuda_initialized:
        return "CUDA is initialised in the warm server, and a forked child cannot use it"
    if threads != 1:
        return f"the warm server runs {threads} threads, and a fork copies only one"
    return None


def thread_count() -> int:
    """Threads of this process, native ones included (``/proc/self/task``)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


def framework_preload(launch: Sequence[str]) -> tuple[str, ...]:
    """What a warm server imports for trials launched by ``launch``: for a framework boot
    (``-P -m PACKAGE._boot FRAMEWORK``), its package and, as ``PACKAGE:FRAMEWORK``, the modules
    that framework is detected by (its library: Lightning, transformers, accelerate)."""
    command = parse_command([*launch, "script.py"])
    if command is None or not command.module or not command.target.endswith("._boot") or len(command.args) < 2:
        return ()
    package = command.target.rpartition(".")[0]
    return (package, f"{package}:{command.args[0]}")


# --- the parent's side -------------------------------------------------------------------------
