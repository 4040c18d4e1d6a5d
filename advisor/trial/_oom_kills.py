"""The kernel's OOM kills in a process's memory cgroup: counted before and after a trial, they
tell a kill by the OOM killer from any other SIGKILL."""

from __future__ import annotations

import os
from pathlib import Path


def oom_kill_count(pid: int | str = "self", *, proc: str | os.PathLike[str] = "/proc") -> int | None:
    """How many processes the OOM killer has killed in ``pid``'s memory cgroup (v2's
    ``memory.events``, or v1's ``memory.oom_control``), or ``None`` where it cannot be read."""
    root = Path(proc)
    try:
        cgroups = (root / str(pid) / "cgroup").read_text()
        mounts = (root / "self" / "mountinfo").read_text()
    except OSError:
        return None
    for version, directory in memory_cgroup_dirs(cgroups, mounts):
        name = "memory.events" if version == 2 else "memory.oom_control"
        try:
            text = (directory / name).read_text()
        except OSError:
            continue
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill" and value.strip().isdigit():
                return int(value)
    return None


def memory_cgroup_dirs(cgroups: str, mountinfo: str) -> list[tuple[int, Path]]:
    """The directories of a process's memory cgroup, from ``/proc/<pid>/cgroup`` and
    ``/proc/self/mountinfo``: ``(2, dir)`` on the unified hierarchy, then ``(1, dir)`` on v1."""
    paths: dict[int, str] = {}
    for line in cgroups.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            paths[2] = parts[2]
        elif "memory" in parts[1].split(","):
            paths[1] = parts[2]
    found = []
    for version in (2, 1):
        if version not in paths:
            continue
        for mount_root, mount_point in _cgroup_mounts(mountinfo, version):
            # A mount may show a subtree only (a container's view): its root is that subtree.
            relative = os.path.relpath(paths[version], mount_root)
            if relative == ".." or relative.startswith("../"):
                continue
            found.append((version, Path(mount_point) / relative if relative != "." else Path(mount_point)))
    return found


def _cgroup_mounts(mountinfo: str, version: int) -> list[tuple[str, str]]:
    """``(root, mount point)`` of each cgroup2 mount (``version`` 2), or of each v1 memory one."""
    mounts = []
    for line in mountinfo.splitlines():
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 5 or len(tail) < 3:
            continue
        fstype, options = tail[0], tail[2].split(",")
        if (version == 2 and fstype == "cgroup2") or (version == 1 and fstype == "cgroup" and "memory" in options):
            mounts.append((_unescape(fields[3]), _unescape(fields[4])))
    return mounts


def _unescape(field: str) -> str:
    """A mountinfo path: the kernel writes space, tab, newline and backslash as octal escapes."""
    for code in ("040", "011", "012", "134"):
        field = field.replace("\\" + code, chr(int(code, 8)))
    return field
