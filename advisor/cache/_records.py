"""The recommendation record: its one schema (:data:`RECORD_FIELDS`), its checks, its rows and
its export form; and the job states. Pure: no database; only :func:`read_export` reads a file."""

from __future__ import annotations

import datetime
import functools
import json
import math
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_origin

from probes import MpadviseError

Record = dict[str, Any]

EXPORT_FORMAT = "mpadvise-recommendations"
EXPORT_FORMAT_VERSION = 1

JOB_STATES = ("queued", "running", "cancelling", "succeeded", "failed", "cancelled", "interrupted")
FINISHED_JOB_STATES = ("succeeded", "failed", "cancelled", "interrupted")

TRIAL_FIELDS = ("number", "mode", "params", "outcome", "verdict", "reason", "goodput", "metrics")
_TRIAL_JSON = ("params", "metrics")

# Shapes, not registries: a record is checked only for values that cannot be something else
# (a path, a sentence, an empty string). The daemon's query filters use the same patterns.
MODE_PATTERN = re.compile(r"[a-z0-9][a-z0-9._-]{0,31}")
WORKLOAD_FP_PATTERN = re.compile(r"[0-9a-f]{16,64}")
HARDWARE_FP_PATTERN = re.compile(r"[A-Za-z0-9][\x21-\x7e]{0,255}")


def utc_now() -> str:
    """The current time in the store's one form (UTC, ISO 8601, microseconds): it sorts as text."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="microseconds")


# Checks of single values: each returns the value normalised, or raises naming the field.


def check_hardware_fp(name: str, value: Any) -> str:
    if not isinstance(value, str) or not HARDWARE_FP_PATTERN.fullmatch(value):
        raise MpadviseError(f"{name} must be 1 to 256 printable characters without spaces, starting with a "
                            f"letter or digit, got {value!r}")
    return value


def _workload_fp(name: str, value: Any) -> str:
    if not isinstance(value, str) or not WORKLOAD_FP_PATTERN.fullmatch(value):
        raise MpadviseError(f"{name} must be 16 to 64 lowercase hex characters, got {value!r}")
    return value


def _string_or_null(name: str, value: Any) -> str | None:
    if value is not None and not isinstance(value, str):
        raise MpadviseError(f"{name} must be a string or null, got {value!r}")
    return value


def _number(name: str, value: Any, *, optional: bool = False) -> float | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        expected = "a finite number or null" if optional else "a finite number"
        raise MpadviseError(f"{name} must be {expected}, got {value!r}")
    return float(value)


def _json_object(name: str, value: Any, *, optional: bool = False) -> dict[str, Any] | None:
    if value is None and optional:
        return None
    if not isinstance(value, dict):
        expected = "a JSON object or null" if optional else "a JSON object"
        raise MpadviseError(f"{name} must be {expected}, got {type(value).__name__}")
    json_text(name, value)  # raises for what JSON cannot hold
    return value


def _id_or_null(name: str, value: Any) -> int | None:
    """A positive integer, or absent (an export from before ids were exported)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise MpadviseError(f"{name} must be a positive integer, got {value!r}")
    return value


def _policy(name: str, value: Any) -> dict[str, Any]:
    mode = _json_object(name, value).get("mode")  # type: ignore[union-attr]
    if not isinstance(mode, str) or not MODE_PATTERN.fullmatch(mode):
        raise MpadviseError(f"{name}.mode must be a mode name such as 'bf16-mixed', got {mode!r}")
    return value


def _timestamp(name: str, value: Any) -> str:
    """An imported timestamp in the store's one text form (UTC, microseconds)."""
    try:
        # Python 3.10's fromisoformat does not accept the "Z" suffix.
        parsed = datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except (AttributeError, TypeError, ValueError):  # not text, or not a timestamp
        raise MpadviseError(f"{name} must be an ISO 8601 timestamp, got {value!r}") from None
    if parsed.tzinfo is None:
        raise MpadviseError(f"{name} must include a time zone, got {value!r}")
    return parsed.astimezone(datetime.timezone.utc).isoformat(timespec="microseconds")


def _trials(name: str, value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise MpadviseError(f"{name} must be a list, got {type(value).__name__}")
    for index, trial in enumerate(value):
        where = f"{name}[{index}]"
        if not isinstance(trial, dict):
            raise MpadviseError(f"{where} must be a JSON object, got {type(trial).__name__}")
        unknown = sorted(set(trial) - set(TRIAL_FIELDS))
        if unknown:
            raise MpadviseError(f"{where} has unknown field {unknown[0]!r}; trial fields are "
                                f"{', '.join(TRIAL_FIELDS)} (put anything else in 'metrics')")
        number = trial.get("number", index)
        if not isinstance(number, int) or isinstance(number, bool):
            raise MpadviseError(f"{where}.number must be an integer, got {number!r}")
        for field in ("mode", "outcome", "verdict", "reason"):
            _string_or_null(f"{where}.{field}", trial.get(field))
        _number(f"{where}.goodput", trial.get("goodput"), optional=True)
        for field in _TRIAL_JSON:
            _json_object(f"{where}.{field}", trial.get(field), optional=True)
    return value


def encoded(value: Any) -> str:
    """``value`` as the store's JSON: sorted keys, no NaN or infinity (SQLite's JSON refuses it)."""
    return json.dumps(value, sort_keys=True, allow_nan=False)


def json_text(name: str, value: Any, *, require_dict: bool = False) -> str:
    """:func:`encoded`, or an error naming ``name`` when ``value`` has no JSON text."""
    if require_dict and not isinstance(value, dict):
        raise MpadviseError(f"{name} must be a dict, got {type(value).__name__}")
    try:
        return encoded(value)
    except (TypeError, ValueError) as exc:
        raise MpadviseError(f"{name} is not JSON-serialisable ({exc})") from None


@dataclass(frozen=True)
class RecordField:
    """One field of a recommendation record. ``origin``: who gives it (the caller on put and
    import; an export file, or on put the store; the store). ``not_null``: every stored record
    has one. ``stored``: a ``recommendations`` column, the row id, ``hardware`` or ``trials``."""

    name: str
    annotation: Any
    origin: Literal["caller", "export", "store"] = "caller"
    check: Callable[[str, Any], Any] | None = None
    required: bool = False
    not_null: bool = False
    stored: Literal["row", "id", "hardware", "trials"] = "row"


RECORD_FIELDS: tuple[RecordField, ...] = (
    # Exported, so that an import can keep an entry's id where it is free (the store assigns
    # a new one where it is not, and says so).
    RecordField("id", int, origin="export", check=_id_or_null, not_null=True, stored="id"),
    RecordField("hardware_fp", str, check=check_hardware_fp, required=True, not_null=True),
    RecordField("workload_fp", str, check=_workload_fp, required=True, not_null=True),
    RecordField("script", str, check=_string_or_null),
    # policy["mode"], kept in a column of its own for listings.
    RecordField("mode", str, origin="store", not_null=True),
    RecordField("policy", dict[str, Any], check=_policy, required=True, not_null=True),
    RecordField("speedup_vs_fp32", float, check=functools.partial(_number, optional=True)),
    RecordField("goodput", float, check=_number, required=True),
    RecordField("created_at", str, origin="export", check=_timestamp, not_null=True),
    RecordField("versions", dict[str, Any], check=_json_object, required=True),
    RecordField("summary", dict[str, Any], check=_json_object, required=True),
    RecordField("hardware", dict[str, Any], origin="export", check=functools.partial(_json_object, optional=True),
                stored="hardware"),
    RecordField("trials", list[dict[str, Any]], check=_trials, required=True, stored="trials"),
)

_ROW_COLUMNS = tuple(field for field in RECORD_FIELDS if field.stored == "row")
_JSON_FIELDS = tuple(field.name for field in RECORD_FIELDS if (get_origin(field.annotation) or field.annotation)
                     in (dict, list))
_EXPORTED_FIELDS = tuple(field.name for field in RECORD_FIELDS if field.origin != "store")


def validated_record(raw: Any, *, imported: bool = False) -> Record:
    """Check a recommendation against :data:`RECORD_FIELDS`; return it normalised, with ``mode``
    from its policy. An ``imported`` one also brings its export fields. Errors name the field."""
    if not isinstance(raw, dict):
        raise MpadviseError(f"a record must be a JSON object, got {type(raw).__name__}")
    given = [field for field in RECORD_FIELDS if field.origin == "caller" or (imported and field.origin == "export")]
    for field in given:
        if field.required and field.name not in raw:
            raise MpadviseError(f"required field {field.name!r} is missing")
    record = {field.name: field.check(field.name, raw.get(field.name)) for field in given}  # type: ignore[misc]
    mode = record["policy"]["mode"]
    if imported and raw.get("mode", mode) != mode:
        raise MpadviseError(f"mode {raw['mode']!r} disagrees with policy.mode {mode!r}")
    record["mode"] = mode
    return record


def recommendation_row(record: Record) -> dict[str, Any]:
    return {name: encoded(record[name]) if name in _JSON_FIELDS else record[name]
            for name in (field.name for field in _ROW_COLUMNS)}


def trial_rows(recommendation_id: int, trials: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ``trials`` rows of validated trials (a trial without a number gets its position)."""
    rows = []
    for index, trial in enumerate(trials):
        row: dict[str, Any] = {"recommendation_id": recommendation_id}
        for name in TRIAL_FIELDS:
            value = trial.get(name, index if name == "number" else None)
            row[name] = encoded(value) if name in _TRIAL_JSON and value is not None else value
        rows.append(row)
    return rows


def decode_json(row: dict[str, Any], columns: Iterable[str]) -> dict[str, Any]:
    for column in columns:
        if row.get(column) is not None:
            row[column] = json.loads(row[column])
    return row


def export_document(rows: Iterable[Record]) -> dict[str, Any]:
    """The export file's content for stored records (with their trials and hardware)."""
    # versions and summary are required on import: a row stored without them (edited by hand)
    # still exports as a file that imports.
    records = [{**{name: row[name] for name in _EXPORTED_FIELDS}, "versions": row["versions"] or {},
                "summary": row["summary"] or {}} for row in rows]
    return {"format": EXPORT_FORMAT, "format_version": EXPORT_FORMAT_VERSION, "exported_at": utc_now(),
            "records": records}


def read_export(source: Path, *, check: Callable[[Record], object] | None = None) -> list[Record]:
    """The records of an export file, every one validated (and passed to ``check``, which may
    raise MpadviseError or ValueError) before any is returned; errors name file, record, field."""
    try:
        text = source.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise MpadviseError(f"cannot read {source}: {reason}") from None
    try:
        document = json.loads(text)
    except json.JSONDecodeError as exc:
        raise MpadviseError(f"{source} is not an mpadvise export: invalid JSON at line {exc.lineno} column "
                            f"{exc.colno} ({exc.msg}); nothing was imported") from None
    if not isinstance(document, dict) or document.get("format") != EXPORT_FORMAT:
        found = document.get("format") if isinstance(document, dict) else type(document).__name__
        raise MpadviseError(f"{source} is not an mpadvise export: expected format {EXPORT_FORMAT!r}, got "
                            f"{found!r}; nothing was imported")
    version = document.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise MpadviseError(f"{source}: format_version must be a positive integer, got {version!r}; "
                            "nothing was imported")
    if version > EXPORT_FORMAT_VERSION:
        raise MpadviseError(f"{source} was written by a newer mpadvise (format_version {version}; this one "
                            f"reads up to {EXPORT_FORMAT_VERSION}); upgrade mpadvise to import it")
    records = document.get("records")
    if not isinstance(records, list):
        raise MpadviseError(f"{source}: 'records' must be a list, got {type(records).__name__}; "
                            "nothing was imported")
    validated = []
    for index, raw in enumerate(records):
        try:
            validated.append(validated_record(raw, imported=True))
            if check is not None:
                check(validated[-1])
        except (MpadviseError, ValueError) as exc:
            raise MpadviseError(f"{source}: record {index}: {exc}; nothing was imported") from None
    return validated
