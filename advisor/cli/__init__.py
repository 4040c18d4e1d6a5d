"""The ``mpadvise`` command line: each command declares its options and delegates.

torch is imported inside commands, so ``mpadvise --help`` stays fast. One domain exception
(``MpadviseError``) is caught at the boundary and printed as one red line on stderr.
Exit codes: 0 done, 1 error, 2 usage, 3 no stable policy found.

Modules: ``_app`` (the root app: probe, policy, trial, tune, and the groups added with
``add_typer``), ``_common`` (consoles, ``--json``, the error boundary), one module per command
or group (``_probe``, ``_policy``, ``_trial``, ``_tune``, ``_cache``, ``_daemon``) and
``_report`` (rich tables and progress shared by trial and tune).
"""

from __future__ import annotations

from advisor.cli._app import app, main
from advisor.cli._common import console, err_console

__all__ = ["app", "console", "err_console", "main"]
