"""A config file that another user wrote, or could have, is refused in one line, wherever it
comes from: beside the script, ``load_policy(path)``, ``MPADVISE_POLICY``.

Files are chowned to ``nobody`` to stand for another user's, which needs root.
"""

from __future__ import annotations

import os
import pwd
from pathlib import Path

import pytest

import advisor
import probes
from advisor._load import resolve_policy
from policies import Policy, PolicyError, load_config

PLANTED = Policy.from_dict({"mode": "fp16-mixed", "loss_scale": {"kind": "static", "init_scale": 1e30}})


def _nobody() -> int:
    if os.geteuid() != 0:
        pytest.skip("planting a file as another user needs root (os.chown)")
    try:
        return pwd.getpwnam("nobody").pw_uid
    except KeyError:
        pytest.skip("no user 'nobody' on this machine to plant files as")


@pytest.fixture
def cpu():
    return probes.profile_for("cpu")


@pytest.fixture
def planted(tmp_path: Path) -> Path:
    """``train.mpadvise.toml`` beside ``train.py``, written by another user."""
    (tmp_path / "train.py").write_text("print('training')\n")
    config = PLANTED.save(tmp_path / "train.mpadvise.toml")
    os.chown(config, _nobody(), _nobody())
    return config


def _one_line(exc: pytest.ExceptionInfo) -> str:
    message = str(exc.value)
    assert "\n" not in message
    return message


def test_a_config_owned_by_another_user_is_refused(planted):
    with pytest.raises(PolicyError) as refused:
        load_config(planted)
    message = _one_line(refused)
    assert message.startswith(f"refusing config file {planted}: it is owned by nobody (uid {_nobody()})")
    assert "mode 0644" in message and f"rm {planted}" in message


def test_every_way_of_naming_it_refuses(planted, cpu, monkeypatch):
    script = planted.with_name("train.py")
    with pytest.raises(PolicyError, match="refusing config file .*owned by nobody"):
        resolve_policy(None, profile=cpu, script=script, environ={})
    with pytest.raises(PolicyError, match="refusing config file .*owned by nobody"):
        resolve_policy(None, profile=cpu, script=None, environ={"MPADVISE_POLICY": str(planted)})
    with pytest.raises(PolicyError, match="refusing config file .*owned by nobody"):
        advisor.load_policy(str(planted), device="cpu")


@pytest.mark.parametrize(("bits", "words"), [(0o664, "writable by its group"), (0o646, "writable by others")])
def test_a_config_others_can_write_is_refused(tmp_path, bits, words):
    config = Policy(mode="fp32").save(tmp_path / "train.mpadvise.toml")
    os.chmod(config, bits)
    with pytest.raises(PolicyError) as refused:
        load_config(config)
    message = _one_line(refused)
    assert f"it is {words} (mode {bits:04o}" in message and f"chmod go-w {config}" in message
    os.chmod(config, 0o644)
    assert load_config(config).mode == "fp32"


def test_a_symlinked_config_is_refused_not_followed(tmp_path):
    real = Policy(mode="fp32").save(tmp_path / "real.toml")
    link = tmp_path / "train.mpadvise.toml"
    link.symlink_to(real)
    with pytest.raises(PolicyError) as refused:
        load_config(link)
    assert "it is a symbolic link" in _one_line(refused)


def test_a_users_own_config_in_a_world_writable_directory_is_fine(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    config = Policy(mode="bf16-mixed").save(shared / "mine.toml")
    assert load_config(config).mode == "bf16-mixed"


def test_a_fifo_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "train.mpadvise.toml"
    os.mkfifo(fifo)
    with pytest.raises(PolicyError, match="not a regular file"):
        load_config(fifo)


def test_missing_and_directory_keep_their_messages(tmp_path):
    with pytest.raises(PolicyError, match=r"^config file .* does not exist$"):
        load_config(tmp_path / "none.toml")
    with pytest.raises(PolicyError, match="is a directory, expected a .toml file"):
        load_config(tmp_path)
