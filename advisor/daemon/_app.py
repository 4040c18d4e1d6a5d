"""The HTTP application: the routes, the request guard (body size, Host header), the token check."""

from __future__ import annotations

import contextlib
import hmac
import json
import os
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, Query, Request
from fastapi import Path as PathParam
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from fastapi.security import HTTPBearer
from starlette.exceptions import HTTPException
from starlette.routing import Match

from advisor._version import __version__
from advisor.cache import FINISHED_JOB_STATES, HARDWARE_FP_PATTERN, WORKLOAD_FP_PATTERN, Store
from advisor.daemon import _models as models
from advisor.daemon._config import MAX_QUEUED_JOBS, MAX_TEXT, loopback_address, utc_now_seconds
from advisor.daemon._jobs import JobRunner, PathKind, path_refusal
from probes import MpadviseError

if TYPE_CHECKING:
    from advisor.daemon._config import DaemonConfig


@dataclass
class DaemonState:
    config: DaemonConfig
    token: str
    store: Store
    read_store: Store
    report: dict[str, Any]
    runner: JobRunner
    mode_names: frozenset[str]
    answers: AnswerCache
    started: float = field(default_factory=time.time)
    started_at: str = field(default_factory=utc_now_seconds)
    local_only: bool = True


def _json_bytes(data: Any) -> bytes:
    # Plain json: no response model re-validated on the hot path; ASCII escapes never fail.
    return json.dumps(data, separators=(",", ":"), default=str).encode()


def _json(data: Any, status: int = 200, headers: Mapping[str, str] | None = None) -> Response:
    return Response(_json_bytes(data), status_code=status, headers=headers, media_type="application/json")


class AnswerCache:
    """Encoded ``GET /recommendations`` answers, valid until another connection commits (SQLite's
    ``PRAGMA data_version``, a few microseconds); ``store`` is only read from. At most 256."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self._answers: dict[Any, bytes] = {}
        self._version: int | None = None

    def get(self, key: Any) -> bytes | None:
        try:
            version = int(self._store.db.execute("PRAGMA data_version").fetchone()[0])
        except Exception:  # a closed or replaced connection: never serve from the cache then
            version = None
        if version is None or version != self._version:
            self._answers.clear()
            self._version = version
            return None
        return self._answers.get(key)

    def put(self, key: Any, body: bytes) -> None:
        if self._version is not None:
            if len(self._answers) >= 256:
                self._answers.clear()
            self._answers[key] = body


class _Guard:
    """ASGI middleware (nothing measurable on a GET): the Host check, and the body size limit."""

    def __init__(self, app: Any, *, max_body: int, check_host: bool, local_only: bool) -> None:
        self.app, self.max_body = app, max_body
        self.check_host, self.local_only = check_host, local_only

    async def __call__(self, scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers, client = dict(scope["headers"]), scope.get("client")
        length = headers.get(b"content-length")
        # The Host check applies to every client when serving loopback only, else to loopback
        # ones (a remote client names this machine however it reaches it).
        from_loopback = self.local_only or not client or not client[0] or loopback_address(str(client[0]))
        if self.check_host and from_loopback:
            host = (headers.get(b"host") or b"").decode("ascii", errors="replace")  # no DNS look-up
            host = host if host.endswith("]") else host.rsplit(":", 1)[0]
            if not (host == "localhost" or loopback_address(host)):
                await _send_error(send, 400, "the Host header must name the loopback (127.0.0.1, "
                                  "localhost or [::1]); this daemon serves local clients only")
                return
        if length is not None:
            try:
                size = int(length)
            except ValueError:
                await _send_error(send, 400, "Content-Length is not a number")
                return
            if size > self.max_body:
                await _send_error(send, 413, f"request body is {size} bytes; the limit is {self.max_body}")
                return
        if scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        # A chunked body has no length up front: read it (bounded) before the app does.
        chunks, total = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break
            chunks.append(message.get("body", b""))
            total += len(chunks[-1])
            if total > self.max_body:
                await _send_error(send, 413, f"request body is over the limit of {self.max_body} bytes")
                return
            if not message.get("more_body", False):
                message = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
                break
        replayed = [message]

        async def replay() -> dict[str, Any]:
            return replayed.pop() if replayed else await receive()

        await self.app(scope, replay, send)


async def _send_error(send: Callable[..., Any], status: int, detail: str) -> None:
    body = json.dumps({"detail": detail}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


_bearer = HTTPBearer(auto_error=False, description="The contents of daemon.token in the cache directory.")


async def _require_token(request: Request) -> None:
    """The bearer token, for every request but ``GET /health``: reads show a job's arguments,
    directory and log, which can hold secrets."""
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not given:
        raise HTTPException(401, "this request needs `Authorization: Bearer <token>`; the token is in "
                                 "daemon.token in the cache directory", headers={"WWW-Authenticate": "Bearer"})
    if not hmac.compare_digest(given.strip().encode("utf-8", "replace"), request.app.state.daemon.token.encode()):
        raise HTTPException(403, "wrong token; read it again from daemon.token in the cache directory "
                                 "(it changes when the file is deleted)")


# The routes, added to each application by create_app in this order (the OpenAPI document's).
# Not through include_router: newer FastAPI keeps an included router as one nested route, and
# the 405 handler needs every route of the application to say which methods a path allows.
_router = APIRouter()


def create_app(state: DaemonState) -> FastAPI:
    """The ASGI app over ``state``, in the Host and body-size guard; its lifespan runs the jobs."""
    app = FastAPI(
        title="mpadvise daemon", version=__version__,
        summary="Cached precision recommendations and queued tune jobs for this machine.",
        description=("Every request but `GET /health` needs `Authorization: Bearer <token>`, the token "
                     "being the contents of `daemon.token` in the cache directory (mode 0600)."),
        docs_url=None, redoc_url=None, openapi_url="/openapi.json",
        lifespan=_lifespan,
    )
    app.state.daemon = state
    app.add_exception_handler(RequestValidationError, _validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(HTTPException, _http_error)  # type: ignore[arg-type]
    app.add_exception_handler(MpadviseError, _store_error)  # type: ignore[arg-type]
    app.router.routes.extend(_router.routes)
    # The Host check stops DNS rebinding (a web page reaching the loopback under its own name).
    return _Guard(app, max_body=state.config.max_body_bytes,  # type: ignore[return-value]
                  check_host=state.config.uds is None, local_only=state.local_only)


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    app.state.daemon.runner.start()
    try:
        yield
    finally:
        app.state.daemon.runner.stop()


# Errors: every body is {"detail": ...}


async def _validation_error(_: Request, exc: RequestValidationError) -> Response:
    # The default handler echoes each input back (up to the whole body) and cannot encode
    # a lone surrogate; say where and what, nothing more.
    errors = [{"loc": list(e.get("loc", ())), "msg": e.get("msg", ""), "type": e.get("type", "")}
              for e in exc.errors()]
    return _json({"detail": errors}, 422)


async def _http_error(request: Request, exc: HTTPException) -> Response:
    headers = dict(exc.headers or {})
    if exc.status_code == 405:
        # Starlette names only the methods of the first route on the path; a client (and
        # RFC 9110) needs all of them.
        routes = [route for route in request.app.router.routes if getattr(route, "methods", None)]
        methods = {m for route in routes if route.matches(request.scope)[0] != Match.NONE for m in route.methods}
        headers["Allow"] = ", ".join(sorted(methods))
    return _json({"detail": exc.detail}, exc.status_code, headers=headers)


async def _store_error(_: Request, exc: MpadviseError) -> Response:
    return _json({"detail": str(exc)}, 503)


_READ = [Depends(_require_token)]
_CHANGE = [Depends(_bearer), Depends(_require_token)]  # _bearer: the token in the OpenAPI document


@_router.get("/health", response_model=models.Health, tags=["service"], responses=models.error_responses(400))
async def health(request: Request) -> Response:
    """Whether the daemon answers, its slots, and how many jobs are in each state."""
    state: DaemonState = request.app.state.daemon
    counts = dict.fromkeys(("queued", "running", "cancelling"), 0)
    for job in state.read_store.list_jobs(states=tuple(counts)):
        if job["state"] in counts:  # a damaged row reads as failed
            counts[job["state"]] += 1
    return _json({
        "status": "ok", "version": __version__, "pid": os.getpid(), "started_at": state.started_at,
        "uptime_s": round(time.time() - state.started, 3), "slots": state.runner.slot_info(), "jobs": counts,
    })


@_router.get("/hardware", response_model=models.HardwareReport, tags=["service"], dependencies=_READ,
             responses=models.error_responses(400, 401, 403))
async def hardware(request: Request) -> Response:
    """This machine's devices (as `mpadvise probe --json` reports them) and the job slots."""
    state: DaemonState = request.app.state.daemon
    return _json({**state.report, "slots": state.runner.slot_info()})


@_router.get("/recommendations", response_model=models.RecommendationList, tags=["cache"],
             responses=models.error_responses(400, 401, 403, 422, 503))
async def recommendations(
    request: Request,
    workload: Annotated[str | None, Query(pattern=f"^{WORKLOAD_FP_PATTERN.pattern}$",
                                          description="Workload fingerprint.")] = None,
    script: Annotated[str | None, Query(min_length=1, max_length=MAX_TEXT,
                                        description="Script path, or its file name.")] = None,
    hardware: Annotated[str | None, Query(pattern=f"^{HARDWARE_FP_PATTERN.pattern}$",
                                          description="Hardware fingerprint (GET /hardware lists this machine's).")] = None,
    trials: Annotated[bool, Query(description="Include each entry's trials.")] = False,
    limit: Annotated[int, Query(ge=1, le=1000, description="At most this many, newest first.")] = 100,
) -> Response:
    """Cached recommendations, newest first, filtered by workload, script and hardware."""
    # Called here rather than as a dependency: the hottest path, and FastAPI's dependency
    # resolution costs a tenth of a request.
    await _require_token(request)
    state: DaemonState = request.app.state.daemon
    key = (workload, script, hardware, trials, limit)
    body = state.answers.get(key)
    if body is None:
        rows = state.read_store.find_recommendations(hardware_fp=hardware, script=script, workload_fp=workload,
                                                     with_trials=trials)
        body = _json_bytes({"count": len(rows), "recommendations": rows[:limit]})
        state.answers.put(key, body)
    return Response(body, media_type="application/json")


@_router.post("/jobs", response_model=models.Job, status_code=201, tags=["jobs"], dependencies=_CHANGE,
              responses=models.error_responses(400, 401, 403, 413, 422, 429, 503))
def create_job(request: Request, job: models.JobRequest) -> Response:
    """Queue a tune job; it runs when a slot (and its GPU) is free."""
    state: DaemonState = request.app.state.daemon
    # Checked against this daemon: paths (403/422, resolved as queued), modes and slot (422).
    roots = state.config.roots()
    script = _checked_path(job.script, roots, "script", want="file")
    options = job.options.model_dump()
    if job.cwd is not None:
        options["cwd"] = str(_checked_path(job.cwd, roots, "cwd", want="dir"))
    if job.options.out is not None:
        options["out"] = str(_checked_path(job.options.out, roots, "options.out", want="new"))
    unknown = sorted(set(job.options.modes) - state.mode_names)
    if unknown:
        raise _invalid(["body", "options", "modes"], f"unknown mode {', '.join(unknown)}; "
                       f"expected some of {', '.join(sorted(state.mode_names))}")
    names = [slot.name for slot in state.runner.slots]
    if job.gpu is not None and job.gpu not in names:
        raise _invalid(["body", "gpu"], f"gpu {job.gpu!r} is not a slot of this daemon; expected "
                       f"one of {', '.join(names)} (or none for the first free one)")
    queued = state.store.count_queued_jobs()
    if queued >= MAX_QUEUED_JOBS:
        raise HTTPException(429, f"{queued} jobs are queued, the most this daemon keeps waiting is "
                                 f"{MAX_QUEUED_JOBS}; submit again once some have run, or cancel some",
                            headers={"Retry-After": "60"})
    job_id = state.store.enqueue_job(script=str(script), args=job.args, options=options, gpu=job.gpu)
    state.runner.wake()
    return _json(state.store.get_job(job_id), 201, headers={"Location": f"/jobs/{job_id}"})


@_router.get("/jobs", response_model=models.JobList, tags=["jobs"], dependencies=_READ,
             responses=models.error_responses(400, 401, 403, 422, 503))
async def list_jobs(
    request: Request,
    state_filter: Annotated[list[models.JobState] | None,
                            Query(alias="state", description="Only jobs in these states.")] = None,
    limit: Annotated[int, Query(ge=1, le=1000, description="At most this many, the newest.")] = 100,
) -> Response:
    """Jobs in queue order (oldest first); the newest ``limit`` of them."""
    jobs = request.app.state.daemon.read_store.list_jobs(states=state_filter)
    return _json({"count": len(jobs), "jobs": jobs[-limit:]})


@_router.get("/jobs/{job_id}", response_model=models.Job, tags=["jobs"], dependencies=_READ,
             responses=models.error_responses(400, 401, 403, 404, 422, 503))
async def get_job(request: Request, job_id: Annotated[str, PathParam(max_length=64)]) -> Response:
    """One job: state, progress, result (the tune's JSON) and the tail of its log."""
    job = request.app.state.daemon.read_store.get_job(job_id)
    if job is None:
        raise HTTPException(404, f"no job {job_id!r}; GET /jobs lists them")
    return _json(job)


@_router.delete("/jobs/{job_id}", response_model=models.Job, tags=["jobs"], dependencies=_CHANGE,
                responses={**models.error_responses(400, 401, 403, 404, 409, 422, 503),
                           202: {"model": models.Job, "description": "Cancelling: the running tune is being stopped"}})
def cancel_job(request: Request, job_id: Annotated[str, PathParam(max_length=64)]) -> Response:
    """Cancel a job: a queued one at once (200), a running one by killing its tune (202)."""
    state: DaemonState = request.app.state.daemon
    before = state.store.get_job(job_id)
    if before is not None and before["state"] in FINISHED_JOB_STATES:
        raise HTTPException(409, f"job {job_id} has already finished ({before['state']}); nothing to cancel")
    job = None if before is None else state.store.cancel_job(job_id)
    if job is None:  # none, or deleted in between: the cache was cleared
        raise HTTPException(404, f"no job {job_id!r}; GET /jobs lists them")
    state.runner.cancel(job_id)
    return _json(job, 202 if job["state"] == "cancelling" else 200)


def _invalid(loc: list[str], message: str) -> HTTPException:
    """A 422 shaped like FastAPI's own (``detail`` a list of ``loc``/``msg``/``type``), so that
    a client reads every validation failure the same way."""
    return HTTPException(422, [{"loc": loc, "msg": message, "type": "value_error"}])


def _checked_path(raw: str, roots: Sequence[Path], what: str, *, want: PathKind) -> Path:
    problem = path_refusal(what, raw, roots, want)
    if problem is None:
        return Path(os.path.realpath(raw))
    status, message = problem
    raise HTTPException(403, message) if status == 403 else _invalid(["body", *what.split(".")], message)
