"""``mpadvise tune --quiet``: no progress bar and no per-trial lines, only the result (with
--json, only the JSON); a tune without it shows its trials. Real subprocess tunes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent / "scripts"
COMMON = ["--trials", "1", "--steps", "32", "--warmup", "2", "--no-priors", "-m", "bf16-mixed", "--no-cache"]

pytestmark = pytest.mark.slow


def test_quiet_shows_only_the_result(tmp_path, isolated_home, cli):
    shutil.copy(SCRIPTS / "tiny_ok.py", tmp_path / "train.py")
    loud = cli("tune", "train.py", *COMMON, "--json", "--", "40", cwd=tmp_path)
    assert loud.returncode == 0, loud.stderr
    assert "  fp32: ok" in loud.stderr and "bf16-mixed" in loud.stderr  # what --quiet leaves out

    quiet = cli("tune", "train.py", *COMMON, "--json", "--fresh", "--quiet", "--", "40", cwd=tmp_path)
    assert quiet.returncode == 0, quiet.stderr
    assert quiet.stderr == ""
    assert json.loads(quiet.stdout)["winner_label"]

    shown = cli("tune", "train.py", *COMMON, "--fresh", "-q", "--", "40", cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert shown.stderr == "" and "wrote" in shown.stdout and "fp32: ok" not in shown.stdout, shown.stdout


def test_quiet_still_shows_errors(tmp_path, isolated_home, cli):
    shutil.copy(SCRIPTS / "tiny_ok.py", tmp_path / "train.py")
    proc = cli("tune", "train.py", "--quiet", "--steps", "3", "--warmup", "0", cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.startswith("error: --steps 3 with --warmup 0"), proc.stderr
