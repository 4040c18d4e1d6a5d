"""Where a timed-out trial hung, from real ``faulthandler`` dumps: a process registers its dump
as a trial process does (``register_stack_dump``), the parent signals it
(``request_stack_dumps``) and reads the main thread's innermost frame (``main_frame``); the
reason names the rank that hung, not the one that waited for it in torch (``stack_blame``)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from advisor.trial._stacks import main_frame, request_stack_dumps, stack_blame, stack_dump_path

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs SIGUSR2 and /proc")

# A trial process that hangs in ``wait_here`` of its own (a daemon thread beside it sleeps too),
# or in ``wait_in_torch`` of a module below a ``torch`` directory.
HANG = textwrap.dedent("""
    import sys, threading, time
    from advisor.trial._stacks import register_stack_dump

    def side():
        time.sleep(600)

    def wait_here():
        print("ready", flush=True)
        time.sleep(600)

    threading.Thread(target=side, daemon=True).start()
    register_stack_dump(sys.argv[1])
    if sys.argv[2] == "torch":
        sys.path.insert(0, sys.argv[3])
        from torch.fake_collective import wait_in_torch
        wait_in_torch()
    wait_here()
""")
TORCH_MODULE = textwrap.dedent("""
    import time

    def wait_in_torch():
        print("ready", flush=True)
        time.sleep(600)
""")


def _hanging(tmp_path: Path, name: str, where: str) -> tuple[subprocess.Popen[str], Path]:
    """A process that hangs ``where`` ("script" or "torch"), its stack dump registered."""
    script = tmp_path / "hang_script.py"
    script.write_text(HANG)
    (tmp_path / "lib" / "torch").mkdir(parents=True, exist_ok=True)
    (tmp_path / "lib" / "torch" / "__init__.py").write_text("")
    (tmp_path / "lib" / "torch" / "fake_collective.py").write_text(TORCH_MODULE)
    result = tmp_path / name
    proc = subprocess.Popen([sys.executable, str(script), str(result), where, str(tmp_path / "lib")],
                            stdout=subprocess.PIPE, text=True, cwd=os.getcwd())
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc, Path(stack_dump_path(result))


def _ended(*procs: subprocess.Popen[str]) -> None:
    for proc in procs:
        proc.kill()
        proc.wait()


def test_the_main_threads_innermost_frame_is_read_from_a_real_dump(tmp_path):
    proc, path = _hanging(tmp_path, "result.json", "script")
    try:
        [dump] = request_stack_dumps([path], os.getpid())
        assert proc.poll() is None  # the dump does not end the process
    finally:
        _ended(proc)
    assert dump is not None and dump.count("(most recent call first)") == 2  # both threads
    frame = main_frame(dump)
    assert frame is not None and frame.function == "wait_here" and frame.file.endswith("hang_script.py")
    assert not frame.in_torch
    assert stack_blame([dump]) == f"the script hung in hang_script.py line {frame.line} (wait_here)"


def test_a_rank_that_hung_is_named_and_its_peer_waiting_in_torch_is_not(tmp_path):
    rank0, path0 = _hanging(tmp_path, "result.json.rank0", "torch")
    rank1, path1 = _hanging(tmp_path, "result.json.rank1", "script")
    try:
        dumps = request_stack_dumps([path0, path1], os.getpid())
    finally:
        _ended(rank0, rank1)
    frame0, frame1 = main_frame(dumps[0] or ""), main_frame(dumps[1] or "")
    assert frame0 is not None and frame0.in_torch and frame0.function == "wait_in_torch"
    assert frame1 is not None and not frame1.in_torch
    blame = stack_blame(dumps)
    assert blame == f"rank 1 hung in hang_script.py line {frame1.line} (wait_here) while rank 0 waited for it in torch"
    assert stack_blame([dumps[0], dumps[0]]).startswith("every rank waited in torch")
    assert stack_blame([dumps[0], None]) == ("rank 0 waited in torch (a collective or the autograd engine), none in "
                                             "the script; rank 1 dumped no stack")


def test_a_process_outside_the_trials_tree_is_not_signalled(tmp_path):
    """A pid in a dump file is signalled only while it runs below the trial's launcher: one
    that ended may have left its pid to another process."""
    proc, path = _hanging(tmp_path, "result.json", "script")
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        assert request_stack_dumps([path], other.pid, wait_s=0.2) == [None]
        assert proc.poll() is None and path.read_text() == f"pid {proc.pid}\n"
    finally:
        _ended(proc, other)


def test_no_dump_or_a_dump_without_python_frames_blames_no_one():
    assert stack_blame([None, None]) is None and stack_blame([]) is None
    assert main_frame("") is None
    assert main_frame("Current thread 0x00007f00 (most recent call first):\n  <no Python frame>\n") is None
