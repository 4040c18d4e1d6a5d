"""Fixtures shared by the unit and integration tests."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest


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
