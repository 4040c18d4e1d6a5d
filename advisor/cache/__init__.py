"""The per-GPU recommendation cache.

* ``_records``: what a recommendation record is (its one schema), how it is checked, and its
  rows and export form; pure.
* ``_store``: the SQLite database (the one module that imports sqlite-utils): opening it,
  damage, and the ``Store``, whose queries come from ``_recommendations`` (answers, trials,
  hardware profiles, export and import) and ``_jobs`` (the daemon's queue), on top of
  ``_base`` (transactions, errors); ``_migrations`` holds the schema's history.
* ``_recommend``: what a stored answer means for this machine and script.

This ``__init__`` imports nothing, so that ``load_policy()`` pays for sqlite-utils only when it
really reads the cache. Arrows: cache uses ``policies`` and ``probes``; ``runtime``, ``tune``,
the daemon and the CLI may use it, never the reverse.
"""
