"""Another local user who can write the script's directory plants names there: a symlink at a
temporary name (to the tuning user's ~/.bashrc), a config file of their own. A real tune,
``mpadvise export --out`` and ``mpadvise run`` never write through the one nor apply the other.

Planted names are chowned to ``nobody`` (which needs root), standing for the other user's.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import stat
from pathlib import Path

import pytest

from policies import Policy, load_config

SCRIPTS = Path(__file__).resolve().parent / "scripts"
VICTIM_TEXT = "# the user's own ~/.bashrc\n"


def _nobody() -> int:
    if os.geteuid() != 0:
        pytest.skip("planting a file as another user needs root (os.chown)")
    try:
        return pwd.getpwnam("nobody").pw_uid
    except KeyError:
        pytest.skip("no user 'nobody' on this machine to plant files as")


def _plant_symlink(link: Path, target: Path) -> None:
    link.symlink_to(target)
    os.lchown(link, _nobody(), _nobody())


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    home = tmp_path / "victim-home"
    home.mkdir()
    bashrc = home / ".bashrc"
    bashrc.write_text(VICTIM_TEXT)
    return bashrc


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "train.py"
    shutil.copy(SCRIPTS / "tiny_ok.py", path)
    return path


def _mine_and_regular(path: Path) -> None:
    st = os.lstat(path)
    assert stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid()


def _error_lines(stderr: str) -> list[str]:
    assert "Traceback" not in stderr
    return [line for line in stderr.splitlines() if line.startswith("error:")]


@pytest.mark.slow
def test_a_tune_never_writes_through_a_planted_temporary_name(script, victim, isolated_home, cli):
    _plant_symlink(script.with_name(".train.mpadvise.toml.tmp"), victim)
    proc = cli("tune", str(script), "--trials", "2", "--steps", "32", "--warmup", "2", "--no-priors",
               "-m", "bf16-mixed", "--json", "--", "60")
    assert proc.returncode == 0, proc.stderr
    config = script.with_name("train.mpadvise.toml")
    assert json.loads(proc.stdout)["config_file"] == str(config)
    assert victim.read_text() == VICTIM_TEXT
    _mine_and_regular(config)
    assert load_config(config).tuned_on is not None


def test_export_out_never_writes_through_a_planted_name(tmp_path, victim, cli):
    config = Policy(mode="bf16-mixed").save(tmp_path / "train.mpadvise.toml")
    out = tmp_path / "lightning_settings.py"
    _plant_symlink(tmp_path / ".lightning_settings.py.tmp", victim)
    proc = cli("export", str(config), "--to", "lightning", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert victim.read_text() == VICTIM_TEXT
    _mine_and_regular(out)
    # A symlink at --out itself is replaced (with --force, as the name exists), never followed.
    out.unlink()
    _plant_symlink(out, victim)
    proc = cli("export", str(config), "--to", "lightning", "--out", str(out), "--force")
    assert proc.returncode == 0, proc.stderr
    assert victim.read_text() == VICTIM_TEXT
    _mine_and_regular(out)


def test_export_out_refuses_an_existing_file_without_force(tmp_path, cli):
    config = Policy(mode="bf16-mixed").save(tmp_path / "train.mpadvise.toml")
    out = tmp_path / "accelerate.yaml"
    out.write_text("kept: true\n")
    proc = cli("export", str(config), "--to", "accelerate", "--out", str(out))
    assert proc.returncode == 2
    assert _error_lines(proc.stderr) == [f"error: refusing to overwrite {out}: it exists; add --force to replace it"]
    assert out.read_text() == "kept: true\n"
    proc = cli("export", str(config), "--to", "accelerate", "--out", str(out), "--force")
    assert proc.returncode == 0, proc.stderr
    assert "mixed_precision: bf16" in out.read_text()
    _mine_and_regular(out)
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    # An earlier .py export is replaced with --force; a new name needs none.
    py = tmp_path / "settings.py"
    assert cli("export", str(config), "--to", "lightning", "--out", str(py)).returncode == 0
    again = cli("export", str(config), "--to", "lightning", "--out", str(py))
    assert again.returncode == 2 and "add --force" in again.stderr
    assert cli("export", str(config), "--to", "lightning", "--out", str(py), "--force").returncode == 0


def test_export_out_never_overwrites_the_script(script, isolated_home, cli):
    original = script.read_text()
    for force in ([], ["--force"]):
        proc = cli("export", str(script), "--to", "lightning", "--out", str(script), *force)
        assert proc.returncode == 2
        assert _error_lines(proc.stderr) == [
            f"error: refusing to write the export over {script}: it is the script being exported; "
            "name another file with --out"]
        other = script.with_name("prepare.py")
        other.write_text("print('prepare the data')\n")
        proc = cli("export", str(script), "--to", "lightning", "--out", str(other), *force)
        assert proc.returncode == 2
        assert "it is a Python file that mpadvise export did not write" in _error_lines(proc.stderr)[0]
        assert other.read_text() == "print('prepare the data')\n"
    assert script.read_text() == original


def test_run_refuses_a_planted_config_beside_the_script(script, isolated_home, cli):
    planted = Policy.from_dict({"mode": "fp16-mixed", "loss_scale": {"kind": "static", "init_scale": 1e30}}).save(
        script.with_name("train.mpadvise.toml"))
    os.chown(planted, _nobody(), _nobody())
    proc = cli("run", str(script), "--", "3", timeout=120)
    assert proc.returncode == 1
    lines = _error_lines(proc.stderr)
    assert len(lines) == 1 and lines[0].startswith(f"error: refusing config file {planted}: it is owned by nobody")
    assert "mode 0644" in lines[0] and f"rm {planted}" in lines[0]
    # Named explicitly, it is refused the same way: naming a path does not vouch for its content.
    # (a --config it cannot apply is a bad option value: exit 2)
    proc = cli("run", str(script), "--config", str(planted), "--", "3", timeout=120)
    assert proc.returncode == 2 and "owned by nobody" in _error_lines(proc.stderr)[0]
    env = {**os.environ, "MPADVISE_POLICY": str(planted)}
    proc = cli("run", str(script), "--", "3", timeout=120, env=env)
    assert proc.returncode == 1 and "owned by nobody" in _error_lines(proc.stderr)[0]


def test_run_refuses_a_group_writable_config(script, isolated_home, cli):
    config = Policy(mode="fp32").save(script.with_name("train.mpadvise.toml"))
    os.chmod(config, 0o664)
    proc = cli("run", str(script), "--", "3", timeout=120)
    assert proc.returncode == 1
    lines = _error_lines(proc.stderr)
    assert len(lines) == 1 and "writable by its group (mode 0664" in lines[0] and f"chmod go-w {config}" in lines[0]


def test_tune_out_refuses_a_script_before_any_trial(script, isolated_home, cli):
    original = script.read_text()
    proc = cli("tune", str(script), "--out", str(script), "--steps", "32", "--", "40")
    assert proc.returncode == 2  # a bad option value: a usage error
    assert _error_lines(proc.stderr) == [
        f"error: --out {str(script)!r} is not allowed; expected a config file path (.toml), "
        "not a Python file the tune would replace"]
    assert script.read_text() == original
