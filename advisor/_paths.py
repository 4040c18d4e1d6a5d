"""Where mpadvise keeps its files and finds the script: pure path logic that creates nothing."""

from __future__ import annotations

import os
import sys
from pathlib import Path


def config_path_for(script: str | os.PathLike[str]) -> Path:
    """``train.py`` -> ``train.mpadvise.toml`` beside it."""
    script = Path(script)
    return script.with_name(script.stem + ".mpadvise.toml")


def current_script() -> Path | None:
    """The script this process runs (``__main__.__file__``), or ``None`` in a REPL/notebook."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None) or (sys.argv[0] if sys.argv and sys.argv[0] else None)
    return None if not path or path == "-c" else Path(path).resolve()


def cache_dir() -> Path:
    """The directory of the cache database and the daemon's files (which may not exist yet):
    ``MPADVISE_HOME``, else ``$XDG_CACHE_HOME/mpadvise``, else ``~/.cache/mpadvise``."""
    home = os.environ.get("MPADVISE_HOME")
    if home:
        return Path(home).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    # The XDG spec says a relative XDG_CACHE_HOME is invalid and must be ignored.
    if xdg and os.path.isabs(xdg):
        return Path(xdg) / "mpadvise"
    return Path.home() / ".cache" / "mpadvise"


def database_path() -> Path:
    """The SQLite database of profiles, recommendations, trials and jobs (not created here)."""
    return cache_dir() / "mpadvise.db"
