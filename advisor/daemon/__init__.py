"""``mpadvise daemon``: a local HTTP service for cached answers and queued tune jobs.

The service answers "what should this workload use on this GPU?" from the cache, and runs
``mpadvise tune`` jobs one per GPU (one CPU slot on a machine without one), starting each only
when NVML shows no other compute process on its GPU, so that tuning does not disturb training
that is already running.

A job API that runs scripts is remote code execution when it is reachable: Ray's
unauthenticated job API bound to 0.0.0.0 became CVE-2023-48022. So:

* it binds 127.0.0.1 (or a Unix socket created with mode 0600); any other address needs
  ``allow_remote`` and is announced with a warning;
* every request but ``GET /health`` needs the bearer token kept in a 0600 file in the cache
  directory (0700): job arguments, paths and logs are secrets of the user who runs it;
* a loopback client's ``Host`` header must name the loopback, also with ``allow_remote``, so a
  web page cannot reach the service through DNS rebinding;
* a job's script must exist under an allowed root, and its arguments travel as a list to
  ``exec``, never through a shell; bodies are limited in size and every field is bounded;
* no local user can use up the daemon: connections are bounded in number (below the
  descriptor limit, leaving descriptors for jobs), a request's head in size, and a client in
  the time it takes to send its request (``_protocol``).

The queue lives in the cache database (:mod:`advisor.cache._jobs`), so jobs survive a
restart: at start, a job that was running when the last daemon died has its leftover processes
killed and is queued again once (``Store.requeue_interrupted``), then marked interrupted.

A job runs the tune service's entry point, ``python -m advisor.tune.job REQUEST.json
RESULT.json``, in its own process group: the request holds the script, its arguments, the
options with the slot as the device, and the plan the daemon made for the script. The service is
the one ``mpadvise tune`` runs, so the answer lands in the cache exactly as the CLI stores it.
The job's output becomes its progress and log tail; its result is the result file, never the
output.

The pure decisions (may this address be bound, is this path under a root, which argv runs a
job, what is a log's tail) are plain functions; the HTTP layer, the worker threads and the
processes are shells around them.

Modules: ``_config`` (settings, constants, pure address and path decisions), ``_files`` (token,
lock, address file), ``_requests`` and ``_responses`` (validated bodies), ``_job_request``
(what a job runs: request, argv, environment), ``_job_files`` (its log, files and processes),
``_jobs`` (slots, the runner), ``_app`` (HTTP routes and guards), ``_protocol`` (the connection limits), ``_server`` (binding
and serving; with ``_app``, ``_protocol`` and the body models, the only modules that import
FastAPI, pydantic or uvicorn) and
``_client`` (standard library only).

Public surface (other packages import these from ``advisor.daemon``, never from its modules):
the client (``DaemonClient``, ``DaemonPaths``, ``daemon_running``, ``read_token``,
``tune_job_body``, ``finished_tune``), the settings (``DaemonConfig``, ``check_bind`` and the
log limits) and ``serve``. The exports are lazy (a module ``__getattr__``, PEP 562): importing
the package imports none of its modules, so that the client does not load the web framework.
Arrows: the daemon uses ``cache``, ``tune`` (the tune options and an environment name) and
``probes``; only the CLI imports it.
"""

from __future__ import annotations

from advisor._lazy import lazy_surface

# Each exported name, and the module that defines it (imported on first use).
_EXPORTS = {
    "DaemonClient": "_client",
    "DaemonPaths": "_client",
    "daemon_running": "_client",
    "finished_tune": "_client",
    "read_token": "_client",
    "tune_job_body": "_client",
    "DAEMON_LOGS_KEPT": "_config",
    "MAX_DAEMON_LOG_BYTES": "_config",
    "DaemonConfig": "_config",
    "check_bind": "_config",
    "serve": "_server",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_surface(__name__, _EXPORTS, globals())
