"""Running a trial's command as ``python [LAUNCH...] SCRIPT ARGS`` would, in this process: what
the cold launch (``_run``) and the warm server's forked children (``_warm_server``) share."""

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

RUN_MODULE = "advisor.trial._run"  # the module a cold trial runs under, and the warm server's
THREADS_ENV = "MPADVISE_TRIAL_THREADS"  # torch's thread count in the trial (TrialSpec.threads)


@dataclass(frozen=True)
class PythonCommand:
    """What follows ``python`` on a trial's command line: ``[-P] (-m MODULE | SCRIPT) ARGS``."""

    target: str
    args: tuple[str, ...] = ()
    module: bool = False
    safe_path: bool = False


def parse_command(argv: Sequence[str]) -> PythonCommand | None:
    """Read ``[-P...] (-m MODULE | SCRIPT) [ARGS...]``; None for what only python runs right."""
    safe_path, rest = False, list(argv)
    while rest[:1] == ["-P"]:
        safe_path, rest = True, rest[1:]
    module = rest[:1] == ["-m"]
    if module:
        rest = rest[1:]
    if not rest or not rest[0] or rest[0].startswith("-"):
        return None
    return PythonCommand(rest[0], tuple(rest[1:]), module=module, safe_path=safe_path)


def cold_command(python: str, command: Sequence[str], *, nproc_per_node: int = 1) -> list[str]:
    """The command line of a cold trial: ``python -P -m advisor.trial._run COMMAND...`` where
    that runs ``COMMAND`` as the interpreter would, else ``python COMMAND...``."""
    if nproc_per_node == 1 and parse_command(command) is not None:
        return [python, "-P", "-m", RUN_MODULE, *command]
    return [python, *command]


def exit_code(exc: SystemExit) -> int:
    """The status ``raise SystemExit(code)`` ends an interpreter with (a non-integer is printed)."""
    if exc.code is None or isinstance(exc.code, int):
        return exc.code or 0
    print(exc.code, file=sys.stderr)
    return 1


def run_as_python(command: PythonCommand) -> int:
    """Run ``command`` here as ``python COMMAND`` would; its exit status (KeyboardInterrupt: -2)."""
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
        tb, ours = exc.__traceback__, {os.path.abspath(__file__), os.path.abspath(runpy.__file__)}
        while tb is not None and os.path.abspath(tb.tb_frame.f_code.co_filename) in ours:
            tb = tb.tb_next  # the traceback from the script's own frames on, as python shows it
        sys.excepthook(type(exc), exc, tb)
        return -int(signal.SIGINT) if isinstance(exc, KeyboardInterrupt) else 1
    return 0


def exit_forked(code: int) -> NoReturn:
    """End this process as the interpreter ends after a script (threads joined, ``atexit``,
    stdio flushed), then ``os._exit``: in a forked child nothing of the server's stack runs on."""
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


def prepare_torch() -> None:
    """Mark ``torch_imported`` on this trial's timeline and give torch the trial's thread count
    (``THREADS_ENV``), now or once the script imports torch.

    The cold launch does not import torch itself: a script may set a variable torch reads at
    import (``OMP_NUM_THREADS``) before its ``import torch``. The thread count: on a CPU that
    other processes keep partly busy, an operation split over more threads than there are free
    cores waits at every barrier for a thread the scheduler has put aside: on 2 cores beside one
    busy process, examples/mlp.py's step went from 3.8 ms to 280 ms."""
    threads = os.environ.get(THREADS_ENV, "")

    def then(torch: Any) -> None:
        mark("torch_imported")
        if threads.isdigit() and int(threads) >= 1:
            torch.set_num_threads(int(threads))

    if "torch" in sys.modules:
        then(sys.modules["torch"])
    else:
        sys.meta_path.insert(0, AfterImport("torch", then))
