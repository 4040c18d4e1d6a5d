"""What a client may send and what the daemon answers, and so the OpenAPI document."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints, create_model

from advisor.cache import JOB_STATES, RECORD_FIELDS
from advisor.daemon._config import MAX_ARGS, MAX_TEXT
from advisor.trial import parse_memory
from advisor.tune import option_info
from probes import MpadviseError


def _clean_text(value: str) -> str:
    # A NUL cannot be part of a path or an exec argument, and a lone surrogate (valid in
    # JSON's \u escapes) cannot be encoded for the OS or SQLite: refuse both here, as 422,
    # rather than fail deep inside with a 500.
    if "\x00" in value:
        raise ValueError("must not contain a NUL character")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("must be valid Unicode (it has a lone surrogate)") from None
    return value


def _memory_size(value: str) -> str:
    try:
        parse_memory(value)
    except MpadviseError as exc:
        raise ValueError(str(exc)) from None
    return value


Text = Annotated[str, StringConstraints(max_length=MAX_TEXT), AfterValidator(_clean_text)]
MemorySize = Annotated[str, StringConstraints(max_length=32), AfterValidator(_clean_text), AfterValidator(_memory_size)]
ModeName = Annotated[str, StringConstraints(pattern=r"^[a-z0-9][a-z0-9._-]{0,31}$")]
SlotName = Annotated[str, StringConstraints(pattern=r"^(cpu|cuda:[0-9]{1,3})$")]
JobState = Literal[JOB_STATES]  # type: ignore[valid-type]


# The wire types of the tune options whose field type is wider than what a job may send:
# text is bounded and checked, and a memory limit is text (e.g. "4GiB"), never bytes.
_WIRE_TYPES: dict[str, Any] = {"modes": list[ModeName], "memory_limit": MemorySize | None, "out": Text | None}


def _job_options_model() -> type[BaseModel]:
    """The ``options`` of a job request, built from :class:`TuneOptions`'s fields (names,
    defaults, help, bounds), so the wire cannot drift from ``mpadvise tune``; only the wire
    types of text fields are the daemon's. Strict: no coercion, no unknown fields, no NaN."""
    options = [option for option in option_info() if option.job]
    definitions: dict[str, Any] = {}
    for option in options:
        listed = isinstance(option.default, tuple)
        bounds: dict[str, Any] = {}
        if option.minimum is not None:
            bounds["gt" if option.above else "ge"] = option.minimum
        if option.job_limit is not None:
            bounds["max_length" if listed else "le"] = option.job_limit
        default: dict[str, Any] = {"default_factory": list} if listed else {"default": option.default}
        note = " Absolute, under an allowed root." if option.name == "out" else ""  # the daemon's
        description = option.help + note
        definitions[option.name] = (_WIRE_TYPES.get(option.name, option.type),
                                    Field(description=description, **default, **bounds))
    return create_model(
        "TuneOptions", __config__=ConfigDict(extra="forbid", strict=True, allow_inf_nan=False),
        __doc__="The ``mpadvise tune`` options a job may set (bounded; the daemon picks the device).",
        **definitions,
    )


TuneOptionsModel = _job_options_model()


class JobRequest(BaseModel):
    """A tune job: the script, its arguments (a list, never a shell line) and tune options."""

    model_config = ConfigDict(extra="forbid", strict=True)

    script: Annotated[Text, StringConstraints(min_length=1)] = Field(
        description="Absolute path of the training script, under an allowed root.")
    args: list[Text] = Field(default_factory=list, max_length=MAX_ARGS, description="The script's own arguments.")
    options: TuneOptionsModel = Field(default_factory=TuneOptionsModel)  # type: ignore[valid-type]
    gpu: SlotName | None = Field(None, description="Run on this slot (cpu or cuda:N); default: the first free one.")
    cwd: Text | None = Field(None, description="Working directory (absolute, under an allowed root); default: the script's.")


class SlotInfo(BaseModel):
    name: str
    uuid: str | None = None
    job: str | None = None
    phase: str


class Health(BaseModel):
    status: Literal["ok"]
    version: str
    pid: int
    started_at: str
    uptime_s: float
    slots: list[SlotInfo]
    jobs: dict[str, int]


class HardwareReport(BaseModel):
    primary: str
    devices: list[dict[str, Any]]
    slots: list[SlotInfo]
    detected_at: str


# A cache record as the daemon serves it, from the cache's one record schema: a field every
# stored record has is required; the others may be null (``trials`` is absent unless asked for).
Recommendation = create_model("Recommendation", __module__=__name__, **{
    field.name: (field.annotation, ...) if field.not_null else (field.annotation | None, None)
    for field in RECORD_FIELDS
})


class RecommendationList(BaseModel):
    count: int
    recommendations: list[Recommendation]


class Job(BaseModel):
    id: str
    state: JobState
    script: str
    args: list[str]
    options: dict[str, Any]
    created_at: str
    started_at: str | None = None
    finished_at: str | None = None
    attempts: int
    progress: dict[str, Any] | None = None
    result: dict[str, Any] | None = None
    log_tail: str | None = None
    gpu: str | None = None
    requested_gpu: str | None = None


class JobList(BaseModel):
    count: int
    jobs: list[Job]


class ErrorBody(BaseModel):
    detail: str


class ValidationItem(BaseModel):
    loc: list[str | int]
    msg: str
    type: str


class ValidationErrorBody(BaseModel):
    detail: list[ValidationItem]


_ERRORS = {400: "Bad Host header, or a body that is not JSON", 401: "Token missing",
           403: "Token wrong, or path outside the allowed roots", 404: "No such job",
           409: "The job has already finished", 413: "Body too large",
           422: "Invalid request: each item says where (loc) and what (msg)",
           429: "Too many jobs queued (the daemon's cap); try again later",
           503: "The cache database is busy or unusable"}


def error_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """The OpenAPI document's error answers of a route."""
    return {code: {"model": ValidationErrorBody if code == 422 else ErrorBody, "description": _ERRORS[code]}
            for code in codes}
