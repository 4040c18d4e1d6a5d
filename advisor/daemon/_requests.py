"""What a client may send: validated request bodies (the OpenAPI document is built from them)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints

from advisor.daemon._config import MAX_ARGS, MAX_TEXT
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
    from probes._trial import parse_memory

    try:
        parse_memory(value)
    except MpadviseError as exc:
        raise ValueError(str(exc)) from None
    return value


Text = Annotated[str, StringConstraints(max_length=MAX_TEXT), AfterValidator(_clean_text)]
MemorySize = Annotated[str, StringConstraints(max_length=32), AfterValidator(_clean_text), AfterValidator(_memory_size)]
ModeName = Annotated[str, StringConstraints(pattern=r"^[a-z0-9][a-z0-9._-]{0,31}$")]
SlotName = Annotated[str, StringConstraints(pattern=r"^(cpu|cuda:[0-9]{1,3})$")]
JobState = Literal["queued", "running", "cancelling", "succeeded", "failed", "cancelled", "interrupted"]


class TuneOptions(BaseModel):
    """The ``mpadvise tune`` options a job may set (bounded; the daemon picks the device)."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    trials: int = Field(20, ge=1, le=10_000, description="Trial budget of the search.")
    time_budget: float | None = Field(None, gt=0, le=30 * 86400, description="Seconds after which no new trial starts.")
    steps: int = Field(40, ge=1, le=1_000_000, description="Measured optimizer steps per trial.")
    warmup: int = Field(5, ge=0, le=100_000, description="Warm-up steps per trial, not timed.")
    modes: list[ModeName] = Field(default_factory=list, max_length=16, description="Restrict the search to these modes.")
    scale_batch: bool = Field(False, description="Also try larger global batches.")
    include_emulated: bool = Field(False, description="Also search FP8 emulated on a CPU.")
    memory_limit: MemorySize | None = Field(None, description="e.g. 4GiB: candidates above it are infeasible.")
    timeout: float = Field(600.0, gt=0, le=7 * 86400, description="Seconds before a trial is killed.")
    seed: int = Field(0, ge=0, le=2**31 - 1, description="Seed shared by every trial and the sampler.")
    resume: bool = Field(False, description="Continue the stored study instead of starting afresh.")
    out: Text | None = Field(None, description="Config file to write (absolute, under an allowed root).")
    no_cache: bool = Field(False, description="Do not store the answer in the cache.")
    no_priors: bool = Field(False, description="Measure candidates the matmul priors rule out.")


class JobRequest(BaseModel):
    """A tune job: the script, its arguments (a list, never a shell line) and tune options."""

    model_config = ConfigDict(extra="forbid", strict=True)

    script: Annotated[Text, StringConstraints(min_length=1)] = Field(
        description="Absolute path of the training script, under an allowed root."
    )
    args: list[Text] = Field(default_factory=list, max_length=MAX_ARGS, description="The script's own arguments.")
    options: TuneOptions = Field(default_factory=TuneOptions)
    gpu: SlotName | None = Field(None, description="Run on this slot (cpu or cuda:N); default: the first free one.")
    cwd: Text | None = Field(None, description="Working directory (absolute, under an allowed root); default: the script's.")
