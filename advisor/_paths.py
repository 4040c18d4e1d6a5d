"""Where mpadvise keeps its files: pure path logic that creates nothing."""

from __future__ import annotations

import os
from pathlib import Path

DATABASE_NAME = "mpadvise.db"


def cache_dir() -> Path:
    """The directory that holds the cache database (and, later, the daemon's files).

    ``MPADVISE_HOME`` wins when set, so tests, CI and shared machines can point every command
    at one place; otherwise the XDG base-directory rule applies (``$XDG_CACHE_HOME/mpadvise``,
    falling back to ``~/.cache/mpadvise``). Empty variables count as unset, as the XDG
    specification asks.

    Returns:
        The directory path, which may not exist yet.
    """
    home = os.environ.get("MPADVISE_HOME")
    if home:
        return Path(home).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    # The XDG spec says a relative XDG_CACHE_HOME is invalid and must be ignored.
    if xdg and os.path.isabs(xdg):
        return Path(xdg) / "mpadvise"
    return Path.home() / ".cache" / "mpadvise"


def database_path() -> Path:
    """The SQLite database that stores hardware profiles, recommendations, trials and jobs.

    Returns:
        ``cache_dir() / "mpadvise.db"``; neither the file nor its directory is created here.
    """
    return cache_dir() / DATABASE_NAME
