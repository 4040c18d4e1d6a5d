"""What the daemon answers: validated response bodies (the OpenAPI document is built from them)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, create_model

from advisor.cache import RECORD_FIELDS
from advisor.daemon._requests import JobState


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
