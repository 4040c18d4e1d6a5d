"""The project's errors: one domain exception type that the CLI turns into a red line and an
exit code, and its usage-error kind. Everything imports them from here; this module imports
nothing of the project."""

from __future__ import annotations


class MpadviseError(Exception):
    """An error a user can act on: says what was given, what was expected, and what to do.

    The CLI prints ``str(error)`` on one line and exits with ``exit_code``.
    """

    exit_code: int = 1

    def __init__(self, message: str, *, exit_code: int | None = None) -> None:
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code


class UsageError(MpadviseError):
    """Bad command-line input (exit code 2)."""

    exit_code = 2


class UnsupportedHere(MpadviseError):
    """A policy that cannot run here, found only once training began (Transformer Engine's
    delayed recipe inside a ``torch.compile``'d step): a trial ends ``unsupported`` with this
    message, as it does for a mode the hardware lacks, not as a crash."""
