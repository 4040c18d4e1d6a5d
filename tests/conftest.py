"""Fixtures shared by the unit and integration tests."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator

import pytest

# The CLI's module-level rich consoles fix their width at import from COLUMNS when it is set
# (a shell's COLUMNS=80, or pytest-xdist's workers, which set it), and a later COLUMNS that a
# test passes to the CLI runner is then ignored. Tests choose their own widths.
os.environ.pop("COLUMNS", None)
os.environ.pop("LINES", None)


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def warnings() -> Iterator[list[str]]:
    """Warnings on the mpadvise logger (which does not propagate once configured)."""
    logger = logging.getLogger("mpadvise")
    handler = _Collect()
    logger.addHandler(handler)
    try:
        yield handler.messages
    finally:
        logger.removeHandler(handler)
