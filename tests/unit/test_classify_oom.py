"""A child killed by the kernel's OOM killer is classified ``oom``; the cgroup counter it rests on."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from advisor.trial import TrialSpec, classify
from advisor.trial._launch import oom_kill_count

SIGKILL = -getattr(signal, "SIGKILL", 9)
SPEC = TrialSpec(policy={"schema": 1, "mode": "fp32"}, result_path="unused.json")
STEPPING = {"stage": "stepping", "losses": [1.0, 0.9, 0.8]}


def outcome(data, *, exit_code=SIGKILL, timed_out=False, oom_kills=None):
    return classify(
        data, exit_code=exit_code, timed_out=timed_out, stderr_tail="", spec=SPEC, timeout=60.0, oom_kills=oom_kills
    )


def test_sigkill_with_an_oom_kill_counted_is_oom() -> None:
    result = outcome(STEPPING, oom_kills=1)
    assert result.outcome == "oom"
    assert "out of memory" in result.reason and "OOM killer" in result.reason
    assert "after 3 steps" in result.reason


def test_oom_kill_before_load_policy_is_lost_not_a_verdict_on_the_candidate() -> None:
    # Nothing of the candidate ran yet: the memory was the script's start-up's.
    result = outcome(None, oom_kills=2)
    assert result.outcome == "lost"
    assert "OOM killer" in result.reason and "SIGKILL" in result.reason


@pytest.mark.parametrize("oom_kills", [None, 0])
def test_sigkill_without_an_oom_kill_stays_crash(oom_kills) -> None:
    result = outcome(STEPPING, oom_kills=oom_kills)
    assert result.outcome == "crash" and "SIGKILL" in result.reason


def test_other_signals_are_not_oom_even_when_the_cgroup_counted_one() -> None:
    # Someone else in the cgroup was OOM-killed while this child segfaulted.
    result = outcome(STEPPING, exit_code=-signal.SIGSEGV, oom_kills=1)
    assert result.outcome == "crash" and "SIGSEGV" in result.reason


def test_a_timeout_is_a_timeout_whatever_the_counter_says() -> None:
    assert outcome(STEPPING, timed_out=True, oom_kills=1).outcome == "timeout"


def test_a_finished_trial_is_judged_on_its_data() -> None:
    done = {"stage": "done", "complete": True, "losses": [1.0], "step_times": [0.1]}
    assert outcome(done, exit_code=0, oom_kills=1).outcome == "ok"


# ---- the counter -------------------------------------------------------------------------------


def fake_proc(tmp_path: Path, cgroup: str, mounts: list[str]) -> Path:
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text(cgroup)
    (proc / "self" / "mountinfo").write_text("".join(line + "\n" for line in mounts))
    return proc


def write(directory: Path, name: str, text: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / name).write_text(text)


def test_cgroup_v2_memory_events(tmp_path: Path) -> None:
    cg2 = tmp_path / "cg2"
    write(cg2 / "user.slice" / "trial", "memory.events", "low 0\nhigh 0\nmax 9\noom 3\noom_kill 2\noom_group_kill 0\n")
    proc = fake_proc(tmp_path, "0::/user.slice/trial\n", [f"41 31 0:38 / {cg2} rw,relatime - cgroup2 cgroup2 rw"])
    assert oom_kill_count(proc=proc) == 2


def test_cgroup_v1_memory_oom_control(tmp_path: Path) -> None:
    mem = tmp_path / "memory"
    write(mem / "docker" / "abc", "memory.oom_control", "oom_kill_disable 0\nunder_oom 0\noom_kill 5\n")
    proc = fake_proc(
        tmp_path,
        "4:memory:/docker/abc\n1:cpu:/docker/abc\n0::/\n",
        [
            f"32 31 0:29 / {tmp_path / 'cpu'} rw,relatime - cgroup cgroup rw,cpu",
            f"35 31 0:32 / {mem} rw,relatime - cgroup cgroup rw,memory",
            f"41 31 0:38 / {tmp_path / 'unified'} rw,relatime - cgroup2 cgroup2 rw",
        ],
    )
    assert oom_kill_count(proc=proc) == 5  # the hybrid layout: v2 mounted, memory on v1


def test_a_mount_of_a_subtree_maps_the_path(tmp_path: Path) -> None:
    mem = tmp_path / "memory"
    write(mem / "trial", "memory.oom_control", "oom_kill 7\n")
    proc = fake_proc(
        tmp_path, "4:memory:/docker/abc/trial\n", [f"35 31 0:32 /docker/abc {mem} rw - cgroup cgroup rw,memory"]
    )
    assert oom_kill_count(proc=proc) == 7


def test_a_mount_point_with_a_space(tmp_path: Path) -> None:
    cg2 = tmp_path / "cgroup two"
    write(cg2, "memory.events", "oom_kill 1\n")
    escaped = str(cg2).replace(" ", "\\040")
    proc = fake_proc(tmp_path, "0::/\n", [f"41 31 0:38 / {escaped} rw - cgroup2 cgroup2 rw"])
    assert oom_kill_count(proc=proc) == 1


@pytest.mark.parametrize(
    ("cgroup", "mounts"),
    [
        ("0::/trial\n", []),  # no cgroup file system mounted
        ("0::/trial\n", ["41 31 0:38 / {tmp}/nowhere rw - cgroup2 cgroup2 rw"]),  # no memory.events
        ("4:memory:/outside\n", ["35 31 0:32 /docker/abc {tmp}/memory rw - cgroup cgroup rw,memory"]),
        ("", []),
    ],
)
def test_no_counter_is_none(tmp_path: Path, cgroup: str, mounts: list[str]) -> None:
    proc = fake_proc(tmp_path, cgroup, [m.format(tmp=tmp_path) for m in mounts])
    assert oom_kill_count(proc=proc) is None


def test_no_proc_is_none(tmp_path: Path) -> None:
    assert oom_kill_count(proc=tmp_path / "missing") is None
    assert oom_kill_count(12345678, proc=tmp_path) is None


# ---- a DataLoader worker killed by the OOM killer ----------------------------------------------

# The end of a trial's stderr when the kernel killed a DataLoader worker with SIGKILL (torch
# 2.13; the script itself fails with the RuntimeError that follows).
WORKER_KILLED_TAIL = """\
  File "/venv/lib/python3.11/site-packages/torch/utils/data/_utils/signal_handling.py", line 73, in handler
    _error_if_any_worker_fails()
RuntimeError: DataLoader worker (pid 18603) is killed by signal: Killed.
The above exception was the direct cause of the following exception:
Traceback (most recent call last):
  File "/tmp/train.py", line 25, in <module>
    for x, y in loader:
  File "/venv/lib/python3.11/site-packages/torch/utils/data/dataloader.py", line 1304, in _try_get_data
    raise RuntimeError(
RuntimeError: DataLoader worker (pid(s) 18603) exited unexpectedly"""
WORKER_EXCEPTION = {"stage": "exception", "exception": {
    "type": "RuntimeError", "message": "DataLoader worker (pid(s) 18603) exited unexpectedly", "at": 0.0}}


def worker_outcome(data, tail, *, oom_kills):
    return classify(data, exit_code=1, timed_out=False, stderr_tail=tail, spec=SPEC, timeout=60.0, oom_kills=oom_kills)


@pytest.mark.parametrize("oom_kills", [1, None])
def test_a_dataloader_worker_killed_by_sigkill_is_oom(oom_kills) -> None:
    result = worker_outcome(WORKER_EXCEPTION, WORKER_KILLED_TAIL, oom_kills=oom_kills)
    assert result.outcome == "oom"
    assert "DataLoader worker (pid 18603) was killed by SIGKILL" in result.reason
    assert "fewer DataLoader workers" in result.reason and result.stderr_tail == WORKER_KILLED_TAIL


def test_a_worker_killed_while_no_oom_kill_was_counted_is_a_crash() -> None:
    # The cgroup's count was read and did not rise: someone else sent the signal.
    result = worker_outcome(WORKER_EXCEPTION, WORKER_KILLED_TAIL, oom_kills=0)
    assert result.outcome == "crash" and "exited unexpectedly" in result.reason


def test_a_worker_that_died_otherwise_is_a_crash() -> None:
    # A bus error (out of shared memory) or a segfault in a worker is not the OOM killer.
    tail = WORKER_KILLED_TAIL.replace("Killed.", "Bus error. It is possible that dataloader's workers are out of shared memory.")
    assert worker_outcome(WORKER_EXCEPTION, tail, oom_kills=None).outcome == "crash"
