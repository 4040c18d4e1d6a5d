"""The CLI through typer's test runner: --version, --help without torch, probe, policy."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from advisor import __version__
from advisor.cli._app import app
from policies import Policy, TunedOn

runner = CliRunner()


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("MPADVISE_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("MPADVISE_POLICY", raising=False)


def test_version():
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output.strip() == f"mpadvise {__version__}"


def test_help_does_not_import_torch():
    code = "import sys; from advisor.cli._app import app; print('torch' in sys.modules, 'optuna' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False False"


def test_probe_json_describes_this_machine():
    result = runner.invoke(app, ["probe", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    cpu = [d for d in data["devices"] if d["profile"]["kind"] == "cpu"]
    assert len(cpu) == 1
    modes = cpu[0]["modes"]
    assert modes["fp32"]["supported"] and not modes["fp8-te"]["supported"]
    assert modes["fp8-te"]["reason"].startswith("fp8-te:")
    assert cpu[0]["safe_default"]["mode"] in ("fp32", "bf16-mixed")
    assert data["primary"] == cpu[0]["fingerprint"]


def test_probe_table_and_bench():
    result = runner.invoke(app, ["probe", "--bench"], env={"COLUMNS": "160"})
    assert result.exit_code == 0, result.output
    assert "safe default" in result.output and "matmul micro-benchmark" in result.output
    assert "fp32" in result.output and "bf16" in result.output


def test_policy_for_a_script_with_a_config_beside_it(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    Policy(mode="fp32", micro_batch_size=8).save(tmp_path / "train.mpadvise.toml")
    result = runner.invoke(app, ["policy", str(script), "--json"])
    assert result.exit_code == 0, result.output
    info = json.loads(result.output)
    assert info["policy"]["mode"] == "fp32" and info["policy"]["micro_batch_size"] == 8
    assert "train.mpadvise.toml" in info["source"]


def test_policy_without_anything_is_the_safe_default(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("")
    result = runner.invoke(app, ["policy", str(script), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["source"].startswith("safe default")


def test_policy_tuned_elsewhere_is_not_applied(tmp_path):
    path = tmp_path / "other.mpadvise.toml"
    Policy(mode="fp32", tuned_on=TunedOn(hardware_fingerprint="0" * 16, device="NVIDIA H100", torch="2.4.0")).save(path)
    result = runner.invoke(app, ["policy", str(path), "--json"])
    assert result.exit_code == 0, result.output
    info = json.loads(result.output)
    assert "device NVIDIA H100" in info["not_applied_because"] and "torch 2.4.0" in info["not_applied_because"]


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        ("mode = [", "invalid TOML"),
        ('mode = "fp33"\n', "Policy.mode: 'fp33' is not allowed"),
        ('mode = "fp8-te"\n', "cannot run on"),
    ],
)
def test_bad_config_file_is_one_line_and_exit_1(tmp_path, content, needle):
    path = tmp_path / "bad.mpadvise.toml"
    path.write_text(content)
    result = runner.invoke(app, ["policy", str(path)])
    assert result.exit_code == 1
    assert needle in " ".join(result.output.split())  # rich may wrap the line at the terminal width
    assert "Traceback" not in result.output


def test_missing_config_file_is_one_line():
    result = runner.invoke(app, ["policy", "nope.mpadvise.toml"])
    assert result.exit_code == 1 and "does not exist" in result.output


def test_unknown_command_is_a_usage_error():
    assert runner.invoke(app, ["frobnicate"]).exit_code == 2
