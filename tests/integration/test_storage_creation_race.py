"""Processes that open one fresh SQLite study storage at the same moment all get it.

Two tunes started together on ``--storage sqlite:///shared.db``, or ``mpadvise study status``
run while a tune starts, race to make the same tables and to stamp the schema's version. The
losers once ended with "cannot open the Optuna study storage ...: table studies already exists"
(or "table alembic_version already exists", or "UNIQUE constraint failed:
alembic_version.version_num" for the status): in 12 of 30 rounds of this test on the 2-core
build machine. Real processes (forked once the modules are imported, so that they start
together) and real SQLite files.
"""

from __future__ import annotations

import multiprocessing

import pytest

from advisor.tune._study_status import check_storage, study_status

OPENERS = 4
ROUNDS = 12

pytestmark = pytest.mark.slow


def _open(url: str, start: multiprocessing.synchronize.Barrier, errors: multiprocessing.Queue) -> None:
    start.wait()
    try:
        check_storage(url)
    except Exception as exc:  # what the tune would have ended with
        errors.put(f"open: {exc}")


def _status(url: str, start: multiprocessing.synchronize.Barrier, opened: multiprocessing.synchronize.Event,
            errors: multiprocessing.Queue) -> None:
    start.wait()
    while not opened.is_set():  # a status polled while the tunes make the storage
        try:
            study_status(url)
        except Exception as exc:
            if "does not exist" not in str(exc):  # not made yet at all: status says so, rightly
                errors.put(f"status: {exc}")
                return


def test_processes_opening_a_fresh_storage_together_all_get_it(tmp_path):
    context = multiprocessing.get_context("fork")
    failed = []
    for round_ in range(ROUNDS):
        url = f"sqlite:///{tmp_path / f'studies-{round_}.db'}"
        start, opened, errors = context.Barrier(OPENERS + 1), context.Event(), context.Queue()
        processes = [context.Process(target=_open, args=(url, start, errors)) for _ in range(OPENERS)]
        processes.append(context.Process(target=_status, args=(url, start, opened, errors)))
        for process in processes:
            process.start()
        for process in processes[:OPENERS]:
            process.join(timeout=120)
        opened.set()
        processes[-1].join(timeout=120)
        assert all(process.exitcode == 0 for process in processes), [process.exitcode for process in processes]
        while not errors.empty():
            failed.append(f"round {round_ + 1}: {errors.get()}")
    assert not failed, failed
    # and the storage they made is whole: a study can be read from it
    assert study_status(url) == []
