"""The kernel's OOM kills in a process's memory cgroup: counted before and after a trial, they
tell a kill by the OOM killer from any other SIGKILL."""

from __future__ import annotations

import os
import re
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
    for hierarchy, controllers, path in (ln.split(":", 2) for ln in cgroups.splitlines() if ln.count(":") > 1):
        if hierarchy == "0" and controllers == "":
            paths[2] = path
        elif "memory" in controllers.split(","):
            paths[1] = path
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
            # The kernel writes a space, tab, newline or backslash in a path as an octal escape.
            root, point = (re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), f) for f in fields[3:5])
            mounts.append((root, point))
    return mounts
