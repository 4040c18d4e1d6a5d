"""The guard over a plain script under ``mpadvise run``: the script never calls
``load_policy()``, so the plain adapter's step boundaries feed the guard. It names the onset
once; its precision was set when the script started, so under ``fallback`` too it asks for a
restart; the event is cached, ``mpadvise show`` lists it, and the next ``mpadvise run`` applies
the safer mode.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from policies import Policy

SCRIPTS = Path(__file__).resolve().parent / "scripts"
STEPS, ONSET = 80, 40


def _script(tmp_path: Path) -> Path:
    script = tmp_path / "plain_late_overflow.py"
    shutil.copy(SCRIPTS / "plain_late_overflow.py", script)
    Policy(mode="fp16-mixed").save(tmp_path / "plain_late_overflow.mpadvise.toml")
    return script


def _result(proc) -> dict:
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("setting", ["warn", "fallback"])
def test_a_plain_script_is_watched_and_the_next_run_applies_the_safer_mode(tmp_path, isolated_home, cli, setting):
    script = _script(tmp_path)
    args = ("--", str(STEPS), str(ONSET))
    first = cli("run", "--guard", setting, str(script), *args, timeout=240)
    assert _result(first)["dtype"] == "torch.float16"  # fp16-mixed applied over the script's own autocast
    lines = [line for line in first.stderr.splitlines() if "guard:" in line]
    assert len(lines) == 1, first.stderr
    assert f"guard: non-finite loss under fp16-mixed (began at optimizer step {ONSET}" in lines[0]
    assert "restart the run" in lines[0] and "bf16-mixed" in lines[0]

    shown = cli("show", "--json", timeout=120)
    assert shown.returncode == 0, shown.stderr
    (row,) = json.loads(shown.stdout)["guard_events"]
    assert (row["policy"], row["fallback"], row["action"]) == ("fp16-mixed", "bf16-mixed", "restart needed")
    assert ONSET <= row["step"] <= ONSET + 3 and row["script"] == str(script.resolve())

    again = cli("run", str(script), *args, timeout=240)
    second = _result(again)
    assert second["dtype"] == "torch.bfloat16" and math.isfinite(second["final_loss"]) and second["steps"] == STEPS
    assert "applying bf16-mixed rather than fp16-mixed" in again.stderr
    assert not [line for line in again.stderr.splitlines() if "guard:" in line]


def test_the_guard_off_watches_nothing(tmp_path, isolated_home, cli):
    script = _script(tmp_path)
    proc = cli("run", "--guard", "off", str(script), "--", str(STEPS), str(ONSET), timeout=240)
    assert _result(proc)["dtype"] == "torch.float16" and "guard:" not in proc.stderr
    assert json.loads(cli("show", "--json", timeout=120).stdout)["guard_events"] == []
