"""Private paths: the owner and mode checks, creation 0700/0600, and the cache refusing the rest."""

from __future__ import annotations

import logging
import os
import stat

import pytest

from advisor._secure import (
    ensure_private_dir,
    ensure_private_file,
    needs_tightening,
    open_private_new,
    unsafe_reason,
)
from advisor.cache import _store
from advisor.cache._store import Store, open_store
from probes import MpadviseError

ME = 1000


def _status(mode: int, uid: int = ME) -> os.stat_result:
    return os.stat_result((mode, 0, 0, 1, uid, uid, 0, 0, 0, 0))


@pytest.mark.parametrize(("mode", "is_dir", "expected"), [
    (stat.S_IFDIR | 0o700, True, None),
    (stat.S_IFDIR | 0o755, True, None),  # readable only: tightened, not refused
    (stat.S_IFDIR | 0o777, True, "writable by others"),
    (stat.S_IFDIR | 0o1777, True, "writable by others"),
    (stat.S_IFDIR | 0o770, True, "writable by its group"),
    (stat.S_IFREG | 0o600, True, "not a directory"),
    (stat.S_IFREG | 0o600, False, None),
    (stat.S_IFREG | 0o644, False, None),
    (stat.S_IFREG | 0o666, False, "writable by others"),
    (stat.S_IFREG | 0o620, False, "writable by its group"),
    (stat.S_IFLNK | 0o777, False, "a symbolic link"),
    (stat.S_IFDIR | 0o700, False, "not a regular file"),
])
def test_unsafe_reason_by_mode(mode, is_dir, expected):
    assert unsafe_reason(_status(mode), uid=ME, is_dir=is_dir) == expected


@pytest.mark.parametrize("is_dir", [True, False])
def test_unsafe_reason_refuses_someone_elses_path_whatever_its_mode(is_dir):
    kind = stat.S_IFDIR if is_dir else stat.S_IFREG
    reason = unsafe_reason(_status(kind | 0o600, uid=65534), uid=ME, is_dir=is_dir)
    assert reason is not None and "owned by uid 65534" in reason


def test_needs_tightening_when_anyone_else_may_read():
    assert needs_tightening(_status(stat.S_IFDIR | 0o755))
    assert needs_tightening(_status(stat.S_IFREG | 0o640))
    assert not needs_tightening(_status(stat.S_IFREG | 0o600))


def test_private_dir_is_created_0700(tmp_path):
    path = ensure_private_dir(tmp_path / "a" / "cache")
    assert stat.S_IMODE(path.stat().st_mode) == 0o700


def test_own_readable_dir_is_tightened_not_refused(tmp_path):
    path = tmp_path / "old-cache"
    path.mkdir()
    path.chmod(0o755)
    ensure_private_dir(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o700


@pytest.mark.parametrize("mode", [0o777, 0o1777, 0o775])
def test_writable_dir_is_refused_with_the_fix(tmp_path, mode):
    path = tmp_path / "shared"
    path.mkdir()
    path.chmod(mode)
    with pytest.raises(MpadviseError, match="MPADVISE_HOME") as refused:
        ensure_private_dir(path)
    assert str(path) in str(refused.value) and "\n" not in str(refused.value)
    assert stat.S_IMODE(path.stat().st_mode) == mode  # refused, not silently changed


def test_private_file_checks(tmp_path):
    assert ensure_private_file(tmp_path / "missing") is False
    readable = tmp_path / "readable"
    readable.write_text("x")
    readable.chmod(0o644)
    assert ensure_private_file(readable) is True
    assert stat.S_IMODE(readable.stat().st_mode) == 0o600
    writable = tmp_path / "writable"
    writable.write_text("x")
    writable.chmod(0o666)
    with pytest.raises(MpadviseError, match="writable by others"):
        ensure_private_file(writable)
    link = tmp_path / "link"
    link.symlink_to(readable)
    with pytest.raises(MpadviseError, match="symbolic link"):
        ensure_private_file(link)


def test_open_private_new_never_follows_or_reuses(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("keep")
    link = tmp_path / "link"
    link.symlink_to(victim)
    with pytest.raises(OSError):
        open_private_new(link)
    with pytest.raises(FileExistsError):
        open_private_new(victim)
    assert victim.read_text() == "keep"
    fd = open_private_new(tmp_path / "new")
    os.close(fd)
    assert stat.S_IMODE((tmp_path / "new").stat().st_mode) == 0o600


def test_store_creates_a_private_directory_and_database(tmp_path):
    with Store(tmp_path / "home" / "mpadvise.db") as store:
        store.put_hardware("f" * 16, {"name": "test"})
    assert stat.S_IMODE((tmp_path / "home").stat().st_mode) == 0o700
    for name in ("mpadvise.db", "mpadvise.db-wal", "mpadvise.db-shm"):
        path = tmp_path / "home" / name
        if path.exists():
            assert stat.S_IMODE(path.stat().st_mode) == 0o600, name


def test_store_tightens_an_older_cache_of_its_own(tmp_path):
    home = tmp_path / "home"
    Store(home / "mpadvise.db").close()
    home.chmod(0o755)
    (home / "mpadvise.db").chmod(0o644)
    Store(home / "mpadvise.db").close()
    assert stat.S_IMODE(home.stat().st_mode) == 0o700
    assert stat.S_IMODE((home / "mpadvise.db").stat().st_mode) == 0o600


def test_store_refuses_a_database_others_may_write(tmp_path):
    home = tmp_path / "home"
    Store(home / "mpadvise.db").close()
    (home / "mpadvise.db").chmod(0o666)
    with pytest.raises(MpadviseError, match="writable by others"):
        Store(home / "mpadvise.db")


def test_unsafe_cache_degrades_to_no_cache_with_one_warning(tmp_path, caplog):
    home = tmp_path / "shared"
    home.mkdir()
    home.chmod(0o777)
    path = home / "mpadvise.db"
    _store._warned_no_cache.discard(str(path))
    with caplog.at_level(logging.WARNING, logger="mpadvise"):
        assert open_store(path) is None
        assert open_store(path) is None
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and str(home) in warnings[0].getMessage()
    assert not path.exists()  # nothing was written into it
