"""The per-GPU recommendation cache.

* ``_records``: what a recommendation record is (its one schema), how it is checked, and its
  rows and export form; pure.
* ``_store``: the SQLite database (the one module that imports sqlite-utils): opening it,
  damage, and the ``Store``, whose queries come from ``_recommendations`` (answers, trials,
  hardware profiles; their SQL in ``_recommendation_rows``), ``_transfer`` (export and import)
  and ``_jobs`` (the daemon's queue), on top of
  ``_base`` (transactions, errors); ``_migrations`` holds the schema's history.
* ``_recommend``: what a stored answer means for this machine and script.

Public surface (other packages import these from ``advisor.cache``, never from its modules):
the ``Store`` and ``open_store``; the record schema (``RECORD_FIELDS``, ``RecordField``, the
fingerprint patterns, ``read_export``); the job states; and what an answer means here
(``record_tune``, ``lookup``, ``cached_answers``, ``TunedAnswer``, ``entry_status``,
``stale_entries``, ``nothing_cached_yet``); the runtime guard's events (``record_guard_event``,
``guard_events_for``, kept by ``_events``; ``EVENT_FIELDS`` by ``_event_rows``).

The exports are lazy (a module ``__getattr__``, PEP 562): importing the package imports none
of its modules, so that ``load_policy()`` pays for sqlite-utils only when it really reads the
cache. Arrows: cache uses ``policies`` and ``probes``; ``runtime``, ``tune``, the daemon and
the CLI may use it, never the reverse.
"""

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
    "EVENT_FIELDS": "_event_rows",
    "guard_events_for": "_events",
    "record_guard_event": "_events",
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
    "stale_entries": "_recommend",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_surface(__name__, _EXPORTS, globals())
