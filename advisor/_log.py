"""The ``mpadvise`` logger: one line per event on stderr, prefixed ``mpadvise:``."""

from __future__ import annotations

import logging
import os
import sys

LOGGER_NAME = "mpadvise"


def get_logger() -> logging.Logger:
    """The project logger, with a stderr handler attached on first use, so a script shows its
    policy even when it configures no logging; ``MPADVISE_QUIET=1`` keeps only warnings."""
    logger = logging.getLogger(LOGGER_NAME)
    if not getattr(logger, "_mpadvise_configured", False):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("mpadvise: %(message)s"))
        logger.addHandler(handler)
        quiet = os.environ.get("MPADVISE_QUIET", "").lower() not in ("", "0", "false", "no")
        logger.setLevel(logging.WARNING if quiet else logging.INFO)
        logger.propagate = False
        logger._mpadvise_configured = True  # type: ignore[attr-defined]
    return logger
