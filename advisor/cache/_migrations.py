"""Schema changes, applied in order and recorded in the ``_migrations`` table (``PRAGMA
user_version`` counts them). A released migration is history: never edited, only followed."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from advisor.cache._base import transaction
from advisor.cache._records import utc_now
from probes import HardwareProfile, hardware_fingerprint

if TYPE_CHECKING:
    import sqlite_utils

MigrationFunction = Callable[["sqlite_utils.Database"], None]

_MIGRATIONS: list[tuple[str, MigrationFunction]] = []


class UnknownSchemaError(Exception):
    """The database was written by a newer (or a different) program than this one."""


def migration(function: MigrationFunction) -> MigrationFunction:
    """Register ``function`` as the next schema migration (its name is its record); it runs
    inside the migrating transaction, so it must not commit."""
    if any(name == function.__name__ for name, _ in _MIGRATIONS):
        raise ValueError(f"migration {function.__name__!r} is registered twice")
    _MIGRATIONS.append((function.__name__, function))
    return function


@migration
def m001_initial_schema(db: sqlite_utils.Database) -> None:
    """Hardware profiles, recommendations with their trials, and the daemon's job queue."""
    db.table("hardware").create({"fingerprint": str, "profile": str, "first_seen": str, "last_seen": str},
                                pk="fingerprint", not_null=["profile", "first_seen", "last_seen"])
    db.table("recommendations").create(
        {
            "id": int, "hardware_fp": str, "workload_fp": str, "script": str, "mode": str,
            "policy": str, "speedup_vs_fp32": float, "goodput": float, "created_at": str,
            "versions": str, "summary": str,
        },
        pk="id", not_null=["hardware_fp", "workload_fp", "mode", "policy", "created_at"],
    )
    # The lookup key, and the rule that one key holds one answer.
    db.table("recommendations").create_index(["hardware_fp", "workload_fp"], unique=True)
    db.table("recommendations").create_index(["created_at"])
    db.table("trials").create(
        {
            "id": int, "recommendation_id": int, "number": int, "mode": str, "params": str,
            "outcome": str, "verdict": str, "reason": str, "goodput": float, "metrics": str,
        },
        pk="id", not_null=["recommendation_id", "number"], foreign_keys=[("recommendation_id", "recommendations", "id")],
    )
    db.table("trials").create_index(["recommendation_id", "number"])
    db.table("jobs").create(
        {
            "id": str, "state": str, "script": str, "args": str, "options": str, "created_at": str,
            "started_at": str, "finished_at": str, "attempts": int, "progress": str, "result": str,
            "log_tail": str, "gpu": str, "requested_gpu": str,
        },
        pk="id", not_null=["state", "script", "created_at", "attempts"], defaults={"attempts": 0},
    )
    db.table("jobs").create_index(["state", "created_at"])


@migration
def m002_hardware_fingerprint_recipe_2(db: sqlite_utils.Database) -> None:
    """Rekey hardware profiles and recommendations from fingerprint recipe 1 to recipe 2 (which
    no longer covers driver, patch releases or FP8 library versions); an unreadable profile
    keeps its key. Of entries that now share a key, the newest answer is kept."""
    renamed = _rekey_hardware(db)
    if not renamed:
        return
    rows = list(db.query("SELECT id, hardware_fp, workload_fp, policy FROM recommendations ORDER BY created_at DESC, id DESC"))
    taken: set[tuple[str, str]] = set()
    losers, winners = [], []
    for row in rows:
        key = (renamed.get(row["hardware_fp"], row["hardware_fp"]), row["workload_fp"])
        if key in taken:
            losers.append(row["id"])
        else:
            taken.add(key)
            if row["hardware_fp"] in renamed:
                winners.append((row, key[0]))
    for recommendation_id in losers:
        db.execute("DELETE FROM trials WHERE recommendation_id = ?", [recommendation_id])
        db.execute("DELETE FROM recommendations WHERE id = ?", [recommendation_id])
    for row, fingerprint in winners:
        db.execute("UPDATE recommendations SET hardware_fp = ?, policy = ? WHERE id = ?",
                   [fingerprint, _policy_rekeyed(row["policy"], row["hardware_fp"], fingerprint), row["id"]])


@migration
def m003_guard_events(db: sqlite_utils.Database) -> None:
    """What the runtime guard saw in a long run, per hardware, workload and script."""
    db.table("guard_events").create(
        {
            "id": int, "hardware_fp": str, "workload_fp": str, "script": str, "signal": str,
            "step": int, "tripped_at": int, "policy": str, "fallback": str, "action": str,
            "detail": str, "created_at": str,
        },
        pk="id", not_null=["hardware_fp", "signal", "step", "policy", "action", "created_at"],
    )
    db.table("guard_events").create_index(["hardware_fp", "script"])


def _rekey_hardware(db: sqlite_utils.Database) -> dict[str, str]:
    """Key every hardware row by recipe 2, merging the rows that now share a key (the latest
    profile, the first and last sightings of all); returns ``{old: new}`` for changed keys."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for row in db.query("SELECT * FROM hardware"):
        try:
            profile = HardwareProfile.from_dict(json.loads(row["profile"]))
            fingerprint = hardware_fingerprint(profile, version=2)
        except (TypeError, ValueError, KeyError):
            fingerprint = row["fingerprint"]  # not a profile this code reads: the key stays
        groups.setdefault(fingerprint, []).append(row)
    renamed = {}
    for fingerprint, rows in groups.items():
        if [row["fingerprint"] for row in rows] == [fingerprint]:
            continue
        latest = max(rows, key=lambda row: row["last_seen"])
        first_seen = min(row["first_seen"] for row in rows)
        for row in rows:
            db.execute("DELETE FROM hardware WHERE fingerprint = ?", [row["fingerprint"]])
            if row["fingerprint"] != fingerprint:
                renamed[row["fingerprint"]] = fingerprint
        db.execute("INSERT INTO hardware (fingerprint, profile, first_seen, last_seen) VALUES (?, ?, ?, ?)",
                   [fingerprint, latest["profile"], first_seen, latest["last_seen"]])
    return renamed


def _policy_rekeyed(text: str, old: str, new: str) -> str:
    """A stored policy whose ``[tuned_on]`` names the old key, naming the new one instead."""
    try:
        policy = json.loads(text)
        tuned = policy.get("tuned_on")
    except (ValueError, AttributeError):
        return text  # damaged by hand: reading it reports that, not the migration
    if isinstance(tuned, dict) and tuned.get("hardware_fingerprint") == old:
        tuned["hardware_fingerprint"] = new
        return json.dumps(policy, sort_keys=True, allow_nan=False)
    return text


SCHEMA_VERSION = len(_MIGRATIONS)


def migrate(db: sqlite_utils.Database) -> list[str]:
    """Apply the migrations that ``db`` lacks, in order, and return their names. One ``BEGIN
    IMMEDIATE`` holds them all, so that concurrent processes opening a fresh file apply each
    migration exactly once. Raises UnknownSchemaError for a newer or foreign schema."""
    applied_now = []
    with transaction(db.conn, "BEGIN IMMEDIATE"):
        applied = _applied_migrations(db)
        migrations = db.table("_migrations").create({"name": str, "applied_at": str}, pk="name",
                                                     if_not_exists=True)
        for version, (name, function) in enumerate(_MIGRATIONS, start=1):
            if name not in applied:
                function(db)
                migrations.insert({"name": name, "applied_at": utc_now()})
                db.execute(f"PRAGMA user_version = {version}")
                applied_now.append(name)
    return applied_now


def ensure_schema(db: sqlite_utils.Database) -> None:
    """Check ``db``'s schema and migrate it when it lags; up to date, it takes no write lock."""
    if len(_applied_migrations(db)) < len(_MIGRATIONS):
        migrate(db)


def _applied_migrations(db: sqlite_utils.Database) -> set[str]:
    """The recorded migrations, after checking that this code understands them all."""
    tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    version = db.execute("PRAGMA user_version").fetchone()[0]
    if "_migrations" not in tables:
        if tables or version:
            raise UnknownSchemaError(f"it holds tables ({', '.join(sorted(tables))}) but no mpadvise schema record")
        return set()
    applied = {row[0] for row in db.execute("SELECT name FROM _migrations")}
    unknown = sorted(applied - {name for name, _ in _MIGRATIONS})
    if unknown or version > len(_MIGRATIONS):
        detail = f"migrations {', '.join(unknown)}" if unknown else f"user_version {version}"
        raise UnknownSchemaError(f"its schema is newer than this mpadvise understands ({detail}; this version "
                                 f"knows schema {len(_MIGRATIONS)})")
    return applied
