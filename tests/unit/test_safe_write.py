"""Files mpadvise writes for people are written whole, under a random name, never through a
name another user planted; a symlink at the target itself is replaced, not followed.

The planted names are chowned to ``nobody`` (which needs root), as another local user would
leave them in a directory both can write.
"""

from __future__ import annotations

import os
import pwd
import stat
from pathlib import Path

import pytest

from advisor._secure import write_file_atomic
from policies import Policy
from probes import MpadviseError, _files

VICTIM_TEXT = "# the user's own ~/.bashrc\nexport PATH=$HOME/bin:$PATH\n"


def _nobody() -> int:
    try:
        return pwd.getpwnam("nobody").pw_uid
    except KeyError:
        pytest.skip("no user 'nobody' on this machine to plant files as")


def _plant_symlink(link: Path, target: Path) -> None:
    """A symlink at ``link`` to ``target``, owned by another user (when run as root)."""
    link.symlink_to(target)
    if os.geteuid() == 0:
        os.lchown(link, _nobody(), _nobody())


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    home = tmp_path / "home"
    home.mkdir()
    bashrc = home / ".bashrc"
    bashrc.write_text(VICTIM_TEXT)
    return bashrc


def _regular_and_mine(path: Path) -> os.stat_result:
    st = os.lstat(path)
    assert stat.S_ISREG(st.st_mode), f"{path} is not a regular file"
    assert st.st_uid == os.geteuid()
    return st


def _leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".tmp") and not p.is_symlink())


def test_policy_save_never_writes_through_the_old_temporary_name(tmp_path, victim):
    shared = tmp_path / "shared"
    shared.mkdir()
    config = shared / "train.mpadvise.toml"
    _plant_symlink(shared / ".train.mpadvise.toml.tmp", victim)
    Policy(mode="bf16-mixed").save(config)
    assert victim.read_text() == VICTIM_TEXT
    _regular_and_mine(config)
    assert Policy.from_toml(config.read_text()).mode == "bf16-mixed"


def test_a_symlink_at_the_random_name_is_never_opened(tmp_path, victim, monkeypatch):
    # Whatever name the writer draws, a symlink (or file) standing there is skipped, not followed.
    names = iter(["guessed", "fresh"])
    monkeypatch.setattr(_files.secrets, "token_hex", lambda n: next(names))
    _plant_symlink(tmp_path / ".out.toml.guessed.tmp", victim)
    write_file_atomic(tmp_path / "out.toml", "mode = 'fp32'\n")
    assert victim.read_text() == VICTIM_TEXT
    assert (tmp_path / "out.toml").read_text() == "mode = 'fp32'\n"
    assert not (tmp_path / ".out.toml.fresh.tmp").exists()


def test_a_symlink_at_the_target_is_replaced_not_followed(tmp_path, victim):
    config = tmp_path / "train.mpadvise.toml"
    _plant_symlink(config, victim)
    Policy(mode="fp32").save(config)
    assert victim.read_text() == VICTIM_TEXT
    _regular_and_mine(config)
    assert Policy.from_toml(config.read_text()).mode == "fp32"


def test_a_failed_write_leaves_no_temporary_and_the_target_as_it_was(tmp_path, monkeypatch):
    target = tmp_path / "out.toml"
    target.write_text("before\n")

    def refuse(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(_files.os, "replace", refuse)
    with pytest.raises(OSError):
        write_file_atomic(target, "after\n")
    assert target.read_text() == "before\n"
    assert _leftovers(tmp_path) == []
    with pytest.raises(MpadviseError, match="cannot write config file .*No space left on device"):
        Policy(mode="fp32").save(tmp_path / "new.toml")
    assert _leftovers(tmp_path) == [] and not (tmp_path / "new.toml").exists()


def test_a_written_file_is_never_group_or_world_writable(tmp_path):
    old = os.umask(0)
    try:
        write_file_atomic(tmp_path / "out.toml", "x = 1\n")
        Policy(mode="fp32").save(tmp_path / "train.mpadvise.toml")
    finally:
        os.umask(old)
    for name in ("out.toml", "train.mpadvise.toml"):
        assert stat.S_IMODE(os.stat(tmp_path / name).st_mode) == 0o644


def test_save_replaces_a_config_file_but_refuses_a_script(tmp_path):
    config = Policy(mode="fp32").save(tmp_path / "train.mpadvise.toml")
    Policy(mode="bf16-mixed").save(config)  # a tune rewriting its own previous config
    assert Policy.from_toml(config.read_text()).mode == "bf16-mixed"
    script = tmp_path / "train.py"
    script.write_text("print('training')\n")
    with pytest.raises(MpadviseError) as refused:
        Policy(mode="fp32").save(script)
    assert str(refused.value).startswith(f"refusing to replace {script} with a config file")
    assert "\n" not in str(refused.value)
    assert script.read_text() == "print('training')\n"
    Policy(mode="fp32").save(script, force=True)
    assert Policy.from_toml(script.read_text()).mode == "fp32"
