"""When a trial starts cold, in a fresh interpreter, instead of forked from the warm server, and
what a warm server preloads for a framework."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Mapping, Sequence

from ._python_command import parse_command

WARM_ENV = "MPADVISE_WARM_TRIALS"  # 0 starts every trial in a fresh interpreter
# What a trial's environment may set differently from the server's: the project's own variables,
# never read at import, and the shell's record of the working directory, which the request carries.
PER_TRIAL_PREFIXES: tuple[str, ...] = ("MPADVISE_",)
PER_TRIAL_NAMES: frozenset[str] = frozenset({"PWD", "OLDPWD"})


def is_per_trial(name: str) -> bool:
    return name in PER_TRIAL_NAMES or name.startswith(PER_TRIAL_PREFIXES)


def environment_difference(server: Mapping[str, str], trial: Mapping[str, str]) -> list[str]:
    """The variables, other than per-trial ones, that differ between the two environments; sorted."""
    names = set(server) | set(trial)
    return sorted(n for n in names if not is_per_trial(n) and server.get(n) != trial.get(n))


def warm_switched_off(environ: Mapping[str, str]) -> bool:
    return environ.get(WARM_ENV, "").strip().lower() in ("0", "false", "no", "off")


def cold_reason(command: Sequence[str], *, environ: Mapping[str, str], nproc_per_node: int = 1,
                platform: str = sys.platform, can_fork: bool = hasattr(os, "fork")) -> str | None:
    """Why a trial must start in a fresh interpreter, whatever the server; ``None`` when it may
    be forked."""
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
    differ = environment_difference(server, trial)
    if not differ:
        return None
    shown = ", ".join(differ[:5]) + (f" and {len(differ) - 5} more" if len(differ) > 5 else "")
    return (f"the trial's environment differs from the warm server's in {shown}, which torch or a "
            "library may have read at import")


def server_refusal(threads: int, cuda_initialized: bool) -> str | None:
    """Why the server must not fork; ``None`` when it may."""
    if cuda_initialized:
        return "CUDA is initialised in the warm server, and a forked child cannot use it"
    if threads != 1:
        return f"the warm server runs {threads} threads, and a fork copies only one"
    return None


def thread_count() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


def framework_preload(launch: Sequence[str]) -> tuple[str, ...]:
    """What a warm server imports for trials launched by ``launch``: for a framework boot
    (``-P -m PACKAGE._boot FRAMEWORK``), its package and ``PACKAGE:FRAMEWORK`` (its library)."""
    command = parse_command([*launch, "script.py"])
    if command is None or not command.module or not command.target.endswith("._boot") or len(command.args) < 2:
        return ()
    package = command.target.rpartition(".")[0]
    return (package, f"{package}:{command.args[0]}")
