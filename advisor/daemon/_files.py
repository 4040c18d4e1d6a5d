"""The daemon's private files: the token, the lock and the address file."""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
import secrets
from pathlib import Path

from advisor._secure import PRIVATE_FILE_MODE, open_private_new
from advisor.daemon._client import read_token
from probes import MpadviseError


def ensure_token(path: Path) -> str:
    """Read the daemon's token, creating it (mode 0600) on first start."""
    with contextlib.suppress(FileExistsError), os.fdopen(open_private_new(path), "w") as handle:
        handle.write(secrets.token_urlsafe(32) + "\n")
    return read_token(path)


def acquire_lock(path: Path) -> int:
    """Hold the daemon's lock file (created 0600, ours, never through a symlink), so that one
    daemon runs per cache directory; the descriptor stays open while the daemon runs."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, PRIVATE_FILE_MODE)
    st = os.fstat(fd)
    if st.st_uid != os.geteuid():
        os.close(fd)
        raise MpadviseError(f"daemon lock {path} belongs to uid {st.st_uid}, not to us; remove it, or set "
                            "MPADVISE_HOME to a directory of your own")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise MpadviseError(f"a daemon is already running for {path.parent} (see {path.parent / 'daemon.json'}); "
                            "stop it with `mpadvise daemon stop` or use another MPADVISE_HOME") from None
    return fd


def write_private(path: Path, text: str) -> None:
    """Replace ``path`` atomically with ``text``, mode 0600, through a new temporary file.

    The temporary file is created exclusively and never through a symlink, so nothing planted
    under its name can redirect the write; one left by a crashed process of the same pid is
    removed first (unlink removes a link, not its target).
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    fd = open_private_new(tmp)
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
    os.replace(tmp, path)


def remove_if_ours(path: Path, pid: int) -> None:
    """Remove a pid or address file that names ``pid``; leave one another daemon wrote."""
    with contextlib.suppress(OSError, ValueError):
        text = path.read_text()
        owner = json.loads(text).get("pid") if text.lstrip().startswith("{") else int(text.strip())
        if owner == pid:
            path.unlink()


def utc_now_seconds() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
