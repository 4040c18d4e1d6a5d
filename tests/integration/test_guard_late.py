"""The guard on runs that go wrong only after a trial's length: caught, fallen back from, remembered.

``scripts/late_trouble.py`` trains fine until step ONSET, then its inputs outgrow fp16's range
(``overflow``) or its fp16 gradients are forced non-finite (``collapse``); ``scripts/late_stall.py``
drops its learning rate below pure bf16's resolution (a stall). Under ``warn`` the
guard names the onset step; under ``fallback`` the run ends on bf16-mixed with a finite loss
and nearly every optimizer step applied; the cache, ``mpadvise show`` and the next
``load_policy()`` carry the event.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from policies import LossScale, Policy

SCRIPTS = Path(__file__).resolve().parent / "scripts"
STEPS, ONSET = 120, 60


def _script(tmp_path: Path, case: str) -> Path:
    script = tmp_path / "late_trouble.py"
    shutil.copy(SCRIPTS / "late_trouble.py", script)
    scale = LossScale(init_scale=2.0) if case == "collapse" else None
    Policy(mode="fp16-mixed", loss_scale=scale).save(tmp_path / "late_trouble.mpadvise.toml")
    return script


def _result(proc) -> dict:
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(("case", "signal"), [("overflow", "non-finite loss"), ("collapse", "loss-scale collapse")])
def test_warn_names_the_onset_once(tmp_path, isolated_home, cli, case, signal):
    script = _script(tmp_path, case)
    proc = cli("run", str(script), "--", case, str(STEPS), str(ONSET), timeout=240)
    result = _result(proc)
    lines = [line for line in proc.stderr.splitlines() if "guard:" in line]
    assert len(lines) == 1, proc.stderr
    assert f"guard: {signal} under fp16-mixed (began at optimizer step {ONSET}" in lines[0]
    assert "--guard fallback" in lines[0] and "bf16-mixed" in lines[0]
    (event,) = result["events"]
    assert ONSET <= event["step"] <= ONSET + 3 and event["action"] == "warned"
    assert result["mode"] == "fp16-mixed"


@pytest.mark.parametrize("case", ["overflow", "collapse"])
def test_fallback_finishes_on_bf16_mixed_and_is_remembered(tmp_path, isolated_home, cli, case):
    script = _script(tmp_path, case)
    args = ("--", case, str(STEPS), str(ONSET))
    result = _result(cli("run", "--guard", "fallback", str(script), *args, timeout=240))
    assert result["mode"] == "bf16-mixed" and math.isfinite(result["final_loss"])
    assert result["optimizer_steps"] == STEPS and result["applied_steps"] >= STEPS - 5
    (event,) = result["events"]
    assert (event["policy"], event["fallback"], event["action"]) == ("fp16-mixed", "bf16-mixed", "fell back")

    shown = cli("show", "--json", timeout=120)
    assert shown.returncode == 0, shown.stderr
    (row,) = json.loads(shown.stdout)["guard_events"]
    assert (row["signal"], row["step"], row["policy"], row["fallback"]) == (
        event["signal"], event["step"], "fp16-mixed", "bf16-mixed")
    assert row["script"] == str(script.resolve())
    table = cli("show", timeout=120)
    assert "Guard events" in table.stdout and event["signal"] in table.stdout

    # The next run resolves fp16-mixed beside the script, and applies bf16-mixed, saying why.
    again = cli("run", str(script), *args, timeout=240)
    second = _result(again)
    assert second["mode"] == "bf16-mixed" and second["events"] == [] and math.isfinite(second["final_loss"])
    assert "applying bf16-mixed rather than fp16-mixed" in again.stderr
    assert f"the guard saw {event['signal']} under fp16-mixed at optimizer step {event['step']}" in again.stderr


def test_bad_guard_value_is_one_line(tmp_path, isolated_home, cli):
    proc = cli("run", "--guard", "loud", str(_script(tmp_path, "overflow")), timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: --guard: guard='loud' is not a guard setting; expected one of off, warn, fallback"]



def _stall_script(tmp_path: Path) -> Path:
    # scripts/late_stall.py: its learning rate drops 100x at its ONSET, below pure bf16's resolution.
    script = tmp_path / "late_stall.py"
    shutil.copy(SCRIPTS / "late_stall.py", script)
    Policy(mode="bf16-true").save(tmp_path / "late_stall.mpadvise.toml")
    return script


STALL_ARGS, STALL_ONSET, PROBE_EVERY = ("--", "240", "120"), 120, 25  # lost updates are looked at every 25 steps


def test_warn_names_a_bf16_true_stall_after_a_learning_rate_drop(tmp_path, isolated_home, cli):
    warned = cli("run", str(_stall_script(tmp_path)), *STALL_ARGS, timeout=240)
    (line,) = [line for line in warned.stderr.splitlines() if "guard:" in line]
    assert "guard: stall under bf16-true (began at optimizer step" in line and "lost to rounding" in line
    assert "--guard fallback" in line and "bf16-mixed" in line
    (event,) = _result(warned)["events"]
    assert STALL_ONSET <= event["step"] <= STALL_ONSET + PROBE_EVERY and event["action"] == "warned"


def test_a_bf16_true_stall_falls_back_to_bf16_mixed_and_is_remembered(tmp_path, isolated_home, cli):
    script = _stall_script(tmp_path)
    fell = _result(cli("run", "--guard", "fallback", str(script), *STALL_ARGS, timeout=240))
    assert fell["mode"] == "bf16-mixed" and math.isfinite(fell["final_loss"])
    assert fell["optimizer_steps"] == fell["applied_steps"] == 240
    (event,) = fell["events"]
    assert (event["signal"], event["fallback"], event["action"]) == ("stall", "bf16-mixed", "fell back")
    (row,) = json.loads(cli("show", "--json", timeout=120).stdout)["guard_events"]
    assert (row["signal"], row["policy"], row["fallback"]) == ("stall", "bf16-true", "bf16-mixed")

    again = cli("run", str(script), *STALL_ARGS, timeout=240)
    assert _result(again)["mode"] == "bf16-mixed" and "applying bf16-mixed rather than bf16-true" in again.stderr
