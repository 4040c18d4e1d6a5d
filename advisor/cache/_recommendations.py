"""Recommendations, their trials and hardware profiles: the Store's queries, export and import.

:class:`Recommendations` is the part of the Store that holds the ``hardware``,
``recommendations`` and ``trials`` tables. What a record is, and how it is checked and
encoded, is :mod:`advisor.cache._records`; this module only runs the SQL. One
(hardware, workload) key holds one answer: a new answer replaces the old row and its trials
in one transaction.
"""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from advisor.cache._base import StoreBase, guarded
from advisor.cache._records import (
    TRIAL_FIELDS,
    Record,
    check_hardware_fp,
    decode_json,
    decode_recommendation,
    decode_trial,
    encoded,
    export_document,
    json_text,
    read_export,
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
    """What an import wrote: for each record written, ``(exported id, id here)``; the exported
    id is ``None`` for a file from before ids were exported."""

    ids: tuple[tuple[int | None, int], ...] = ()

    @property
    def written(self) -> int:
        """How many records were written."""
        return len(self.ids)

    @property
    def renumbered(self) -> tuple[tuple[int, int], ...]:
        """``(exported id, new id)`` for each record whose id was taken here."""
        return tuple((old, new) for old, new in self.ids if old is not None and old != new)


class Recommendations(StoreBase):
    """The answers of tunes, keyed by (hardware fingerprint, workload fingerprint)."""

    # -- hardware ----------------------------------------------------------------------

    @guarded
    def put_hardware(self, fingerprint: str, profile: dict[str, Any]) -> None:
        """Record (or refresh) the profile of one hardware fingerprint.

        Args:
            fingerprint: the hardware fingerprint.
            profile: the hardware profile as a JSON-ready dict.
        """
        check_hardware_fp("fingerprint", fingerprint)
        text = json_text("profile", profile, require_dict=True)
        with self._write() as db:
            _upsert_hardware(db, fingerprint, text, utc_now())

    @guarded
    def get_hardware(self, fingerprint: str) -> dict[str, Any] | None:
        """The stored row of one hardware fingerprint, with its profile decoded.

        Args:
            fingerprint: the hardware fingerprint.

        Returns:
            ``{"fingerprint", "profile", "first_seen", "last_seen"}``, or ``None``.
        """
        rows = list(self.db.query("SELECT * FROM hardware WHERE fingerprint = ?", [fingerprint]))
        return decode_json(rows[0], ("profile",)) if rows else None

    @guarded
    def list_hardware(self) -> list[dict[str, Any]]:
        """Every stored hardware profile, most recently seen first."""
        rows = self.db.query("SELECT * FROM hardware ORDER BY last_seen DESC")
        return [decode_json(row, ("profile",)) for row in rows]

    # -- recommendations ---------------------------------------------------------------

    @guarded
    def put_recommendation(
        self,
        *,
        hardware_fp: str,
        workload_fp: str,
        script: str | None,
        policy: dict[str, Any],
        speedup_vs_fp32: float | None,
        goodput: float,
        versions: dict[str, Any],
        summary: dict[str, Any],
        trials: Sequence[dict[str, Any]],
    ) -> int:
        """Store the answer for one (hardware, workload) key, replacing any earlier one.

        The old row, its trials, the new row and its trials change in one transaction, so a
        concurrent reader sees either the old recommendation or the new one, complete.

        Args:
            hardware_fp: hardware fingerprint.
            workload_fp: workload fingerprint (hex).
            script: the training script's path as the user gave it, or ``None``.
            policy: the policy as a JSON-ready dict with a ``"mode"`` key.
            speedup_vs_fp32: goodput relative to the fp32 reference, or ``None`` if unknown.
            goodput: samples per second of the recommended policy.
            versions: library versions the answer was measured with.
            summary: free-form summary of the tune (JSON-ready).
            trials: one dict per trial; keys among :data:`~advisor.cache._records.TRIAL_FIELDS`.

        Returns:
            The new recommendation's id.

        Raises:
            MpadviseError: a field has the wrong type or shape (the message names it).
        """
        record = validated_record(
            {
                "hardware_fp": hardware_fp,
                "workload_fp": workload_fp,
                "script": script,
                "policy": policy,
                "speedup_vs_fp32": speedup_vs_fp32,
                "goodput": goodput,
                "versions": versions,
                "summary": summary,
                "trials": list(trials),
            }
        )
        record["created_at"] = utc_now()
        with self._write() as db:
            return _replace_recommendation(db, record)

    @guarded
    def get_recommendation(self, hardware_fp: str, workload_fp: str) -> Record | None:
        """The recommendation for one key, with its trials and hardware profile.

        Args:
            hardware_fp: hardware fingerprint.
            workload_fp: workload fingerprint.

        Returns:
            The record (see :meth:`get`), or ``None`` when the key is not cached.
        """
        with self._read() as db:
            rows = _select_recommendations(
                db, "r.hardware_fp = ? AND r.workload_fp = ?", [hardware_fp, workload_fp]
            )
            return _with_trials(db, rows[0]) if rows else None

    @guarded
    def get(self, recommendation_id: int) -> Record | None:
        """One recommendation by id, with its trials.

        Args:
            recommendation_id: the id returned by :meth:`put_recommendation`.

        Returns:
            The record: every field of :data:`~advisor.cache._records.RECORD_FIELDS`
            (``hardware`` is the stored profile or ``None``), or ``None``.
        """
        with self._read() as db:
            rows = _select_recommendations(db, "r.id = ?", [recommendation_id])
            return _with_trials(db, rows[0]) if rows else None

    @guarded
    def find_recommendations(
        self,
        *,
        hardware_fp: str | None = None,
        script: str | None = None,
        workload_fp: str | None = None,
        with_trials: bool = False,
    ) -> list[Record]:
        """Recommendations matching every given filter, newest first.

        Args:
            hardware_fp: only this hardware.
            script: only this script: a path matches the stored path exactly; a bare file
                name matches the stored paths with that base name.
            workload_fp: only this workload.
            with_trials: include each record's trials (otherwise ``trials`` is absent).

        Returns:
            The matching records.
        """
        clauses, params = [], []
        if hardware_fp is not None:
            clauses.append("r.hardware_fp = ?")
            params.append(hardware_fp)
        if workload_fp is not None:
            clauses.append("r.workload_fp = ?")
            params.append(workload_fp)
        bare_name = script is not None and os.path.basename(script) == script
        if script is not None and not bare_name:
            # A path names one file: a script of the same name elsewhere is another workload.
            clauses.append("r.script = ?")
            params.append(script)
        elif script is not None:
            # Filtered in SQL so a lookup does not decode every row of this hardware: the
            # stored path equals the name, or ends in "/<name>".
            escaped = script.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
            clauses.append("(r.script = ? OR r.script LIKE ? ESCAPE '\\')")
            params += [script, f"%/{escaped}"]
        with self._read() as db:
            rows = _select_recommendations(db, " AND ".join(clauses) or "1", params)
            if bare_name:
                rows = [
                    row
                    for row in rows
                    if row["script"] is not None
                    and script in (row["script"], os.path.basename(row["script"]))
                ]
            if with_trials:
                rows = [_with_trials(db, row) for row in rows]
            return rows

    def list_recommendations(self, *, with_trials: bool = False) -> list[Record]:
        """Every recommendation, newest first (see :meth:`find_recommendations`)."""
        return self.find_recommendations(with_trials=with_trials)

    @guarded
    def delete(self, recommendation_id: int) -> bool:
        """Delete one recommendation and its trials.

        Args:
            recommendation_id: the recommendation's id.

        Returns:
            Whether it existed.
        """
        with self._write() as db:
            return _delete_recommendations(db, "id = ?", [recommendation_id]) > 0

    @guarded
    def clear(self, older_than: datetime.timedelta | None = None) -> int:
        """Delete recommendations (and their trials); hardware profiles and jobs are kept.

        Args:
            older_than: only those created longer ago than this; ``None`` deletes all.

        Returns:
            How many recommendations were deleted.
        """
        with self._write() as db:
            if older_than is None:
                return _delete_recommendations(db, "1", [])
            cutoff = datetime.datetime.now(datetime.timezone.utc) - older_than
            return _delete_recommendations(
                db, "created_at < ?", [cutoff.isoformat(timespec="microseconds")]
            )

    # -- export and import -------------------------------------------------------------

    @guarded
    def export_records(self, path: Path | str, *, ids: Iterable[int] | None = None) -> int:
        """Write recommendations, with their hardware profiles and trials, to a JSON file.

        Args:
            path: the file to write (replaced atomically).
            ids: only these recommendation ids; ``None`` exports all.

        Returns:
            How many records were written.

        Raises:
            MpadviseError: an id does not exist, or the file cannot be written.
        """
        with self._read() as db:
            if ids is None:
                rows = _select_recommendations(db, "1", [])
            else:
                rows = []
                for recommendation_id in ids:
                    found = _select_recommendations(db, "r.id = ?", [recommendation_id])
                    if not found:
                        raise MpadviseError(
                            f"recommendation {recommendation_id!r} is not in the cache "
                            f"{self.path}; `mpadvise show` lists the ids"
                        )
                    rows.extend(found)
            rows = [_with_trials(db, row) for row in rows]
        document = export_document(rows)
        target = Path(path)
        try:
            write_file_atomic(target, json.dumps(document, indent=2, sort_keys=True) + "\n")
        except OSError as exc:
            raise MpadviseError(f"cannot write {target}: {exc.strerror or exc}") from exc
        return len(rows)

    def import_records(
        self,
        path: Path | str,
        *,
        validate_hardware: Callable[[str, dict[str, Any] | None], object] | None = None,
    ) -> int:
        """Read a file written by :meth:`export_records` into the cache, all or nothing.

        Every record is validated before anything is written (see
        :func:`~advisor.cache._records.read_export`), then :meth:`import_validated` writes them.

        Args:
            path: the export file.
            validate_hardware: called as ``validate_hardware(hardware_fp, profile)`` for each
                record; raising ``MpadviseError`` or ``ValueError`` rejects the file (for
                example, a fingerprint that does not match its profile).

        Returns:
            How many records were written.

        Raises:
            MpadviseError: the file is unreadable, not an mpadvise export, from a newer
                format, or a record is invalid; the message names the file, the record and
                the field, and nothing is written.
        """

        def check(record: Record) -> None:
            if validate_hardware is not None:
                validate_hardware(record["hardware_fp"], record["hardware"])

        return self.import_validated(read_export(Path(path), check=check)).written

    @guarded
    def import_validated(self, records: Sequence[Record]) -> ImportedIds:
        """Write records that :func:`~advisor.cache._records.read_export` returned, in one
        transaction.

        A record replaces the cached one for its key unless the cached one is newer (so
        re-importing an old file never undoes a fresh local tune); its hardware profile is
        stored with it. It keeps its exported id where no other entry of this cache has it, so
        that ``#3`` means the same entry on both machines; where one has, it gets a new id.

        Args:
            records: validated records, as ``read_export`` returns them.

        Returns:
            The ids the written records have here, with those they were exported with.
        """
        ids: list[tuple[int | None, int]] = []
        with self._write() as db:
            # Those whose id another entry holds go last, so that a new id given to one of them
            # never takes the free id of a record later in the file.
            later = sorted((record for record in records if _id_held_by_another(db, record)),
                           key=lambda record: record["id"])
            first = [record for record in records if not any(record is other for other in later)]
            for record in (*first, *later):
                if record["hardware"] is not None:
                    _upsert_hardware(
                        db,
                        record["hardware_fp"],
                        encoded(record["hardware"]),
                        record["created_at"],
                    )
                existing = list(
                    db.query(
                        "SELECT created_at FROM recommendations "
                        "WHERE hardware_fp = ? AND workload_fp = ?",
                        [record["hardware_fp"], record["workload_fp"]],
                    )
                )
                if existing and existing[0]["created_at"] > record["created_at"]:
                    continue
                ids.append((record.get("id"), _replace_recommendation(db, record)))
        return ImportedIds(tuple(sorted(ids, key=lambda pair: (pair[0] is None, pair[0] or 0, pair[1]))))


def _select_recommendations(
    db: sqlite_utils.Database, where: str, params: Sequence[Any]
) -> list[Record]:
    rows = db.query(
        "SELECT r.*, h.profile AS hardware FROM recommendations r "
        "LEFT JOIN hardware h ON h.fingerprint = r.hardware_fp "
        f"WHERE {where} ORDER BY r.created_at DESC, r.id DESC",
        params,
    )
    return [decode_recommendation(row) for row in rows]


def _with_trials(db: sqlite_utils.Database, row: Record) -> Record:
    trials = db.query(
        f"SELECT {', '.join(TRIAL_FIELDS)} FROM trials "
        "WHERE recommendation_id = ? ORDER BY number, id",
        [row["id"]],
    )
    row["trials"] = [decode_trial(trial) for trial in trials]
    return row


def _upsert_hardware(db: sqlite_utils.Database, fingerprint: str, profile: str, seen: str) -> None:
    db.execute(
        "INSERT INTO hardware (fingerprint, profile, first_seen, last_seen) VALUES (?, ?, ?, ?) "
        "ON CONFLICT(fingerprint) DO UPDATE SET profile = excluded.profile, "
        "last_seen = MAX(last_seen, excluded.last_seen), "
        "first_seen = MIN(first_seen, excluded.first_seen)",
        [fingerprint, profile, seen, seen],
    )


def _delete_recommendations(db: sqlite_utils.Database, where: str, params: Sequence[Any]) -> int:
    ids = [row["id"] for row in db.query(f"SELECT id FROM recommendations WHERE {where}", params)]
    for recommendation_id in ids:
        # Trials first: the foreign key forbids orphaning them.
        db.execute("DELETE FROM trials WHERE recommendation_id = ?", [recommendation_id])
        db.execute("DELETE FROM recommendations WHERE id = ?", [recommendation_id])
    return len(ids)


def _id_held_by_another(db: sqlite_utils.Database, record: Record) -> bool:
    """Whether an entry of another key holds the id ``record`` was exported with."""
    wanted = record.get("id")
    if wanted is None:
        return False
    held = list(db.query("SELECT hardware_fp, workload_fp FROM recommendations WHERE id = ?", [wanted]))
    return bool(held) and (held[0]["hardware_fp"], held[0]["workload_fp"]) != (
        record["hardware_fp"], record["workload_fp"])


def _replace_recommendation(db: sqlite_utils.Database, record: Record) -> int:
    """Delete the key's old row and trials and insert the new ones (caller holds the lock)."""
    _delete_recommendations(
        db, "hardware_fp = ? AND workload_fp = ?", [record["hardware_fp"], record["workload_fp"]]
    )
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
