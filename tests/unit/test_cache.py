"""The cache store: schema, recommendations, export/import, jobs, and damaged or missing files.

Read-only cache directories cannot be simulated with chmod here because the tests run as
root, which ignores file modes; a path below a regular file (and one below /proc) is used
instead: both make the directory impossible to create, whoever runs the test.
"""

from __future__ import annotations

import datetime
import json
import logging
import sqlite3
import statistics
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from advisor._paths import cache_dir, database_path
from advisor.cache import _migrations, _recommendations
from advisor.cache import _store as _cache
from advisor.cache._migrations import SCHEMA_VERSION, migrate, migration
from advisor.cache._records import EXPORT_FORMAT, EXPORT_FORMAT_VERSION, RECORD_FIELDS, read_export
from advisor.cache._store import Store, open_store
from probes._errors import MpadviseError

HW = "0123456789abcdef"
HW_OTHER = "fedcba9876543210"
WL = "00000000000000aa"
WL_OTHER = "00000000000000bb"


def _trials(count: int, mode: str = "bf16-mixed") -> list[dict[str, Any]]:
    return [
        {
            "number": number,
            "mode": mode,
            "params": {"micro_batch_size": 32},
            "outcome": "ok",
            "verdict": "stable",
            "reason": None,
            "goodput": 100.0 + number,
            "metrics": {"losses": [1.0, 0.5]},
        }
        for number in range(count)
    ]


def _put(store: Store, **overrides: Any) -> int:
    fields: dict[str, Any] = {
        "hardware_fp": HW,
        "workload_fp": WL,
        "script": "/home/me/train.py",
        "policy": {"mode": "bf16-mixed", "micro_batch_size": 32},
        "speedup_vs_fp32": 1.8,
        "goodput": 1234.5,
        "versions": {"torch": "2.13.0"},
        "summary": {"trial_count": 3},
        "trials": _trials(3),
    }
    fields.update(overrides)
    return store.put_recommendation(**fields)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    with Store(tmp_path / "cache" / "mpadvise.db") as opened:
        yield opened


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        record.getMessage()
        for record in caplog.records
        if record.name == "mpadvise" and record.levelno == logging.WARNING
    ]


# -- paths ----------------------------------------------------------------------------------


def test_cache_dir_prefers_mpadvise_home_then_xdg_then_home(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("MPADVISE_HOME", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "explicit"
    monkeypatch.delenv("MPADVISE_HOME")
    assert cache_dir() == tmp_path / "xdg" / "mpadvise"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/ignored")
    assert cache_dir() == tmp_path / "home" / ".cache" / "mpadvise"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert database_path() == tmp_path / "home" / ".cache" / "mpadvise" / "mpadvise.db"
    assert not (tmp_path / "home").exists()


def test_store_defaults_to_database_path(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("MPADVISE_HOME", str(tmp_path / "home"))
    with Store() as store:
        assert store.path == tmp_path / "home" / "mpadvise.db"
    assert store.path.exists()


# -- schema -----------------------------------------------------------------------------------


def test_schema_is_created_in_wal_mode_with_its_version_recorded(store: Store) -> None:
    conn = sqlite3.connect(store.path)
    try:
        tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master")}
        assert {"_migrations", "hardware", "recommendations", "trials", "jobs"} <= tables
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        applied = [row[0] for row in conn.execute("SELECT name FROM _migrations")]
        assert applied == [name for name, _ in _migrations._MIGRATIONS]
        # The lookup is served by the unique (hardware_fp, workload_fp) index.
        plan = conn.execute(
            "EXPLAIN QUERY PLAN SELECT * FROM recommendations "
            "WHERE hardware_fp = ? AND workload_fp = ?",
            [HW, WL],
        ).fetchall()
        assert "idx_recommendations_hardware_fp_workload_fp" in str(plan)
    finally:
        conn.close()
    assert store.db.execute("PRAGMA busy_timeout").fetchone()[0] == 30000
    assert store.db.execute("PRAGMA synchronous").fetchone()[0] == 1  # NORMAL


def test_migrate_applies_only_missing_migrations(
    monkeypatch: pytest.MonkeyPatch, store: Store
) -> None:
    assert migrate(store.db) == []
    calls = []
    monkeypatch.setattr(_migrations, "_MIGRATIONS", list(_migrations._MIGRATIONS))

    @migration
    def m999_add_notes(db: Any) -> None:
        calls.append(db)
        db.execute("ALTER TABLE recommendations ADD COLUMN notes TEXT")

    assert migrate(store.db) == ["m999_add_notes"]
    assert migrate(store.db) == []
    assert len(calls) == 1
    assert "notes" in store.db.table("recommendations").columns_dict
    assert store.db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION + 1
    with pytest.raises(ValueError, match="m999_add_notes"):
        migration(m999_add_notes)


# -- recommendations --------------------------------------------------------------------------


def test_put_and_get_round_trip_with_trials_and_hardware(store: Store) -> None:
    store.put_hardware(HW, {"kind": "cpu", "name": "Test CPU"})
    recommendation_id = _put(store)
    record = _get(store, HW, WL)
    assert record is not None
    assert record["id"] == recommendation_id
    assert record["mode"] == "bf16-mixed"
    assert record["policy"] == {"mode": "bf16-mixed", "micro_batch_size": 32}
    assert record["speedup_vs_fp32"] == 1.8 and record["goodput"] == 1234.5
    assert record["versions"] == {"torch": "2.13.0"}
    assert record["hardware"] == {"kind": "cpu", "name": "Test CPU"}
    assert record["trials"] == _trials(3)
    assert store.get(recommendation_id) == record
    assert _get(store, HW, WL_OTHER) is None
    assert _get(store, HW_OTHER, WL) is None
    assert store.get(recommendation_id + 100) is None


def test_a_new_tune_of_the_same_key_replaces_row_and_trials(store: Store) -> None:
    first = _put(store)
    second = _put(store, policy={"mode": "fp16-mixed"}, trials=_trials(2, "fp16-mixed"))
    assert store.get(first) is None or first == second
    records = store.list_recommendations(with_trials=True)
    assert len(records) == 1
    assert records[0]["mode"] == "fp16-mixed"
    assert [trial["mode"] for trial in records[0]["trials"]] == ["fp16-mixed"] * 2
    assert store.db.execute("SELECT COUNT(*) FROM trials").fetchone()[0] == 2


def test_find_filters_by_hardware_workload_and_script_name(store: Store) -> None:
    _put(store)
    _put(store, workload_fp=WL_OTHER, script="/elsewhere/eval.py")
    _put(store, hardware_fp=HW_OTHER, script=None)
    assert len(store.list_recommendations()) == 3
    assert {r["workload_fp"] for r in store.find_recommendations(hardware_fp=HW)} == {WL, WL_OTHER}
    assert [r["script"] for r in store.find_recommendations(script="train.py")] == [
        "/home/me/train.py"
    ]
    assert len(store.find_recommendations(script="/elsewhere/eval.py")) == 1
    assert store.find_recommendations(hardware_fp=HW, workload_fp=WL_OTHER)[0]["script"] == (
        "/elsewhere/eval.py"
    )
    assert "trials" not in store.find_recommendations(hardware_fp=HW)[0]
    assert store.find_recommendations(hardware_fp="0000000000000000") == []


def test_clear(store: Store) -> None:
    old = _put(store)
    recent = _put(store, workload_fp=WL_OTHER)
    store.db.execute(
        "UPDATE recommendations SET created_at = '2020-01-01T00:00:00.000000+00:00' WHERE id = ?",
        [old],
    )
    assert store.clear(older_than=datetime.timedelta(days=30)) == 1
    assert [r["id"] for r in store.list_recommendations()] == [recent]
    _put(store)
    _put(store, workload_fp=WL_OTHER)
    assert store.clear() == 2
    assert store.list_recommendations() == []
    assert store.db.execute("SELECT COUNT(*) FROM trials").fetchone()[0] == 0


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"workload_fp": "not-hex"}, "workload_fp"),
        ({"hardware_fp": ""}, "hardware_fp"),
        ({"hardware_fp": "has space"}, "hardware_fp"),
        ({"policy": {"micro_batch_size": 32}}, "policy.mode"),
        ({"policy": {"mode": "BF16 Mixed"}}, "policy.mode"),
        ({"policy": "bf16-mixed"}, "policy"),
        ({"goodput": float("nan")}, "goodput"),
        ({"goodput": "fast"}, "goodput"),
        ({"speedup_vs_fp32": True}, "speedup_vs_fp32"),
        ({"summary": {"loss": float("inf")}}, "summary"),
        ({"versions": {"torch": object()}}, "versions"),
        ({"trials": [{"number": 0, "duration": 1.0}]}, "trials[0]"),
        ({"trials": [{"number": "1"}]}, "trials[0].number"),
        ({"trials": [{}, {"metrics": [1, 2]}]}, "trials[1].metrics"),
    ],
)
def test_put_recommendation_rejects_bad_fields_by_name(
    store: Store, overrides: dict[str, Any], field: str
) -> None:
    with pytest.raises(MpadviseError) as caught:
        _put(store, **overrides)
    assert str(caught.value).startswith(field)
    assert store.list_recommendations() == []


def _get(store: Store, hardware_fp: str, workload_fp: str) -> dict[str, Any] | None:
    rows = store.find_recommendations(hardware_fp=hardware_fp, workload_fp=workload_fp, with_trials=True)
    return rows[0] if rows else None


def _hardware(store: Store, fingerprint: str) -> dict[str, Any] | None:
    rows = list(store.db.query("SELECT * FROM hardware WHERE fingerprint = ?", [fingerprint]))
    return {**rows[0], "profile": json.loads(rows[0]["profile"])} if rows else None


def _import(store: Store, path: Path, validate: Any = None) -> int:
    check = None if validate is None else lambda record: validate(record["hardware_fp"], record["hardware"])
    return store.import_validated(read_export(Path(path), check=check)).written


def test_put_hardware_keeps_first_seen_and_refreshes_profile(store: Store) -> None:
    store.put_hardware(HW, {"kind": "cpu", "name": "old"})
    first = _hardware(store, HW)
    store.put_hardware(HW, {"kind": "cpu", "name": "new"})
    second = _hardware(store, HW)
    assert second["profile"] == {"kind": "cpu", "name": "new"}
    assert second["first_seen"] == first["first_seen"]
    assert second["last_seen"] >= first["last_seen"]
    assert [row[0] for row in store.db.execute("SELECT fingerprint FROM hardware")] == [HW]
    assert _hardware(store, HW_OTHER) is None


def _fill(store: Store, directory: Path, count: int) -> None:
    """Add ``count`` recommendations in one transaction (through import, the bulk path)."""
    records = [
        _good_record(workload_fp=f"{index:016x}", trials=_trials(2), summary={"n": index})
        for index in range(count)
    ]
    path = directory / f"fill-{count}.json"
    path.write_text(json.dumps(_export_document(records)))
    assert _import(store, path) == count


def test_lookup_takes_milliseconds_with_a_thousand_recommendations(
    store: Store, tmp_path: Path
) -> None:
    _fill(store, tmp_path, 1000)
    timings = []
    for index in range(0, 1000, 10):
        started = time.perf_counter()
        record = _get(store, HW, f"{index:016x}")
        timings.append(time.perf_counter() - started)
        assert record is not None and len(record["trials"]) == 2
    # Typically ~0.2 ms; the bound leaves room for a loaded 2-core CI machine.
    assert statistics.median(timings) < 0.010


def test_threads_can_share_one_store(store: Store) -> None:
    errors: list[BaseException] = []

    def write(worker: int) -> None:
        try:
            for index in range(10):
                _put(store, workload_fp=f"{worker:08x}{index:08x}", trials=_trials(2))
                _get(store, HW, f"{worker:08x}{index:08x}")
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(worker,)) for worker in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert len(store.list_recommendations()) == 40


# -- the record schema --------------------------------------------------------------------------


def test_stored_records_have_exactly_the_schema_fields(store: Store, tmp_path: Path) -> None:
    store.put_hardware(HW, {"kind": "cpu", "name": "Test CPU"})
    _put(store)
    record = _get(store, HW, WL)
    assert set(record) == {field.name for field in RECORD_FIELDS}
    listed = store.find_recommendations(hardware_fp=HW)[0]
    assert set(listed) == {field.name for field in RECORD_FIELDS} - {"trials"}
    exported = tmp_path / "recs.json"
    store.export_records(exported)
    (entry,) = json.loads(exported.read_text())["records"]
    assert set(entry) == {field.name for field in RECORD_FIELDS if field.origin != "store"}


def test_the_daemon_serves_stored_records_through_the_same_schema(store: Store) -> None:
    from advisor.daemon._models import Recommendation

    _put(store, script=None, speedup_vs_fp32=None)
    for record in (_get(store, HW, WL), store.list_recommendations()[0]):
        served = Recommendation.model_validate(record).model_dump(exclude_unset=True)
        assert served == record
    assert list(Recommendation.model_fields) == [field.name for field in RECORD_FIELDS]


# -- export and import ------------------------------------------------------------------------


def test_export_then_import_round_trips_records_profiles_and_trials(
    store: Store, tmp_path: Path
) -> None:
    store.put_hardware(HW, {"kind": "cpu", "name": "Test CPU"})
    first = _put(store)
    _put(store, workload_fp=WL_OTHER, trials=[])
    exported = tmp_path / "recs.json"
    assert store.export_records(exported) == 2
    document = json.loads(exported.read_text())
    assert document["format"] == EXPORT_FORMAT
    assert document["format_version"] == EXPORT_FORMAT_VERSION
    assert {r["workload_fp"] for r in document["records"]} == {WL, WL_OTHER}
    assert document["records"][0]["hardware"] == {"kind": "cpu", "name": "Test CPU"}

    with Store(tmp_path / "other.db") as other:
        assert _import(other, exported) == 2
        imported = _get(other, HW, WL)
        original = store.get(first)
        for key in ("policy", "trials", "summary", "versions", "created_at", "hardware"):
            assert imported[key] == original[key]
        assert _hardware(other, HW)["profile"] == {"kind": "cpu", "name": "Test CPU"}

    only_first = tmp_path / "one.json"
    assert store.export_records(only_first, ids=[first]) == 1
    with pytest.raises(MpadviseError, match="recommendation 999 is not in the cache"):
        store.export_records(tmp_path / "none.json", ids=[999])
    assert not (tmp_path / "none.json").exists()


def test_import_keeps_a_newer_local_answer(store: Store, tmp_path: Path) -> None:
    _put(store)
    exported = tmp_path / "recs.json"
    store.export_records(exported)
    _put(store, policy={"mode": "fp16-mixed"})  # a fresh local tune after the export
    assert _import(store, exported) == 0
    assert _get(store, HW, WL)["mode"] == "fp16-mixed"


def _export_document(records: list[dict[str, Any]]) -> dict[str, Any]:
    return {"format": EXPORT_FORMAT, "format_version": EXPORT_FORMAT_VERSION, "records": records}


def _good_record(**overrides: Any) -> dict[str, Any]:
    record = {
        "hardware_fp": HW,
        "workload_fp": WL,
        "script": "train.py",
        "policy": {"mode": "bf16-mixed"},
        "speedup_vs_fp32": 1.5,
        "goodput": 10.0,
        "created_at": "2026-01-02T03:04:05Z",
        "versions": {},
        "summary": {},
        "hardware": None,
        "trials": [],
    }
    record.update(overrides)
    return record


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ("{not json", "is not an mpadvise export: invalid JSON at line 1 column 2"),
        (json.dumps({"format": "optuna-study"}), "expected format 'mpadvise-recommendations'"),
        (json.dumps([1, 2]), "is not an mpadvise export"),
        (
            json.dumps({"format": EXPORT_FORMAT, "format_version": 99, "records": []}),
            "written by a newer mpadvise (format_version 99",
        ),
        (
            json.dumps({"format": EXPORT_FORMAT, "format_version": 1, "records": {}}),
            "'records' must be a list",
        ),
        (
            json.dumps(_export_document([_good_record(), _good_record(workload_fp="xyz")])),
            "record 1: workload_fp must be 16 to 64 lowercase hex characters, got 'xyz'",
        ),
        (
            json.dumps(_export_document([_good_record(policy={"precision": "bf16"})])),
            "record 0: policy.mode must be a mode name",
        ),
        (
            json.dumps(_export_document([_good_record(created_at="yesterday")])),
            "record 0: created_at must be an ISO 8601 timestamp",
        ),
        (
            json.dumps(_export_document([_good_record(trials=[{"number": 0, "loss": 1}])])),
            "record 0: trials[0] has unknown field 'loss'",
        ),
        (
            json.dumps(
                _export_document([{k: v for k, v in _good_record().items() if k != "goodput"}])
            ),
            "record 0: required field 'goodput' is missing",
        ),
    ],
)
def test_import_refuses_bad_files_whole_with_one_clear_line(
    store: Store, tmp_path: Path, content: str, expected: str
) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    with pytest.raises(MpadviseError) as caught:
        _import(store, bad)
    message = str(caught.value)
    assert str(bad) in message
    assert expected in message
    assert "\n" not in message
    # Validation runs before any write: the good record 0 of a bad file is not imported.
    assert store.list_recommendations() == []


def test_import_asks_the_caller_to_vouch_for_each_hardware(store: Store, tmp_path: Path) -> None:
    path = tmp_path / "recs.json"
    path.write_text(
        json.dumps(
            _export_document(
                [_good_record(), _good_record(hardware_fp=HW_OTHER, hardware={"kind": "cuda"})]
            )
        )
    )
    seen = []

    def validate(fingerprint: str, profile: dict[str, Any] | None) -> None:
        seen.append((fingerprint, profile))
        if fingerprint == HW_OTHER:
            raise MpadviseError("fingerprint does not match its profile")

    with pytest.raises(MpadviseError, match="record 1: fingerprint does not match its profile"):
        _import(store, path, validate=validate)
    assert seen == [(HW, None), (HW_OTHER, {"kind": "cuda"})]
    assert store.list_recommendations() == []
    assert _import(store, path, validate=lambda fp, profile: None) == 2
    assert _get(store, HW, WL)["created_at"] == "2026-01-02T03:04:05.000000+00:00"


def test_import_of_a_missing_file_names_it(store: Store, tmp_path: Path) -> None:
    with pytest.raises(MpadviseError, match=r"cannot read .*missing\.json"):
        _import(store, tmp_path / "missing.json")


# -- jobs ---------------------------------------------------------------------------------------


def test_jobs_are_claimed_oldest_first_and_respect_pinned_slots(store: Store) -> None:
    first = store.enqueue_job(script="a.py", args=["--epochs", "1"], options={"trials": 8})
    pinned = store.enqueue_job(script="b.py", gpu="cuda:1")
    third = store.enqueue_job(script="c.py")
    assert [job["id"] for job in store.list_jobs()] == [first, pinned, third]
    claimed = store.claim_next_job("cuda:0")
    assert claimed["id"] == first and claimed["state"] == "running"
    assert claimed["gpu"] == "cuda:0" and claimed["started_at"] is not None
    assert claimed["args"] == ["--epochs", "1"] and claimed["options"] == {"trials": 8}
    # cuda:0 skips the job pinned to cuda:1.
    assert store.claim_next_job("cuda:0")["id"] == third
    assert store.claim_next_job("cuda:0") is None
    assert store.claim_next_job("cuda:1")["id"] == pinned
    assert store.list_jobs(states=["queued"]) == []


def test_job_progress_finish_and_cancel(store: Store) -> None:
    running = store.enqueue_job(script="a.py")
    queued = store.enqueue_job(script="b.py")
    store.claim_next_job("cpu")
    updated = store.update_job(running, progress={"trial": 3, "of": 8}, log_tail="trial 3")
    assert updated["progress"] == {"trial": 3, "of": 8} and updated["log_tail"] == "trial 3"
    assert store.cancel_job(queued)["state"] == "cancelled"
    assert store.cancel_job(running)["state"] == "cancelling"
    # The runner sees the request on its next progress update, stops and finishes the job.
    assert store.update_job(running, progress={"trial": 4})["state"] == "cancelling"
    finished = store.finish_job(running, state="cancelled", result={"stopped_at": 4})
    assert finished["state"] == "cancelled" and finished["finished_at"] is not None
    assert finished["log_tail"] == "trial 3"
    assert store.cancel_job(running)["state"] == "cancelled"
    assert store.cancel_job("no-such-job") is None
    assert store.get_job("no-such-job") is None
    with pytest.raises(MpadviseError, match="got 'done'"):
        store.finish_job(running, state="done")
    with pytest.raises(MpadviseError, match="job args must be a list of strings"):
        store.enqueue_job(script="a.py", args="--epochs 1")


def test_running_jobs_are_requeued_once_after_a_restart(store: Store) -> None:
    job = store.enqueue_job(script="a.py")
    store.claim_next_job("cuda:0")
    (requeued,) = store.requeue_interrupted()
    assert requeued["state"] == "queued" and requeued["attempts"] == 1
    assert requeued["gpu"] is None and requeued["started_at"] is None
    assert store.claim_next_job("cuda:1")["id"] == job
    (interrupted,) = store.requeue_interrupted()
    assert interrupted["state"] == "interrupted" and interrupted["finished_at"] is not None
    assert store.claim_next_job("cuda:0") is None
    assert store.requeue_interrupted() == []


# -- damaged, foreign and unusable files ------------------------------------------------------------


def _moved_aside(path: Path) -> list[Path]:
    """The moved-aside database files (their -wal/-shm companions left out)."""
    return sorted(
        aside
        for aside in path.parent.glob(f"{path.name}.corrupt-*")
        if not aside.name.endswith(("-wal", "-shm"))
    )


def _assert_fresh_and_usable(path: Path) -> None:
    with Store(path) as store:
        assert store.list_recommendations() == []
        _put(store)
        assert _get(store, HW, WL) is not None


def test_garbage_file_is_moved_aside_with_its_wal_and_a_warning_naming_both_paths(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "mpadvise.db"
    garbage = b"this is not a database, it is a shopping list\n" * 200
    path.write_bytes(garbage)
    Path(f"{path}-wal").write_bytes(b"stale wal")
    with caplog.at_level(logging.WARNING, logger="mpadvise"), Store(path) as store:
        assert store.list_recommendations() == []
    (aside,) = _moved_aside(path)
    assert aside.read_bytes() == garbage
    assert Path(f"{aside}-wal").read_bytes() == b"stale wal"
    (message,) = _warnings(caplog)
    assert str(path) in message and str(aside) in message
    _assert_fresh_and_usable(path)


@pytest.mark.parametrize("keep", [0.5, 60])
def test_truncated_database_is_moved_aside(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, keep: float
) -> None:
    path = tmp_path / "mpadvise.db"
    with Store(path) as store:
        _fill(store, tmp_path, 200)
    # Closing the last connection checkpoints the WAL into the main file.
    size = path.stat().st_size
    assert size > 100_000
    with open(path, "r+b") as handle:
        handle.truncate(int(size * keep) if keep < 1 else int(keep))
    with caplog.at_level(logging.WARNING, logger="mpadvise"), Store(path) as store:
        assert store.list_recommendations() == []
    assert len(_moved_aside(path)) == 1
    assert len(_warnings(caplog)) == 1
    _assert_fresh_and_usable(path)


def test_database_from_a_newer_schema_is_moved_aside(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "mpadvise.db"
    with Store(path) as store:
        _put(store)
        store.db.execute("INSERT INTO _migrations VALUES ('m050_from_the_future', 'x')")
        store.db.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 49}")
    with caplog.at_level(logging.WARNING, logger="mpadvise"), Store(path) as store:
        assert _get(store, HW, WL) is None
    (message,) = _warnings(caplog)
    assert "newer than this mpadvise understands" in message
    assert "m050_from_the_future" in message
    (aside,) = _moved_aside(path)
    assert str(aside) in message
    conn = sqlite3.connect(aside)
    try:
        # The moved file still holds its data, for a newer mpadvise to read.
        assert conn.execute("SELECT COUNT(*) FROM recommendations").fetchone()[0] == 1
    finally:
        conn.close()


def test_some_other_programs_database_is_moved_aside(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "mpadvise.db"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE recipes (name TEXT)")
    conn.commit()
    conn.close()
    with caplog.at_level(logging.WARNING, logger="mpadvise"):
        _assert_fresh_and_usable(path)
    assert "no mpadvise schema record" in _warnings(caplog)[0]
    assert len(_moved_aside(path)) == 1


def test_empty_file_is_a_fresh_database_not_a_damaged_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "mpadvise.db"
    path.touch()
    with caplog.at_level(logging.WARNING, logger="mpadvise"):
        _assert_fresh_and_usable(path)
    assert _warnings(caplog) == []
    assert _moved_aside(path) == []


def test_damage_found_mid_command_moves_the_file_aside_and_retries(
    store: Store, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _put(store)
    original = _recommendations.select_recommendations
    calls = []

    def damaged_once(*args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        if len(calls) == 1:
            raise sqlite3.DatabaseError("database disk image is malformed")
        return original(*args, **kwargs)

    monkeypatch.setattr(_recommendations, "select_recommendations", damaged_once)
    with caplog.at_level(logging.WARNING, logger="mpadvise"):
        # The retry runs on the fresh database, where the key is simply not cached.
        assert _get(store, HW, WL) is None
    assert len(calls) == 2
    assert len(_moved_aside(store.path)) == 1
    assert "database disk image is malformed" in _warnings(caplog)[0]
    _put(store)
    assert _get(store, HW, WL) is not None


@pytest.mark.parametrize(
    "make_path",
    [
        pytest.param(lambda tmp: tmp / "a-file" / "sub" / "mpadvise.db", id="below-a-file"),
        pytest.param(lambda tmp: Path("/proc/mpadvise-test/mpadvise.db"), id="below-proc"),
        pytest.param(lambda tmp: tmp / "a-directory", id="path-is-a-directory"),
    ],
)
def test_unusable_cache_location_degrades_to_no_cache_with_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, make_path: Any
) -> None:
    (tmp_path / "a-file").write_text("not a directory")
    (tmp_path / "a-directory").mkdir()
    path = make_path(tmp_path)
    _cache._warned_no_cache.discard(str(path))
    with pytest.raises(MpadviseError, match="MPADVISE_HOME"):
        Store(path)
    with caplog.at_level(logging.WARNING, logger="mpadvise"):
        assert open_store(path) is None
        assert open_store(path) is None
    (message,) = _warnings(caplog)
    assert "continuing without the cache" in message
    assert str(path.parent if path.name == "mpadvise.db" else path) in message


def test_closed_store_says_so(tmp_path: Path) -> None:
    store = Store(tmp_path / "mpadvise.db")
    store.close()
    with pytest.raises(MpadviseError, match="is closed"):
        store.list_recommendations()
