"""A fault on one rank of a real two-rank trial (gloo, on this CPU) is blamed on that rank, not
on the healthy peer that lost its connection to it: a Python exception, a NaN loss, a hang, a
SIGKILL of itself and ``os._exit(3)``, on rank 1, and a SIGKILL on rank 0. The hang's timeout
also leaves no process of the trial alive."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
from test_distributed_trials import alive, processes_running  # the process table, from /proc

from advisor.tune._run import ScriptRunner, TrialSettings
from policies import Policy

SCRIPTS = Path(__file__).resolve().parent / "scripts"

pytestmark = pytest.mark.slow

# (faulty rank, fault, outcome, what the reason says of the faulty rank)
FAULTS = [
    (1, "raise", "crash", "the script crashed on rank 1 (exit 1): ValueError: bad batch at step 3"),
    (1, "nan", "ok", "the first non-finite loss came at step 3 on rank 1"),
    # Both ranks made the same steps (DDP syncs every step): their stacks, dumped before the
    # kill, tell the rank asleep in the script from its peer blocked in the all-reduce.
    (1, "hang", "timeout", "rank 1 hung in ddp_rank_fails.py line 44 (<module>) while rank 0 waited for it in torch"),
    (1, "sigkill", "crash", "rank 1 was killed by SIGKILL after its first step() without an error of its own"),
    (1, "exit3", "crash", "rank 1 exited with status 3 after its first step() without an error of its own"),
    (0, "sigkill", "crash", "rank 0 was killed by SIGKILL after its first step() without an error of its own"),
]


@pytest.mark.parametrize(("rank", "fault", "outcome", "says"), FAULTS, ids=[f"{f}-rank{r}" for r, f, _, _ in FAULTS])
def test_a_fault_on_one_rank_is_blamed_on_that_rank(rank, fault, outcome, says, tmp_path, isolated_home, monkeypatch):
    timeout = 120 if fault == "hang" else 300
    # A copy under tmp_path, so that only this trial's processes name it; each rank writes its pid.
    script = tmp_path / "ddp_rank_fails.py"
    shutil.copy(SCRIPTS / "ddp_rank_fails.py", script)
    pids = tmp_path / "pids"
    pids.mkdir()
    monkeypatch.setenv("DDP_PID_DIR", str(pids))
    runner = ScriptRunner(script, [str(rank), "3", fault],
                          TrialSettings(warmup_steps=1, measure_steps=8, nproc_per_node=2, timeout=timeout))
    result = runner(Policy(mode="fp32"), "fp32")
    assert result.outcome == outcome, result.reason + result.stderr_tail
    if fault == "hang":
        assert f"no result within {timeout} s" in result.reason, result.reason
        workers = [int(p.read_text()) for p in pids.iterdir()]
        assert len(workers) == 2  # both ranks ran, and hung (one asleep, one waiting for it)
        # Every rank is below the trial's launcher (a child subreaper), which the timeout kills
        # with its whole tree.
        assert [pid for pid in workers if alive(pid)] == []
        assert processes_running(script) == []
    healthy = f"rank {1 - rank}"
    if fault == "nan":  # the trial ran; the NaN is judged against the reference later
        assert math.isnan(result.losses[3]) and says in result.notes
        return
    assert says in result.reason, result.reason
    if fault == "hang":  # a timeout lists every rank's progress, and names the rank that hung only
        assert f"{healthy} hung" not in result.reason, result.reason
    else:  # any other reason names the faulty rank only
        assert healthy not in result.reason and "Connection" not in result.reason, result.reason
