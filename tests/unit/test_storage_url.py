"""A study storage URL never shows its password, may come from the environment or a private
file (so it stays out of ``ps``), and the default study file is private.

Real SQLite files and a real refused connection on loopback; no server needed.
"""

from __future__ import annotations

import os
import socket
import stat

import pytest
from typer.testing import CliRunner

from advisor.cli._app import app
from advisor.tune import default_storage, resolve_storage, shown_url
from advisor.tune._storage import STORAGE_ENV, STORAGE_FILE_ENV, storage_error
from advisor.tune._study_status import check_storage
from probes import MpadviseError, UsageError

SECRET = "s3/cr+t="  # generated secrets hold "/", "+" and "="


@pytest.mark.parametrize(("given", "shown"), [
    (f"postgresql://tuner:{SECRET}@db:5432/studies", "postgresql://tuner:***@db:5432/studies"),
    ("postgresql://tuner:p@ss@db/studies", "postgresql://tuner:***@db/studies"),  # an unescaped "@"
    ("postgresql+psycopg://tuner:pw@db/studies", "postgresql+psycopg://tuner:***@db/studies"),
    ("postgresql://tuner@db/studies?password=pw&sslmode=require", "postgresql://tuner@db/studies?sslmode=require"),
    ("postgresql://db/studies?user=u&password=pw", "postgresql://db/studies?user=u"),
    ("postgresql://tuner@db:5432/studies", "postgresql://tuner@db:5432/studies"),
    ("sqlite:///tmp/a:b@c.db", "sqlite:///tmp/a:b@c.db"),
])
def test_a_storage_url_is_shown_without_its_password(given, shown):
    assert shown_url(given) == shown


def test_an_unreachable_server_is_named_without_its_password():
    with socket.socket() as sock:  # a port nobody listens on: the connection is refused at once
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"postgresql://tuner:{SECRET}@127.0.0.1:{port}/studies?password=other"
    message = storage_error(url, ConnectionRefusedError("refused"))
    assert "s3" not in message and "other" not in message and "tuner:***@127.0.0.1" in message


@pytest.mark.parametrize("url", ["nosuchdb://host/studies", "postgresql+nodriver://u@db/s",
                                 "postgresql://tuner@db:port/studies", "postgresql:/studies", "not a url"])
def test_a_url_that_is_not_one_is_a_usage_error(url):
    with pytest.raises(UsageError, match="cannot open the Optuna study storage"):
        check_storage(url)


def test_a_server_that_refuses_is_an_error_of_the_run_not_of_usage():
    with socket.socket() as sock:  # a port nobody listens on: the connection is refused at once
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(MpadviseError, match="cannot open the Optuna study storage") as refused:
        check_storage(f"postgresql://tuner@127.0.0.1:{port}/studies")
    assert not isinstance(refused.value, UsageError)


def test_the_command_line_wins_over_the_environment(tmp_path):
    assert resolve_storage("sqlite:///a.db", {STORAGE_ENV: "postgresql://u@db/s"}) == "sqlite:///a.db"
    # The file is not even read when the command line names the storage.
    assert resolve_storage("sqlite:///a.db", {STORAGE_FILE_ENV: str(tmp_path / "missing")}) == "sqlite:///a.db"
    assert resolve_storage(None, {STORAGE_ENV: " postgresql://u@db/s "}) == "postgresql://u@db/s"
    assert resolve_storage(None, {STORAGE_ENV: ""}) is None
    assert resolve_storage(None, {}) is None


def test_a_private_file_holds_the_url(tmp_path):
    path = tmp_path / "storage-url"
    path.write_text(f"\npostgresql://tuner:{SECRET}@db/studies\n")
    path.chmod(0o600)
    assert resolve_storage(None, {STORAGE_FILE_ENV: str(path)}) == f"postgresql://tuner:{SECRET}@db/studies"


@pytest.mark.parametrize(("setup", "words"), [
    ("readable", "others may read it (mode 640)"),
    ("missing", "cannot read"),
    ("empty", "is empty"),
    ("both", "both MPADVISE_STORAGE and MPADVISE_STORAGE_FILE are set"),
])
def test_a_storage_file_that_is_not_private_or_not_there_is_refused_in_one_line(tmp_path, setup, words):
    path = tmp_path / "storage-url"
    environ = {STORAGE_FILE_ENV: str(path)}
    if setup == "readable":
        path.write_text("postgresql://tuner:pw@db/studies\n")
        path.chmod(0o640)
    elif setup == "empty":
        path.write_text("\n")
        path.chmod(0o600)
    elif setup == "both":
        environ[STORAGE_ENV] = "postgresql://u@db/s"
    with pytest.raises(UsageError) as caught:
        resolve_storage(None, environ)
    message = str(caught.value)
    assert words in message and "\n" not in message and "pw" not in message


def test_the_tune_command_takes_the_storage_from_the_environment_and_never_shows_its_password(tmp_path, cache_home):
    script = tmp_path / "train.py"
    script.write_text("import advisor\nmp = advisor.load_policy()\n")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"postgresql://tuner:{SECRET}@127.0.0.1:{port}/studies"
    result = CliRunner().invoke(app, ["tune", str(script), "--json", "--device", "cpu"], env={STORAGE_ENV: url})
    assert result.exit_code == 1, result.output
    assert f"cannot open the Optuna study storage 'postgresql://tuner:***@127.0.0.1:{port}/studies'" in result.output
    assert "s3" not in result.output and "Traceback" not in result.output


def test_the_tune_command_refuses_a_storage_file_others_can_read(tmp_path, cache_home):
    script = tmp_path / "train.py"
    script.write_text("import advisor\nmp = advisor.load_policy()\n")
    path = tmp_path / "storage-url"
    path.write_text("postgresql://tuner:pw@db/studies\n")
    path.chmod(0o644)
    result = CliRunner().invoke(app, ["tune", str(script), "--json"], env={STORAGE_FILE_ENV: str(path)})
    assert result.exit_code == 2
    assert "refusing MPADVISE_STORAGE_FILE=" in result.output and "chmod 600" in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_the_study_file_in_the_cache_is_private(cache_home):
    previous = os.umask(0o022)  # the usual umask, under which SQLite would make it 0644
    try:
        url = default_storage()
        check_storage(url)  # Optuna opens it and makes its tables
    finally:
        os.umask(previous)
    study = cache_home / "studies.db"
    assert url == f"sqlite:///{study}"
    assert study.stat().st_size > 0
    assert stat.S_IMODE(study.stat().st_mode) == 0o600

