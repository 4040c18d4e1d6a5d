"""Files mpadvise writes for people, written whole or never through a planted name, and config
files it reads only when nobody else could have written them. Here because ``probes`` is the
package every other one may import; ``advisor._secure`` re-exports it.

Writing: a random name beside the target, created ``O_EXCL | O_NOFOLLOW``, fsynced, then
``os.replace``-d onto it (a symlink target is replaced, what it points to untouched). Reading:
opened ``O_NOFOLLOW`` and judged by ``fstat`` on the open descriptor, so the file judged is the
file read; its directory does not matter (a file of the user's in ``/tmp`` is fine)."""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from pathlib import Path

from probes._errors import MpadviseError

# Never group- or world-writable, whatever the umask, so that read_trusted_text accepts it back.
FILE_MODE = 0o644

_TEMP_TRIES = 16


def write_file_atomic(path: str | os.PathLike[str], text: str | bytes, *, mode: int = FILE_MODE) -> Path:
    """Write ``text`` (UTF-8) or bytes to ``path`` whole or not at all, never through a planted
    name; on ``OSError`` no temporary file is left and the target is unchanged."""
    path = Path(path)
    tmp, fd = _create_temporary(path.parent, path.name, mode)
    try:
        with (os.fdopen(fd, "wb") if isinstance(text, bytes) else os.fdopen(fd, "w", encoding="utf-8")) as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_directory(path.parent)
    return path


def check_writable(path: str | os.PathLike[str], what: str) -> Path:
    """Refuse now, in one line, a file that could not be written after a tune of minutes.

    A temporary file is created in the directory and removed, as :func:`write_file_atomic`
    would, so a read-only file system, a full quota or another user's directory is caught too."""
    path = Path(path)
    if path.is_dir():
        raise MpadviseError(f"cannot write {what} {path}: it is a directory")
    directory = path.parent
    if not directory.is_dir():
        why = "is not a directory" if directory.exists() else "does not exist"
        raise MpadviseError(f"cannot write {what} {path}: its directory {directory} {why}")
    try:
        tmp, fd = _create_temporary(directory, path.name, FILE_MODE)
    except OSError as exc:
        raise MpadviseError(f"cannot write {what} {path}: {exc.strerror or exc}") from None
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(tmp)
    return path


def _create_temporary(directory: Path, name: str, mode: int) -> tuple[Path, int]:
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    for _ in range(_TEMP_TRIES):
        tmp = directory / f".{name}.{secrets.token_hex(8)}.tmp"
        with contextlib.suppress(FileExistsError):
            return tmp, os.open(tmp, flags, mode)
    raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(directory))


def _fsync_directory(directory: Path) -> None:
    """Make the rename durable; a file system that cannot fsync a directory is let be."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _user(uid: int) -> str:
    name = _name(uid)
    return f"uid {uid}" if name == str(uid) else f"{name} (uid {uid})"


def _name(uid: int) -> str:
    with contextlib.suppress(ImportError, KeyError):
        import pwd

        return pwd.getpwuid(uid).pw_name
    return str(uid)


def read_trusted_text(path: str | os.PathLike[str], *, what: str = "config file") -> str:
    """The text of a file that only the user running mpadvise (or root) can have written.

    Raises:
        MpadviseError: missing, a symlink, not a regular file, another user's, or writable by
            group or others: one line naming the file, its owner and mode, and the fix.
        IsADirectoryError, OSError, UnicodeDecodeError: it cannot be read.
    """
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise MpadviseError(f"{what} {path} does not exist") from None
    except OSError:
        if os.path.islink(path):
            raise MpadviseError(f"refusing {what} {path}: it is a symbolic link, which mpadvise "
                                "does not follow (another user may have planted it); name the "
                                "file it points to instead") from None
        raise
    with os.fdopen(fd, "rb") as handle:
        st = os.fstat(handle.fileno())
        if stat.S_ISDIR(st.st_mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
        if not stat.S_ISREG(st.st_mode):
            raise MpadviseError(f"refusing {what} {path}: it is not a regular file; name a {what} "
                                "instead")
        me, perms = os.geteuid(), f"mode {stat.S_IMODE(st.st_mode):04o}"
        if st.st_uid not in (me, 0):
            reason = f"owned by {_user(st.st_uid)}, not by {_user(me)} who runs mpadvise ({perms})"
            fix = f"`rm {path}` if it is not yours, or `chown {_name(me)} {path}` after reading it"
        elif st.st_mode & (stat.S_IWOTH | stat.S_IWGRP):
            whom = "others" if st.st_mode & stat.S_IWOTH else "its group"
            reason = f"writable by {whom} ({perms}, owner {_user(st.st_uid)})"
            fix = f"`chmod go-w {path}` if its content is yours"
        else:
            return handle.read().decode("utf-8")
    raise MpadviseError(f"refusing {what} {path}: it is {reason}; another user could have written it; {fix}")
