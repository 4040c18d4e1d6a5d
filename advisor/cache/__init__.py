"""The per-GPU recommendation cache: the SQLite ``Store``, the record schema, and what a stored
answer means for this machine and script. The exports are lazy (PEP 562), so that
``load_policy()`` pays for sqlite-utils only when it really reads the cache."""

from __future__ import annotations

from advisor._lazy import lazy_surface

# Each exported name, and the module that defines it (imported on first use).
_EXPORTS = {
    "EXPORT_FORMAT": "_records",
    "EXPORT_FORMAT_VERSION": "_records",
    "HARDWARE_FP_PATTERN": "_records",
    "RECORD_FIELDS": "_records",
    "TRIAL_FIELDS": "_records",
    "WORKLOAD_FP_PATTERN": "_records",
    "Record": "_records",
    "RecordField": "_records",
    "read_export": "_records",
    "EVENT_FIELDS": "_store",
    "guard_events_for": "_recommend",
    "record_guard_event": "_recommend",
    "FINISHED_JOB_STATES": "_jobs",
    "JOB_STATES": "_jobs",
    "Store": "_store",
    "open_store": "_store",
    "TunedAnswer": "_recommend",
    "cached_answers": "_recommend",
    "entry_status": "_recommend",
    "lookup": "_recommend",
    "nothing_cached_yet": "_base",
    "record_tune": "_recommend",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_surface(__name__, _EXPORTS, globals())
