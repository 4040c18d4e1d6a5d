"""What the runtime guard saw in long runs: its events, stored per hardware, workload and script.

The event is plain data here (the runtime's ``GuardEvent.to_dict()``), so the cache knows
nothing of the runtime: ``record_guard_event`` writes one, ``guard_events_for`` reads those of
this hardware and script for ``load_policy()``, and the Store's ``list_guard_events`` serves
``mpadvise show``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from advisor._log import get_logger
from advisor._paths import database_path
from advisor.cache._base import StoreBase, guarded
from advisor.cache._records import utc_now
from probes import MpadviseError, hardware_fingerprint

if TYPE_CHECKING:
    from probes import HardwareProfile

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


def record_guard_event(event: Mapping[str, Any], *, profile: HardwareProfile, workload_fp: str | None,
                       script: str | os.PathLike[str] | None) -> bool:
    """Write ``event`` to the cache entry of this hardware, workload and script.

    A cache that cannot be written costs one warning, never the run.

    Returns:
        Whether it was stored.
    """
    from advisor.cache._store import open_store

    path = database_path()
    store = open_store(path)
    if store is None:
        return False
    try:
        with store:
            store.put_guard_event(event, hardware_fp=hardware_fingerprint(profile), workload_fp=workload_fp,
                                  script=None if script is None else str(Path(script).resolve()))
    except (MpadviseError, OSError) as exc:
        get_logger().warning(f"the guard could not record its event in {path}: {exc}")
        return False
    return True


def guard_events_for(profile: HardwareProfile, script: str | os.PathLike[str] | None) -> list[dict[str, Any]]:
    """This hardware's and script's guard events, newest first; empty on any cache trouble."""
    from advisor.cache._recommend import nothing_cached_yet
    from advisor.cache._store import open_store

    path = database_path()
    if script is None or nothing_cached_yet(path):
        return []
    store = open_store(path)
    if store is None:
        return []
    try:
        with store:
            return store.list_guard_events(hardware_fp=hardware_fingerprint(profile), script=str(Path(script).resolve()))
    except (MpadviseError, OSError) as exc:
        get_logger().warning(f"reading the guard's events in {path} failed: {exc}; continuing without them")
        return []
