"""Recommendations, their trials and hardware profiles: the Store's queries.

One (hardware, workload) key holds one answer: a new answer replaces the old row and its
trials in one transaction, so a concurrent reader sees the old one or the new one, complete.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Sequence
from typing import Any

from advisor.cache._base import guarded
from advisor.cache._recommendation_rows import (
    attach_trials,
    delete_recommendations,
    replace_recommendation,
    select_recommendations,
    upsert_hardware,
)
from advisor.cache._records import Record, check_hardware_fp, json_text, utc_now, validated_record
from advisor.cache._transfer import RecommendationTransfer


class Recommendations(RecommendationTransfer):
    """The answers of tunes, keyed by (hardware fingerprint, workload fingerprint)."""

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
        """Store the answer for one (hardware, workload) key, replacing any earlier one, and
        return its id. Raises MpadviseError naming a field of the wrong type or shape."""
        record = validated_record({
            "hardware_fp": hardware_fp, "workload_fp": workload_fp, "script": script, "policy": policy,
            "speedup_vs_fp32": speedup_vs_fp32, "goodput": goodput, "versions": versions,
            "summary": summary, "trials": list(trials),
        })
        record["created_at"] = utc_now()
        with self._write() as db:
            return replace_recommendation(db, record)

    @guarded
    def clear(self, older_than: datetime.timedelta | None = None) -> int:
        """Delete recommendations (all, or those created longer ago than ``older_than``) with their
        trials, and the guard's events of the same age; hardware profiles and jobs are kept.
        Returns how many recommendations went."""
        with self._write() as db:
            where, params = "1", []
            if older_than is not None:
                cutoff = datetime.datetime.now(datetime.timezone.utc) - older_than
                where, params = "created_at < ?", [cutoff.isoformat(timespec="microseconds")]
            if db["guard_events"].exists():
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
        """Recommendations matching every given filter, newest first (``trials`` absent unless
        ``with_trials``). A ``script`` path matches the stored path exactly; a bare file name
        matches the stored paths with that base name."""
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
            rows = select_recommendations(db, " AND ".join(clauses) or "1", params)
            if bare_name:
                rows = [row for row in rows
                        if row["script"] is not None and script in (row["script"], os.path.basename(row["script"]))]
            if with_trials:
                rows = [attach_trials(db, row) for row in rows]
            return rows

    def list_recommendations(self, *, with_trials: bool = False) -> list[Record]:
        return self.find_recommendations(with_trials=with_trials)
