"""The per-GPU recommendation cache: the SQLite ``Store``, the record schema, and what a stored
answer means here. Lazy exports (PEP 562): ``load_policy()`` loads sqlite-utils only to read."""

from __future__ import annotations

from advisor._lazy import lazy_surface

_EXPORTS = {
    **dict.fromkeys(("EXPORT_FORMAT", "EXPORT_FORMAT_VERSION", "FINISHED_JOB_STATES", "HARDWARE_FP_PATTERN",
                     "JOB_STATES", "RECORD_FIELDS", "TRIAL_FIELDS", "WORKLOAD_FP_PATTERN", "Record",
                     "RecordField", "read_export"), "_records"),
    **dict.fromkeys(("TunedAnswer", "cached_answers", "entry_status", "guard_events_for", "lookup",
                     "record_guard_event", "record_tune"), "_recommend"),
    **dict.fromkeys(("EVENT_FIELDS", "Store", "open_store"), "_store"),
    "nothing_cached_yet": "_base",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_surface(__name__, _EXPORTS, globals())
