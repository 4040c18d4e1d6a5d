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


# ---- the slow set ------------------------------------------------------------------------------
# `make test` (CI) leaves out the slow set: the tests marked `@pytest.mark.slow` where they are
# written, and those listed in tests/slow.txt (marked here); `make test-all` runs them too. Each
# line of the list names a test that times real trials on real CPUs for tens of seconds, or a
# framework suite's whole tune, and the fast test that keeps its behaviour covered. A listed test
# that no longer exists fails the collection, so the list cannot rot.
_SLOW_LIST = os.path.join(os.path.dirname(__file__), "slow.txt")


def _slow_ids() -> set[str]:
    with open(_SLOW_LIST, encoding="utf-8") as listed:
        return {line.split("#")[0].strip() for line in listed if line.split("#")[0].strip()}


@pytest.hookimpl(tryfirst=True)  # before `-m "not slow"` deselects by the marks set here
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    slow = _slow_ids()
    collected = {item.nodeid for item in items}
    for item in items:
        if item.nodeid in slow:
            item.add_marker(pytest.mark.slow)
    # Where whole files were collected (no test ids, no -k), an entry of such a file that was
    # not collected is stale: renamed or removed.
    if config.getoption("keyword") or any("::" in arg for arg in config.args):
        return
    files = {nodeid.split("::")[0] for nodeid in collected}
    root = str(config.rootpath)
    stale = sorted(t for t in slow if not os.path.exists(os.path.join(root, t.split("::")[0]))
                   or (t.split("::")[0] in files and t not in collected))
    if stale:
        raise pytest.UsageError(f"tests/slow.txt names tests that do not exist: {', '.join(stale)}")
