"""``mpadvise run`` on a framework script for which nothing was tuned keeps the script's own
precision, and says so in one line: only a measured policy replaces what the script asks for."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from policies import Policy

SCRIPTS = Path(__file__).resolve().parent / "scripts"

pytestmark = pytest.mark.slow


@pytest.fixture
def script(tmp_path):
    # A copy in a directory of its own: no config file beside it.
    path = tmp_path / "train.py"
    shutil.copy(SCRIPTS / "lightning_knobs.py", path)
    return path


def _precision(stdout: str) -> str:
    lines = [line for line in stdout.splitlines() if line.startswith("precision=")]
    assert len(lines) == 1, stdout
    return lines[0].split()[0].removeprefix("precision=")


@pytest.mark.parametrize("precision", ["32-true", "32", "bf16-mixed"])
def test_an_untuned_trainer_keeps_its_own_precision(precision, script, isolated_home, cli):
    proc = cli("run", str(script), "--framework", "lightning", "--",
               "--precision", precision, "--max-steps", "2", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert _precision(proc.stdout) == ("32-true" if precision == "32" else precision)
    ours = [line for line in proc.stderr.splitlines() if line.startswith("mpadvise:")]
    assert ours == [f"mpadvise: no tuned policy for {script}; running it with its own settings: "
                    f"mpadvise tune {script} first"]


def test_a_config_named_is_applied_over_the_scripts_precision(script, tmp_path, isolated_home, cli):
    config = Policy(mode="bf16-mixed").save(tmp_path / "chosen.toml")
    proc = cli("run", str(script), "--framework", "lightning", "--config", str(config), "--json", "--",
               "--precision", "32-true", "--max-steps", "2", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _precision(proc.stdout) == "bf16-mixed"
    summary = json.loads(proc.stdout.splitlines()[-1])
    assert summary["policy"]["mode"] == "bf16-mixed" and summary["source"] == f"config file {config}"
    assert summary["source_kind"] == "explicit"


def test_mpadvise_policy_is_a_tuned_policy_too(script, tmp_path, isolated_home, cli):
    config = Policy(mode="bf16-mixed").save(tmp_path / "chosen.toml")
    env = {**os.environ, "MPADVISE_POLICY": str(config)}
    proc = cli("run", str(script), "--framework", "lightning", "--",
               "--precision", "32-true", "--max-steps", "2", timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _precision(proc.stdout) == "bf16-mixed"
    assert f"mpadvise: policy bf16-mixed through lightning (from MPADVISE_POLICY={config})" in proc.stderr
