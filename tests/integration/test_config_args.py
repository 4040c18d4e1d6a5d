"""The config file beside a script knows the arguments it was tuned with: a real tune of a tiny
script records them, and a tune with other arguments refuses to replace it before any trial."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from policies import load_config

SCRIPTS = Path(__file__).resolve().parent / "scripts"
QUICK = ("--trials", "1", "--steps", "32", "--warmup", "2", "--no-priors", "-m", "bf16-mixed", "--json")

pytestmark = pytest.mark.slow


@pytest.fixture
def tiny(tmp_path):
    script = tmp_path / "tiny.py"
    shutil.copy(SCRIPTS / "tiny_ok.py", script)
    return script


def test_a_tune_with_other_arguments_refuses_to_replace_the_config(tiny, isolated_home, cli):
    first = cli("tune", str(tiny), *QUICK)
    assert first.returncode == 0, first.stderr
    config = tiny.with_name("tiny.mpadvise.toml")
    assert load_config(config).tuned_on.args == ()
    before = config.read_bytes()

    refused = cli("tune", str(tiny), *QUICK, "--", "300")
    assert refused.returncode == 2, refused.stderr
    lines = [line for line in refused.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, refused.stderr
    line = lines[0]
    assert "`tiny.py` (no arguments)" in line and "`tiny.py 300`" in line
    assert "--out FILE" in line and "delete tiny.mpadvise.toml" in line
    assert "Traceback" not in refused.stderr and refused.stdout == ""
    assert config.read_bytes() == before
    # The way out the line names: --out FILE keeps both answers.
    other = cli("tune", str(tiny), *QUICK, "--out", str(tiny.with_name("tiny-300.toml")), "--", "300")
    assert other.returncode == 0, other.stderr
    assert json.loads(other.stdout)["config_file"] == str(tiny.with_name("tiny-300.toml"))
    assert load_config(tiny.with_name("tiny-300.toml")).tuned_on.args == ("300",)
    assert config.read_bytes() == before

    # The same arguments again replace the file, as before.
    again = cli("tune", str(tiny), *QUICK, "--fresh")
    assert again.returncode == 0, again.stderr
    assert load_config(config).tuned_on.args == ()
