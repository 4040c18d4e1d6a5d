"""``mpadvise run``: a script runs unchanged with its policy applied; bad input gets one line.

The framework scripts' runs are tested with each framework (test_framework_*.py); these are
the loop-API script and the errors every script shares.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from policies import Policy

SCRIPTS = Path(__file__).resolve().parent / "scripts"


def test_a_loop_api_script_runs_with_the_config_named(tmp_path, isolated_home, cli):
    script = tmp_path / "tiny_ok.py"
    shutil.copy(SCRIPTS / "tiny_ok.py", script)
    config = Policy(mode="bf16-mixed").save(tmp_path / "chosen.toml")
    proc = cli("run", str(script), "--config", str(config), "--", "3", timeout=120)
    assert proc.returncode == 0, proc.stderr
    # load_policy() in the script logs the one line that names the policy and where it came from.
    assert f"policy bf16-mixed on cpu (from MPADVISE_POLICY={config})" in proc.stderr


def test_without_a_config_the_script_resolves_its_own_policy(tmp_path, isolated_home, cli):
    script = tmp_path / "tiny_ok.py"
    shutil.copy(SCRIPTS / "tiny_ok.py", script)
    Policy(mode="fp16-mixed").save(tmp_path / "tiny_ok.mpadvise.toml")
    proc = cli("run", str(script), "--", "3", timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "policy fp16-mixed (dynamic loss scale 65536) on cpu (from config file" in proc.stderr


def test_the_script_exit_code_is_the_command_exit_code(tmp_path, isolated_home, cli):
    proc = cli("run", str(SCRIPTS / "fails_before_policy.py"), timeout=120)
    assert proc.returncode == 1
    assert "Traceback" in proc.stderr  # the script's own traceback, not one of mpadvise's


def test_bad_input_gets_one_line(tmp_path, isolated_home, cli):
    missing = cli("run", str(tmp_path / "missing.py"))
    assert missing.returncode == 2 and missing.stderr.strip().splitlines() == [f"error: script {tmp_path / 'missing.py'} does not exist"]
    script = tmp_path / "train.py"
    script.write_text("from transformers import Trainer\n")
    no_config = cli("run", str(script), "--config", str(tmp_path / "none.toml"))
    assert no_config.returncode == 2 and len(no_config.stderr.strip().splitlines()) == 1
    assert "config file" in no_config.stderr and "does not exist" in no_config.stderr
    bad = cli("run", str(script), "--framework", "keras")
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "error: unknown framework 'keras'; expected one of lightning, fabric, transformers, accelerate, torch"]
    pure = Policy(mode="bf16-true").save(tmp_path / "pure.toml")
    refused = cli("run", str(script), "--config", str(pure))
    assert refused.returncode == 1 and len(refused.stderr.strip().splitlines()) == 1
    assert "transformers cannot apply mode bf16-true" in refused.stderr
