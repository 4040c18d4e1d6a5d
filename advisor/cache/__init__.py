"""The per-GPU recommendation cache: the SQLite store (``_store``, the one module that imports
sqlite-utils) and what its rows mean for this machine and script (``_recommend``).

This ``__init__`` imports nothing, so that ``load_policy()`` pays for sqlite-utils only when it
really reads the cache. Arrows: cache uses ``policies`` and ``probes``; ``runtime``, ``tune``,
the daemon and the CLI may use it, never the reverse.
"""
