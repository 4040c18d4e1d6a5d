"""The SQL under the recommendation queries, run inside a transaction the caller has begun."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from advisor.cache._records import (
    _JSON_FIELDS,
    _TRIAL_JSON,
    TRIAL_FIELDS,
    Record,
    decode_json,
    recommendation_row,
    trial_rows,
)

if TYPE_CHECKING:
    import sqlite_utils


def select_recommendations(db: sqlite_utils.Database, where: str, params: Sequence[Any]) -> list[Record]:
    rows = db.query("SELECT r.*, h.profile AS hardware FROM recommendations r "
                    "LEFT JOIN hardware h ON h.fingerprint = r.hardware_fp "
                    f"WHERE {where} ORDER BY r.created_at DESC, r.id DESC", params)
    return [decode_json(row, _JSON_FIELDS) for row in rows]


def attach_trials(db: sqlite_utils.Database, row: Record) -> Record:
    trials = db.query(f"SELECT {', '.join(TRIAL_FIELDS)} FROM trials WHERE recommendation_id = ? ORDER BY number, id",
                      [row["id"]])
    row["trials"] = [decode_json(trial, _TRIAL_JSON) for trial in trials]
    return row


def upsert_hardware(db: sqlite_utils.Database, fingerprint: str, profile: str, seen: str) -> None:
    db.execute("INSERT INTO hardware (fingerprint, profile, first_seen, last_seen) VALUES (?, ?, ?, ?) "
               "ON CONFLICT(fingerprint) DO UPDATE SET profile = excluded.profile, "
               "last_seen = MAX(last_seen, excluded.last_seen), first_seen = MIN(first_seen, excluded.first_seen)",
               [fingerprint, profile, seen, seen])


def delete_recommendations(db: sqlite_utils.Database, where: str, params: Sequence[Any]) -> int:
    ids = [row["id"] for row in db.query(f"SELECT id FROM recommendations WHERE {where}", params)]
    for recommendation_id in ids:
        # Trials first: the foreign key forbids orphaning them.
        db.execute("DELETE FROM trials WHERE recommendation_id = ?", [recommendation_id])
        db.execute("DELETE FROM recommendations WHERE id = ?", [recommendation_id])
    return len(ids)


def replace_recommendation(db: sqlite_utils.Database, record: Record) -> int:
    delete_recommendations(db, "hardware_fp = ? AND workload_fp = ?", [record["hardware_fp"], record["workload_fp"]])
    table = db.table("recommendations")
    row = recommendation_row(record)
    wanted = record.get("id")  # an imported record's id, kept where it is free here
    if wanted is not None and not list(db.query("SELECT 1 FROM recommendations WHERE id = ?", [wanted])):
        row["id"] = wanted
    table.insert(row)
    recommendation_id = int(table.last_rowid)  # type: ignore[arg-type]
    rows = trial_rows(recommendation_id, record["trials"])
    if rows:
        db.table("trials").insert_all(rows)
    return recommendation_id
