"""The project's errors, which the CLI turns into one red line and an exit code."""

from __future__ import annotations


class MpadviseError(Exception):
    """An error a user can act on: what was given, what was expected, and what to do."""

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
    delayed recipe inside a compiled step): the trial ends ``unsupported``, not as a crash."""
