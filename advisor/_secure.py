"""Private files and directories of the cache, created 0700/0600 and checked for owner and
mode: the cache holds the daemon's job queue, its token and job logs that can quote a script's
secrets. ``write_file_atomic`` (files written for people) is re-exported from ``probes``."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from probes import MpadviseError, write_file_atomic

__all__ = ["ensure_private_dir", "ensure_private_file", "needs_tightening", "open_private_new",
           "unsafe_reason", "write_file_atomic"]

PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600


def unsafe_reason(st: os.stat_result, *, uid: int, is_dir: bool) -> str | None:
    """Why a path with this status (``os.lstat`` for a file) must not be trusted, or ``None``."""
    if is_dir and not stat.S_ISDIR(st.st_mode):
        return "not a directory"
    if not is_dir and stat.S_ISLNK(st.st_mode):
        return "a symbolic link"
    if not is_dir and not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    if st.st_uid != uid:
        return f"owned by uid {st.st_uid}, not by uid {uid} who runs mpadvise"
    if st.st_mode & stat.S_IWOTH:
        return "writable by others"
    return "writable by its group" if st.st_mode & stat.S_IWGRP else None


def needs_tightening(st: os.stat_result) -> bool:
    """Whether a path that is safe to trust still lets others read (or enter) it."""
    return bool(stat.S_IMODE(st.st_mode) & 0o077)


def _check_private(path: Path, st: os.stat_result, *, is_dir: bool) -> None:
    """Refuse ``path`` when unsafe (naming the fix), else tighten it to 0700/0600."""
    reason = unsafe_reason(st, uid=os.geteuid(), is_dir=is_dir)
    if reason is None:
        if needs_tightening(st):
            os.chmod(path, PRIVATE_DIR_MODE if is_dir else PRIVATE_FILE_MODE)
        return
    if is_dir:
        fix = f"`chmod 700 {path}` if it is yours, or set MPADVISE_HOME to a directory of your own"
    elif reason.startswith(("a symbolic", "not a")):
        fix = "move it away, or set MPADVISE_HOME to a directory of your own"
    else:
        fix = (f"`chmod 600 {path}` if it is yours, `rm {path}` if it is not, or set MPADVISE_HOME "
               "to a directory of your own")
    kind = "directory" if is_dir else "file"
    raise MpadviseError(f"refusing the mpadvise {kind} {path}: it is {reason}; {fix}")


def ensure_private_dir(path: Path) -> Path:
    """Create ``path`` with mode 0700, or check that an existing one is this user's and
    writable by nobody else (else files may already be planted), tightening it to 0700."""
    try:
        # Only the last component gets 0700; parents such as ~/.cache keep the umask's mode.
        path.mkdir(mode=PRIVATE_DIR_MODE, parents=True, exist_ok=True)
        st = os.stat(path)
    except OSError as exc:
        raise MpadviseError(
            f"cache directory {path} cannot be created or read ({exc.strerror or exc}); "
            "set MPADVISE_HOME to a writable directory"
        ) from exc
    _check_private(path, st, is_dir=True)
    return path


def ensure_private_file(path: Path) -> bool:
    """Whether the file exists; an existing one is checked without following a symlink, refused
    when unsafe, and tightened to 0600."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    _check_private(path, st, is_dir=False)
    return True


def open_private_new(path: Path, flags: int = os.O_WRONLY) -> int:
    """A descriptor of a new file with mode 0600, never following a symlink nor reusing a file."""
    return os.open(path, flags | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, PRIVATE_FILE_MODE)
