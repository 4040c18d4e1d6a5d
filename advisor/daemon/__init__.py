"""``mpadvise daemon``: a local HTTP service for cached answers and queued tune jobs.

A job API that runs scripts is remote code execution when reachable (CVE-2023-48022, Ray), so:
it binds the loopback (or a 0600 Unix socket) unless ``allow_remote``; every request but
``GET /health`` needs the token in a 0600 file; a loopback client's ``Host`` must name the
loopback (DNS rebinding); a job's paths must lie under an allowed root, its arguments go to
``exec`` as a list; requests are bounded in size and time. Lazy exports: the client loads no
web framework."""

from __future__ import annotations

from advisor._lazy import lazy_surface

_EXPORTS = {
    **dict.fromkeys(("DaemonClient", "DaemonPaths", "daemon_running", "finished_tune", "read_token",
                     "tune_job_body"), "_client"),
    **dict.fromkeys(("DAEMON_LOGS_KEPT", "MAX_DAEMON_LOG_BYTES", "DaemonConfig", "check_bind"), "_config"),
    "serve": "_server",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_surface(__name__, _EXPORTS, globals())
