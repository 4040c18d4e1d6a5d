"""Export and import of recommendations, with their hardware profiles and trials; the file's
form and its checks are :mod:`advisor.cache._records`."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from advisor.cache._base import StoreBase, guarded
from advisor.cache._recommendation_rows import (
    attach_trials,
    replace_recommendation,
    select_recommendations,
    upsert_hardware,
)
from advisor.cache._records import Record, encoded, export_document
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


class RecommendationTransfer(StoreBase):
    @guarded
    def export_records(self, path: Path | str, *, ids: Iterable[int] | None = None) -> int:
        """Write recommendations (only ``ids`` when given) to a JSON file, replaced atomically;
        returns how many. Raises MpadviseError for an unknown id or an unwritable file."""
        with self._read() as db:
            if ids is None:
                rows = select_recommendations(db, "1", [])
            else:
                rows = []
                for recommendation_id in ids:
                    found = select_recommendations(db, "r.id = ?", [recommendation_id])
                    if not found:
                        raise MpadviseError(f"recommendation {recommendation_id!r} is not in the cache "
                                            f"{self.path}; `mpadvise show` lists the ids")
                    rows.extend(found)
            rows = [attach_trials(db, row) for row in rows]
        target = Path(path)
        try:
            write_file_atomic(target, json.dumps(export_document(rows), indent=2, sort_keys=True) + "\n")
        except OSError as exc:
            raise MpadviseError(f"cannot write {target}: {exc.strerror or exc}") from exc
        return len(rows)

    @guarded
    def import_validated(self, records: Sequence[Record]) -> ImportedIds:
        """Write records that :func:`~advisor.cache._records.read_export` returned, in one
        transaction.

        A record replaces the cached one for its key unless the cached one is newer (so
        re-importing an old file never undoes a fresh local tune); its hardware profile is
        stored with it. It keeps its exported id where no other entry of this cache has it, so
        that ``#3`` means the same entry on both machines; where one has, it gets a new id.
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
                    upsert_hardware(db, record["hardware_fp"], encoded(record["hardware"]), record["created_at"])
                existing = list(db.query(
                    "SELECT created_at FROM recommendations WHERE hardware_fp = ? AND workload_fp = ?",
                    [record["hardware_fp"], record["workload_fp"]],
                ))
                if existing and existing[0]["created_at"] > record["created_at"]:
                    continue
                ids.append((record.get("id"), replace_recommendation(db, record)))
        return ImportedIds(tuple(sorted(ids, key=lambda pair: (pair[0] is None, pair[0] or 0, pair[1]))))


def _id_held_by_another(db: sqlite_utils.Database, record: Record) -> bool:
    """Whether an entry of another key holds the id ``record`` was exported with."""
    wanted = record.get("id")
    if wanted is None:
        return False
    held = list(db.query("SELECT hardware_fp, workload_fp FROM recommendations WHERE id = ?", [wanted]))
    return bool(held) and (held[0]["hardware_fp"], held[0]["workload_fp"]) != (
        record["hardware_fp"], record["workload_fp"])
