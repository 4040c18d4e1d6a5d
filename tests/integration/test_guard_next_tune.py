"""The next tune heeds the guard: a mode that a long run of this script found unstable after the
trial's window is judged ``unstable late (step N)`` and not run again, in the JSON and the
report; the answer kept from before that run no longer holds."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from policies import Policy

SCRIPTS = Path(__file__).resolve().parent / "scripts"


def test_a_mode_the_guard_caught_is_judged_unstable_late_by_the_next_tune(tmp_path, isolated_home, cli):
    script = tmp_path / "late_stall.py"
    shutil.copy(SCRIPTS / "late_stall.py", script)
    config = Policy(mode="bf16-true").save(tmp_path / "bf16_true.toml")
    run = cli("run", "--config", str(config), str(script), "--", "240", "120", timeout=240)
    assert run.returncode == 0 and "guard: stall under bf16-true" in run.stderr, run.stderr
    step = json.loads(run.stdout.strip().splitlines()[-1])["events"][0]["step"]

    args = ("tune", str(script), "--trials", "2", "--out", str(tmp_path / "tuned.toml"))
    tuned = cli(*args, "--json", "--", "240", "120", timeout=600)
    assert tuned.returncode == 0, tuned.stderr
    result = json.loads(tuned.stdout)
    (late,) = result["late"]
    assert late["mode"] == "bf16-true" and late["reason"].startswith(f"unstable late (step {step}): the guard saw stall")
    assert "bf16-true" not in result["space"]["modes"]
    assert result["winner"]["mode"] != "bf16-true"

    report = cli(*args, "--", "240", "120", timeout=600)  # the kept answer, shown again
    assert report.returncode == 0, report.stderr
    assert f"not run: bf16-true, unstable late (step {step})" in report.stdout

    cleared = cli("cache", "clear", "--yes", timeout=120)  # forgets the events with the entries
    assert cleared.returncode == 0, cleared.stderr
    assert json.loads(cli("show", "--json", timeout=120).stdout)["guard_events"] == []
