"""Running a trial's command as ``python [LAUNCH...] SCRIPT ARGS`` would, in this process: what
the cold launch (``_run``) and the warm server's forked children (``_warm_server``) share. The
command read as the interpreter reads it (``parse_command``), run (``run_as_python``) and ended
(``exit_forked``), with torch's import marked on the trial's timeline and its thread count set.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import runpy
import signal
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from ._proctree import _exit_as
from ._ranks import AfterImport
from ._timeline import mark

RUN_MODULE = "advisor.trial._run"
"""The module a cold trial runs under, and the warm server's entry point."""
THREADS_ENV = "MPADVISE_TRIAL_THREADS"
"""How many threads the trial's torch ops may use (``TrialSpec.threads``), where other processes
keep some of the cores busy; unset leaves torch's own choice."""


@dataclass(frozen=True)
class PythonCommand:
    """What follows ``python`` on a trial's command line, as the interpreter reads it.

    Attributes:
        target: the script's path, or the module's name when ``module`` is true.
        args: the arguments after the target (``sys.argv[1:]``).
        module: ``-m``: the target is a module run as ``__main__``.
        safe_path: ``-P``: nothing is put before ``sys.path`` (neither the script's directory
            nor the working directory).
    """

    target: str
    args: tuple[str, ...] = ()
    module: bool = False
    safe_path: bool = False


def parse_command(argv: Sequence[str]) -> PythonCommand | None:
    """Read ``[-P...] (-m MODULE | SCRIPT) [ARGS...]``; ``None`` for anything else (another
    interpreter option, ``-c``, a script on stdin, no target), which only an interpreter runs
    faithfully."""
    safe_path, rest = False, list(argv)
    while rest and rest[0] == "-P":
        safe_path, rest = True, rest[1:]
    if not rest or not rest[0]:
        return None
    if rest[0] == "-m":
        if len(rest) < 2 or not rest[1] or rest[1].startswith("-"):
            return None
        return PythonCommand(rest[1], tuple(rest[2:]), module=True, safe_path=safe_path)
    if rest[0].startswith("-"):
        return None
    return PythonCommand(rest[0], tuple(rest[1:]), safe_path=safe_path)


def cold_command(python: str, command: Sequence[str], *, nproc_per_node: int = 1) -> list[str]:
    """The command line of a cold trial: ``python -P -m advisor.trial._run COMMAND...``, which
    marks torch's import on the trial's timeline, where that runs ``COMMAND`` as the
    interpreter would; otherwise (the rank launcher, an option it does not read) ``python
    COMMAND...`` itself."""
    if nproc_per_node == 1 and parse_command(command) is not None:
        return [python, "-P", "-m", RUN_MODULE, *command]
    return [python, *command]


def exit_code(exc: SystemExit) -> int:
    """The status ``raise SystemExit(code)`` ends an interpreter with; a code that is not an
    integer is printed on stderr, and the status is 1, as the interpreter does."""
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _trimmed(tb: Any) -> Any:
    """The traceback from the script's own frames on, without this module's and runpy's, as
    the interpreter shows a script's error."""
    ours = {os.path.abspath(__file__), os.path.abspath(runpy.__file__)}
    while tb is not None and os.path.abspath(tb.tb_frame.f_code.co_filename) in ours:
        tb = tb.tb_next
    return tb


def run_as_python(command: PythonCommand) -> int:
    """Run ``command`` in this process as ``python COMMAND`` would; its exit status.

    ``sys.argv`` and ``sys.path[0]`` are the interpreter's; ``SystemExit`` gives the status; an
    uncaught exception goes to ``sys.excepthook`` (printed, and recorded by a trial's hook) and
    gives 1, or ``-SIGINT`` for a KeyboardInterrupt (the interpreter then ends by SIGINT).
    """
    sys.argv = [command.target, *command.args]  # runpy puts a module's file in argv[0]
    if not command.safe_path:
        sys.path.insert(0, os.getcwd() if command.module else os.path.dirname(os.path.abspath(command.target)))
    try:
        if command.module:
            runpy.run_module(command.target, run_name="__main__", alter_sys=True)
        elif not os.path.exists(command.target):
            print(f"{sys.executable}: can't open file {os.path.abspath(command.target)!r}: "
                  "[Errno 2] No such file or directory", file=sys.stderr)
            return 2
        else:
            runpy.run_path(command.target, run_name="__main__")
    except SystemExit as exc:
        return exit_code(exc)
    except BaseException as exc:  # whatever the script raised ends it, as under python
        sys.excepthook(type(exc), exc, _trimmed(exc.__traceback__))
        return -int(signal.SIGINT) if isinstance(exc, KeyboardInterrupt) else 1
    return 0


def exit_forked(code: int) -> NoReturn:
    """End this process as the interpreter ends after a script: the script's non-daemon
    threads joined, ``atexit`` handlers run, stdio flushed; then ``os._exit`` (so that in a
    forked child nothing of the server's stack runs on), or the signal of a negative code."""
    try:
        shutdown = getattr(threading, "_shutdown", None)  # the interpreter's own join of threads
        if shutdown is not None:
            shutdown()
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(AttributeError, OSError, ValueError):
                stream.flush()
        _exit_as(code)


def apply_trial_threads() -> None:
    """Give torch the thread count the trial was asked to use (``THREADS_ENV``), now if torch is
    imported already (a forked trial), else as soon as the script imports it; nothing when unset.

    On a CPU that other processes keep partly busy, an operation split over more threads than
    there are free cores waits at every barrier for a thread the scheduler has put aside: on 2
    cores beside one busy process, examples/mlp.py's step went from 3.8 ms to 280 ms.
    """
    value = os.environ.get(THREADS_ENV, "")
    if not value.isdigit() or int(value) < 1:
        return
    threads = int(value)

    def set_threads(torch: Any) -> None:
        torch.set_num_threads(threads)

    if "torch" in sys.modules:
        set_threads(sys.modules["torch"])
    else:
        sys.meta_path.insert(0, AfterImport("torch", set_threads))


def mark_torch_import() -> None:
    """Mark ``torch_imported`` on this trial's timeline: now if torch is imported already (a
    forked trial), else when the script's own ``import torch`` is done.

    The cold launch does not import torch itself: a script may set a variable torch reads at
    import (``OMP_NUM_THREADS``) before its ``import torch``, and one that never imports torch
    starts as fast as before.
    """
    if "torch" in sys.modules:
        mark("torch_imported")
    else:
        sys.meta_path.insert(0, AfterImport("torch", lambda module: mark("torch_imported")))


# --- when a trial starts cold --------------------------------------------------------------------
