"""The Store's guard-event table: one row per event the runtime guard saw in a long run.

The functions that open the store for the runtime (``record_guard_event``,
``guard_events_for``) are in :mod:`advisor.cache._events`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from advisor.cache._base import StoreBase, guarded
from advisor.cache._records import utc_now
from probes import MpadviseError

EVENT_FIELDS = ("signal", "step", "tripped_at", "policy", "fallback", "action", "detail")
"""The fields of one event, as the runtime's ``GuardEvent.to_dict()`` gives them."""


class GuardEvents(StoreBase):
    """The Store's guard events."""

    @guarded
    def put_guard_event(self, event: Mapping[str, Any], *, hardware_fp: str, workload_fp: str | None,
                        script: str | None) -> int:
        """Store one event; returns its id.

        Raises:
            MpadviseError: ``event`` lacks a field of ``EVENT_FIELDS`` or has others.
        """
        if set(event) != set(EVENT_FIELDS):
            raise MpadviseError(f"guard event: expected the fields {', '.join(EVENT_FIELDS)}, got {', '.join(sorted(event))}")
        row = {**{name: event[name] for name in EVENT_FIELDS}, "hardware_fp": hardware_fp,
               "workload_fp": workload_fp, "script": script, "created_at": utc_now()}
        with self._write() as db:
            return int(db.table("guard_events").insert(row).last_pk)

    @guarded
    def list_guard_events(self, *, hardware_fp: str | None = None, script: str | None = None) -> list[dict[str, Any]]:
        """The stored events, newest first; only this hardware's and script's where given."""
        where, params = [], []
        for column, value in (("hardware_fp", hardware_fp), ("script", script)):
            if value is not None:
                where.append(f"{column} = ?")
                params.append(value)
        clause = f" WHERE {' AND '.join(where)}" if where else ""
        return list(self.db.query(f"SELECT * FROM guard_events{clause} ORDER BY created_at DESC, id DESC", params))
