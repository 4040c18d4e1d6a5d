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
from advisor.cache._base import nothing_cached_yet
from advisor.cache._store import open_store
from probes import MpadviseError, hardware_fingerprint

if TYPE_CHECKING:
    from probes import HardwareProfile

def record_guard_event(event: Mapping[str, Any], *, profile: HardwareProfile, workload_fp: str | None,
                       script: str | os.PathLike[str] | None) -> bool:
    """Write ``event`` to the cache entry of this hardware, workload and script.

    A cache that cannot be written costs one warning, never the run.

    Returns:
        Whether it was stored.
    """
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
