"""The consoles, the ``--json`` option, and the error boundary every command shares."""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console
from rich.markup import escape

from probes import MpadviseError, UsageError

F = TypeVar("F", bound=Callable[..., Any])

console = Console()
err_console = Console(stderr=True)

JsonOption = Annotated[bool, typer.Option("--json", help="Print the result as JSON for scripts.")]
QuietOption = Annotated[bool, typer.Option(
    "--quiet", "-q", help="No progress bar and no per-trial lines: only the result (with --json, only the JSON); "
    "warnings and errors still go to stderr.")]


def fail(message: str, code: int = 1) -> typer.Exit:
    """Print one red line on stderr and return the Exit to raise."""
    # Escaped: a message quotes what it was given and install hints ("mpadvise[postgres]"),
    # whose brackets are text, not markup.
    err_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    return typer.Exit(code)


def handle_errors(fn: F) -> F:
    """Turn MpadviseError into one red line and its exit code; Ctrl-C into exit 130."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except MpadviseError as exc:
            raise fail(str(exc), exc.exit_code) from None
        except KeyboardInterrupt:
            raise fail("interrupted", 130) from None

    return wrapper  # type: ignore[return-value]


@contextmanager
def bad_value(prefix: str = "") -> Iterator[None]:
    """An MpadviseError raised inside is a bad value on the command line: a UsageError (exit 2)."""
    try:
        yield
    except MpadviseError as exc:
        raise UsageError(f"{prefix}{exc}") from None


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")


def emit(data: Any, json_output: bool, render: Callable[[Any, Console], None]) -> None:
    """``data`` as JSON for scripts, else as ``render`` shows it to a person."""
    if json_output:
        print_json(data)
    else:
        render(data, console)
