"""The ``mpadvise`` command line. Exit codes: 0 done, 1 error, 2 usage, 3 no stable policy
found, 130 interrupted. Only ``main`` is defined here, so that it catches a Ctrl-C before typer,
rich and the tune are imported: one line and exit 130, never a traceback."""

from __future__ import annotations

import os
import signal
import sys

from advisor._lazy import lazy_surface

_EXPORTS = {"app": "_app", "console": "_common", "err_console": "_common"}

__all__ = ["app", "console", "err_console", "main"]

EXIT_INTERRUPTED = 130


def main() -> None:
    """Console-script entry point (``mpadvise``, ``python -m advisor.cli``)."""
    try:
        from advisor.cli._app import app

        app()
    except KeyboardInterrupt:
        # A Ctrl-C before a command's own handling (while the modules load, while typer parses
        # or prints help): the command's own line, without rich, which may be half imported.
        # A second Ctrl-C must not cut the line or the exit short.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        _say_interrupted()
        raise SystemExit(EXIT_INTERRUPTED) from None
    finally:
        # The command is done and Python is exiting; a Ctrl-C now (while threads are joined, say)
        # is the same one line and exit 130, not a traceback from the interpreter's shutdown.
        # Where SIGINT was ignored (a background job) or is already handled, it stays so.
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            signal.signal(signal.SIGINT, _interrupted_while_exiting)


def _say_interrupted() -> None:
    sys.stderr.write("error: interrupted\n")
    sys.stderr.flush()


def _interrupted_while_exiting(signum: int, frame: object) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, RuntimeError, ValueError):  # closed, or interrupted mid-write
            pass
    _say_interrupted()
    os._exit(EXIT_INTERRUPTED)


__getattr__, __dir__ = lazy_surface(__name__, _EXPORTS, globals())
