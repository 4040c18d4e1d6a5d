"""Launching a trial, parent side: start a training script under one candidate policy, wait for
it within its timeout, read its result file (merged over its ranks) and classify the outcome,
told by the kernel's OOM kill count. It needs neither torch nor the policies."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ._classify import classify
from ._proctree import end_trial, launcher_argv
from ._python_command import THREADS_ENV, cold_command
from ._rank_merge import merge_rank_results
from ._ranks import EXITS_ENV
from ._schema import POLICY_ENV, TRIAL_SPEC_ENV, TrialResult, TrialSpec, rank_result_path
from ._stacks import request_stack_dumps, stack_dump_path
from ._warm import WarmLauncher, WarmTrial


def trial_environment(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) unbuffered, without a policy override (the spec rules)."""
    child_env = dict(os.environ if env is None else env)
    child_env["PYTHONUNBUFFERED"] = "1"
    child_env.pop(POLICY_ENV, None)
    return child_env


def run_trial(script: str | os.PathLike[str], args: list[str], spec: TrialSpec, *, timeout: float,
              python: str = sys.executable, env: dict[str, str] | None = None,
              cwd: str | os.PathLike[str] | None = None, launch: Sequence[str] = (),
              warm: WarmLauncher | None = None) -> TrialResult:
    """Run ``python [LAUNCH...] script args`` with ``spec`` injected, in a subprocess (which
    isolates out-of-memory, CUDA errors, segfaults and hangs), forked from ``warm`` where that is
    as good as a fresh interpreter; classify the outcome."""
    result_path = Path(spec.result_path)
    rank_paths = [Path(rank_result_path(result_path, r)) for r in range(spec.nproc_per_node)] if spec.nproc_per_node > 1 else []
    stack_paths = [Path(stack_dump_path(path)) for path in rank_paths or [result_path]]
    exits_path = Path(f"{result_path}.exits.json")
    for path in (result_path, *rank_paths, *stack_paths, exits_path):
        path.unlink(missing_ok=True)
    spec_file = result_path.with_suffix(".spec.json")
    spec_file.write_text(spec.to_json())
    child_env = trial_environment(env)
    child_env[TRIAL_SPEC_ENV] = str(spec_file)
    child_env.pop(THREADS_ENV, None)
    if spec.threads is not None and spec.nproc_per_node == 1:
        child_env[THREADS_ENV] = str(spec.threads)
    if rank_paths:
        child_env[EXITS_ENV] = str(exits_path)  # where the rank launcher records how each rank ended
    # The child starts in this process's memory cgroup: counting that cgroup's OOM kills before
    # and after tells a kill by the kernel's OOM killer from any other SIGKILL.
    oom_before = oom_kill_count()
    command = [*launch, str(script), *args]
    with tempfile.TemporaryFile("w+b") as err, tempfile.TemporaryFile("w+b") as out:
        launched, start = time.time(), time.perf_counter()
        proc: subprocess.Popen[bytes] | WarmTrial | None = None
        if warm is not None:
            proc = warm.start_trial(command, env=child_env, cwd=cwd, stdout=out, stderr=err, python=python,
                                    nproc_per_node=spec.nproc_per_node)
        if proc is None:
            launched, start = time.time(), time.perf_counter()
            # Under the launcher (Linux), every process the script starts stays below the trial,
            # even in a session of its own or once its parent has died, and none outlives the trial.
            proc = subprocess.Popen(
                [*launcher_argv(python), *cold_command(python, command, nproc_per_node=spec.nproc_per_node)],
                stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=child_env, cwd=cwd,
                start_new_session=True,  # so a timeout can kill the script's own children too
            )
        timed_out, stacks = False, None
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            stacks = request_stack_dumps(stack_paths, proc.pid)  # where each process hung, before the kill
            end_trial(proc.pid)
            code = proc.wait()
        except BaseException:
            end_trial(proc.pid)
            proc.wait()
            raise
        exited, wall = time.time(), time.perf_counter() - start
        err.seek(0)
        tail = _tail(err.read())
    oom_after = oom_kill_count()
    data = (merge_rank_results([_read_json(path) for path in rank_paths], exits=_read_json(exits_path))
            if rank_paths else _read_json(result_path))
    for path in (spec_file, exits_path, *stack_paths):
        path.unlink(missing_ok=True)
    return classify(
        data, exit_code=code, timed_out=timed_out, stacks=stacks, stderr_tail=tail, spec=spec, timeout=timeout,
        wall_s=wall, oom_kills=None if oom_after is None or oom_before is None else max(0, oom_after - oom_before),
        timeline={"launched": launched, "exited": exited})


def _tail(raw: bytes, max_chars: int = 4000, max_lines: int = 30) -> str:
    lines = [ln for ln in raw.decode("utf-8", errors="replace").splitlines() if ln.strip()]
    return "\n".join(lines[-max_lines:])[-max_chars:]


def _read_json(path: Path) -> dict[str, Any] | None:
    with contextlib.suppress(OSError, ValueError):
        return json.loads(path.read_text())
    return None


def oom_kill_count(pid: int | str = "self", *, proc: str | os.PathLike[str] = "/proc") -> int | None:
    """The OOM killer's kills in ``pid``'s memory cgroup (v2 or v1), or None where unreadable."""
    root = Path(proc)
    try:
        cgroups = (root / str(pid) / "cgroup").read_text()
        mounts = (root / "self" / "mountinfo").read_text()
    except OSError:
        return None
    for version, directory in memory_cgroup_dirs(cgroups, mounts):
        name = "memory.events" if version == 2 else "memory.oom_control"
        with contextlib.suppress(OSError):
            for line in (directory / name).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill" and value.strip().isdigit():
                    return int(value)
    return None


def memory_cgroup_dirs(cgroups: str, mountinfo: str) -> list[tuple[int, Path]]:
    """A process's memory cgroup directories: ``(2, dir)`` on the unified hierarchy, then v1's."""
    paths: dict[int, str] = {}
    for parts in (line.split(":", 2) for line in cgroups.splitlines()):
        if len(parts) == 3 and parts[:2] == ["0", ""]:
            paths[2] = parts[2]
        elif len(parts) == 3 and "memory" in parts[1].split(","):
            paths[1] = parts[2]
    found = []
    for version in (v for v in (2, 1) if v in paths):
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
            root, point = (re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), f)
                           for f in fields[3:5])
            mounts.append((root, point))
    return mounts
