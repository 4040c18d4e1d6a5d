"""Recommendations, their trials and hardware profiles: the Store's queries, export and import.
One (hardware, workload) key holds one answer: a new answer replaces the old row and its
trials in one transaction, so a concurrent reader sees the old one or the new one, complete."""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from advisor.cache._base import StoreBase, guarded
from advisor.cache._records import (
    _JSON_FIELDS,
    _TRIAL_JSON,
    TRIAL_FIELDS,
    Record,
    check_hardware_fp,
    decode_json,
    encoded,
    export_document,
    json_text,
    recommendation_row,
    trial_rows,
    utc_now,
    validated_record,
)
from probes import MpadviseError, write_file_atomic

if TYPE_CHECKING:
    import sqlite_utils


@dataclass(frozen=True)
class ImportedIds:
    """What an import wrote: ``(exported id, id here)`` per record written; the exported id is
    ``None`` for a file from before ids were exported."""

    ids: tuple[tuple[int | None, int], ...] = ()

    @property
    def written(self) -> int:
        return len(self.ids)

    @property
    def renumbered(self) -> tuple[tuple[int, int], ...]:
        """``(exported id, new id)`` for each record whose id was taken here."""
        return tuple((old, new) for old, new in self.ids if old is not None and old != new)


class Recommendations(StoreBase):
    @guarded
    def put_hardware(self, fingerprint: str, profile: dict[str, Any]) -> None:
        check_hardware_fp("fingerprint", fingerprint)
        text = json_text("profile", profile, require_dict=True)
        with self._write() as db:
            upsert_hardware(db, fingerprint, text, utc_now())

    @guarded
    def put_recommendation(self, *, hardware_fp: str, workload_fp: str, script: str | None, policy: dict[str, Any],
                           speedup_vs_fp32: float | None, goodput: float, versions: dict[str, Any],
                           summary: dict[str, Any], trials: Sequence[dict[str, Any]]) -> int:
        """Store the answer for one (hardware, workload) key, replacing any earlier one; its id."""
        record = {**validated_record({
            "hardware_fp": hardware_fp, "workload_fp": workload_fp, "script": script, "policy": policy,
            "speedup_vs_fp32": speedup_vs_fp32, "goodput": goodput, "versions": versions,
            "summary": summary, "trials": list(trials),
        }), "created_at": utc_now()}
        with self._write() as db:
            return replace_recommendation(db, record)

    @guarded
    def clear(self, older_than: datetime.timedelta | None = None) -> int:
        """Delete recommendations (all, or those older than ``older_than``) with their trials, and
        the guard's events of the same age; returns how many recommendations went."""
        with self._write() as db:
            where, params = "1", []
            if older_than is not None:
                cutoff = datetime.datetime.now(datetime.timezone.utc) - older_than
                where, params = "created_at < ?", [cutoff.isoformat(timespec="microseconds")]
            db.execute(f"DELETE FROM guard_events WHERE {where}", params)
            return delete_recommendations(db, where, params)

    @guarded
    def get(self, recommendation_id: int) -> Record | None:
        with self._read() as db:
            rows = select_recommendations(db, "r.id = ?", [recommendation_id])
            return attach_trials(db, rows[0]) if rows else None

    @guarded
    def find_recommendations(self, *, hardware_fp: str | None = None, script: str | None = None,
                             workload_fp: str | None = None, with_trials: bool = False) -> list[Record]:
        """Recommendations matching every given filter, newest first. A ``script`` path matches the
        stored path exactly (elsewhere is another workload); a bare file name, its base name."""
        bare_name = script is not None and os.path.basename(script) == script
        clauses, params = [], []
        for clause, value in (("r.hardware_fp = ?", hardware_fp), ("r.workload_fp = ?", workload_fp),
                              ("r.script = ?", None if bare_name else script)):
            if value is not None:
                clauses.append(clause)
                params.append(value)
        if bare_name:
            # Filtered in SQL, so that a lookup does not decode every row of this hardware; LIKE
            # ignores case, so the exact test follows.
            escaped = script.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
            clauses.append("(r.script = ? OR r.script LIKE ? ESCAPE '\\')")
            params += [script, f"%/{escaped}"]
        with self._read() as db:
            rows = select_recommendations(db, " AND ".join(clauses) or "1", params)
            if bare_name:
                rows = [row for row in rows if os.path.basename(row["script"]) == script]
            if with_trials:
                rows = [attach_trials(db, row) for row in rows]
            return rows

    def list_recommendations(self, *, with_trials: bool = False) -> list[Record]:
        return self.find_recommendations(with_trials=with_trials)

    @guarded
    def export_records(self, path: Path | str, *, ids: Iterable[int] | None = None) -> int:
        """Write recommendations (only ``ids`` when given) to a JSON file whole; how many."""
        with self._read() as db:
            rows = select_recommendations(db, "1", []) if ids is None else []
            for recommendation_id in ids or ():
                found = select_recommendations(db, "r.id = ?", [recommendation_id])
                if not found:
                    raise MpadviseError(f"recommendation {recommendation_id!r} is not in the cache "
                                        f"{self.path}; `mpadvise show` lists the ids")
                rows.extend(found)
            rows = [attach_trials(db, row) for row in rows]
        try:
            write_file_atomic(Path(path), json.dumps(export_document(rows), indent=2, sort_keys=True) + "\n")
        except OSError as exc:
            raise MpadviseError(f"cannot write {path}: {exc.strerror or exc}") from exc
        return len(rows)

    @guarded
    def import_validated(self, records: Sequence[Record]) -> ImportedIds:
        """Write records that ``read_export`` returned, in one transaction, each unless the cached
        one for its key is newer (an old file never undoes a fresh tune). A record keeps its
        exported id where it is free, so that ``#3`` means the same entry on both machines."""
        ids: list[tuple[int | None, int]] = []
        with self._write() as db:
            # Those whose id another entry holds go last, so that a new id given to one of them
            # never takes the free id of a record later in the file.
            later = sorted((record for record in records if _id_held_by_another(db, record)),
                           key=lambda record: record["id"])
            first = [record for record in records if not any(record is other for other in later)]
            for record in (*first, *later):
                if record["hardware"] is not None:
                    upsert_hardware(db, record["hardware_fp"], encoded(record["hardware"]), record["created_at"])
                existing = list(db.query(
                    "SELECT created_at FROM recommendations WHERE hardware_fp = ? AND workload_fp = ?",
                    [record["hardware_fp"], record["workload_fp"]],
                ))
                if existing and existing[0]["created_at"] > record["created_at"]:
                    continue
                ids.append((record.get("id"), replace_recommendation(db, record)))
        return ImportedIds(tuple(sorted(ids, key=lambda pair: (pair[0] is None, pair[0] or 0, pair[1]))))


# The SQL under those methods, run inside the transaction the method has begun.


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


def _id_held_by_another(db: sqlite_utils.Database, record: Record) -> bool:
    """Whether an entry of another key holds the id ``record`` was exported with."""
    held = list(db.query("SELECT hardware_fp, workload_fp FROM recommendations WHERE id = ?", [record.get("id")]))
    return bool(held) and (held[0]["hardware_fp"], held[0]["workload_fp"]) != (
        record["hardware_fp"], record["workload_fp"])
