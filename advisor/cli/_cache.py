"""``mpadvise show`` and ``mpadvise cache list|show|export|import|clear``: the cache, for people.

Reading commands treat a cache that cannot be opened as empty (one warning, exit 0); commands
that change it, and ``export``, need it and fail with one line saying why.
"""

from __future__ import annotations

import datetime
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

import probes
from advisor._log import get_logger
from advisor._paths import database_path
from advisor.cache import entry_status, nothing_cached_yet, read_export
from advisor.cli._cache_cells import (
    guard_event_rows,
    plural,
    render_list,
    render_record,
    render_show,
    summary_row,
)
from advisor.cli._common import JsonOption, bad_value, console, emit, handle_errors, print_json
from policies import Policy
from probes import HardwareProfile, MpadviseError, UsageError, hardware_fingerprint

if TYPE_CHECKING:
    from advisor.cache import Store

_DURATION = re.compile(r"(\d+(?:\.\d+)?)\s*([smhdw])")
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


@handle_errors
def show(
    all_hardware: Annotated[bool, typer.Option(
        "--all", help="Also list entries tuned on other hardware or versions.")] = False,
    details: Annotated[bool, typer.Option(
        "--details", help="Each entry in full as well: its evidence, versions and every trial.")] = False,
    json_output: JsonOption = False,
) -> None:
    """Cached recommendations for this machine, and whether each still applies here."""
    report = show_report(_machine_profiles(), include_other=all_hardware)
    records = [cache_show_report(row["id"]) for row in report["recommendations"]] if details else []
    if json_output:
        print_json({**report, "details": records} if details else report)
        return
    render_show(report, console)
    for record in records:
        render_record(record, console)


def cache_list(json_output: JsonOption = False) -> None:
    """Every cached recommendation, for any hardware, newest first."""
    rows = _read_rows()
    emit({"database": str(database_path()), "cache": rows is not None,
          "recommendations": [summary_row(row) for row in rows or []]}, json_output, render_list)


def cache_show(
    recommendation_id: Annotated[int, typer.Argument(metavar="ID", help="The id `mpadvise cache list` shows.")],
    json_output: JsonOption = False,
) -> None:
    """One cached recommendation in full: policy, versions, hardware and its trials."""
    emit(cache_show_report(recommendation_id), json_output, render_record)


def cache_export(
    file: Annotated[Path, typer.Argument(help="The JSON file to write (replaced if it exists).")],
    ids: Annotated[list[int] | None, typer.Option(
        "--id", help="Export only this recommendation; repeat for several.")] = None,
    json_output: JsonOption = False,
) -> None:
    """Write recommendations, their hardware profiles and trials to a file to share."""
    with bad_value():  # a file that cannot be written there is a bad value, found before the cache is read
        probes.check_writable(file, "export file")
    with _writable_store() as store:
        report = {"file": str(file), "exported": store.export_records(file, ids=ids or None), "database": str(store.path)}
    emit(report, json_output, lambda report, console: console.print(
        f"exported {plural(report['exported'], 'recommendation')} to {report['file']}", highlight=False))


def cache_import(
    file: Annotated[Path, typer.Argument(help="A file written by `mpadvise cache export`.")],
    json_output: JsonOption = False,
) -> None:
    """Add the recommendations of an exported file; refuses the whole file if any record is bad."""
    # A file named that is not there is a bad value, refused first; otherwise the store comes
    # first: an unusable cache is the error to report, whatever the file holds.
    if not file.is_file():
        raise UsageError(f"{file} {'is not a file' if file.exists() else 'does not exist'}; expected a file "
                         "written by `mpadvise cache export`")
    with _writable_store() as store:
        # All or nothing: every record is checked before any is written.
        records = read_export(file, check=_check_imported_record)
        imported = store.import_validated(records)
        report = {"file": str(file), "records": len(records), "imported": imported.written,
                  "kept_newer": len(records) - imported.written, "database": str(store.path),
                  "ids": [{"exported": old, "id": new} for old, new in imported.ids],
                  "renumbered": [{"exported": old, "id": new} for old, new in imported.renumbered]}
    if json_output:
        print_json(report)
        return
    line = f"imported {report['imported']} of {plural(report['records'], 'record')} from {report['file']}"
    if report["kept_newer"]:
        line += f" ({report['kept_newer']} kept: the cached answer for the same key is newer)"
    console.print(line, highlight=False)
    if report["renumbered"]:
        moved = ", ".join(f"#{pair['exported']} -> #{pair['id']}" for pair in report["renumbered"])
        console.print(f"new ids, as those ids were taken in this cache: {moved}", highlight=False)


def cache_clear(
    older_than: Annotated[str | None, typer.Option(
        "--older-than", metavar="DURATION", help="Only entries older than this: 30d, 12h, 90m, 2w.")] = None,
    yes: Annotated[bool, typer.Option(
        "--yes", "-y", help="Delete without asking (needed where stdin is not a terminal).")] = False,
    json_output: JsonOption = False,
) -> None:
    """Delete cached recommendations and their trials (hardware profiles are kept); asks first."""
    age = parse_duration(older_than) if older_than is not None else None
    scope = f" older than {older_than}" if older_than is not None else ""
    with _writable_store() as store:
        if not yes and not _ask(f"Delete the cached recommendations{scope} in {store.path}?"):
            raise MpadviseError(f"nothing deleted from {store.path}")
        report = {"deleted": store.clear(age), "older_than_seconds": None if age is None else age.total_seconds(),
                  "database": str(store.path)}
    emit(report, json_output, lambda report, console: console.print(
        f"deleted {plural(report['deleted'], 'recommendation')}{scope} from {report['database']}", highlight=False))


def _ask(question: str) -> bool:
    """A yes/no question on the terminal (default no); without a terminal, ``--yes`` must say it."""
    if not sys.stdin.isatty():
        raise UsageError(f"{question[:-1].lower()}: stdin is not a terminal to confirm on; pass --yes to delete")
    return typer.confirm(question, default=False)


def parse_duration(text: str) -> datetime.timedelta:
    """``"30d"`` -> 30 days; also ``s``, ``m``, ``h``, ``w`` and sums such as ``1d12h``."""
    compact = text.strip().lower()
    parts = list(_DURATION.finditer(compact))
    covered = "".join(match.group(0) for match in parts)
    if not parts or covered.replace(" ", "") != compact.replace(" ", ""):
        raise UsageError(f"--older-than {text!r} is not a duration; expected a number and a unit (s, m, h, d, "
                         "w) such as 30d, 12h or 1d12h")
    seconds = sum(float(match.group(1)) * _UNIT_SECONDS[match.group(2)] for match in parts)
    if seconds <= 0:
        raise UsageError(f"--older-than {text!r} must be longer than zero, such as 30d")
    return datetime.timedelta(seconds=seconds)


def show_report(profiles: list[HardwareProfile], *, include_other: bool = False) -> dict[str, Any]:
    """What ``mpadvise show`` prints: this machine's entries (``profiles``, the training device
    first), each judged valid or not here; ``cache`` is False when no cache could be opened, and
    ``other_hardware`` counts the entries of other fingerprints (listed with ``include_other``)."""
    local = {hardware_fingerprint(profile): profile for profile in profiles}
    report: dict[str, Any] = {"database": str(database_path()), "cache": False,
                              "hardware": [{"fingerprint": fp, "device": p.name} for fp, p in local.items()],
                              "recommendations": [], "other_hardware": 0, "guard_events": []}
    rows = _read_rows()
    if rows is None:
        return report
    report["cache"] = True
    # What the runtime guard saw in long runs here: the next load_policy() heeds it.
    report["guard_events"] = guard_event_rows([e for e in _read_rows(events=True) or [] if e["hardware_fp"] in local])
    for row in rows:
        here = local.get(row["hardware_fp"])
        if here is None:
            report["other_hardware"] += 1
            if not include_other:
                continue
            reason = entry_status(row, profiles[0])
            status = f"other hardware: {reason.what_differs() if reason is not None else 'tuned on other hardware'}"
        else:
            reason = entry_status(row, here)
            status = "valid" if reason is None else reason.describe()
        entry = summary_row(row)
        entry.update(this_machine=here is not None, valid=reason is None, status=status)
        report["recommendations"].append(entry)
    return report


def cache_show_report(recommendation_id: int) -> dict[str, Any]:
    """One recommendation with its trials, hardware profile and versions."""
    from advisor.cache import open_store

    get_logger()  # attaches the handler for the cache's warnings
    if nothing_cached_yet(database_path()):
        raise MpadviseError(f"recommendation #{recommendation_id} is not in the cache: nothing is cached in "
                            f"{database_path()} yet; `mpadvise tune` caches its answers")
    store = open_store()
    if store is None:
        raise MpadviseError(f"recommendation #{recommendation_id} cannot be read: the cache {database_path()} "
                            "cannot be opened (see the warning above)")
    with store:
        record = store.get(recommendation_id)
    if record is None:
        raise MpadviseError(f"recommendation #{recommendation_id} is not in the cache {store.path}; "
                            "`mpadvise cache list` lists the ids")
    return record


def _machine_profiles() -> list[HardwareProfile]:
    """This machine's devices, training device first (tests replace this)."""
    return probes.detect()


def _read_rows(*, events: bool = False) -> list[dict[str, Any]] | None:
    """Every recommendation (or, with ``events``, every guard event), newest first; ``None``
    when no cache can be opened (one warning)."""
    from advisor.cache import open_store

    get_logger()
    path = database_path()
    if nothing_cached_yet(path):
        return []
    store = open_store(path)
    if store is None:
        return None
    with store:
        return store.list_guard_events() if events else store.list_recommendations()


def _writable_store() -> Store:
    """The cache, for commands that need it: raises one clear line when it cannot be opened."""
    from advisor.cache import Store

    get_logger()
    return Store(database_path())


def _check_imported_record(record: dict[str, Any]) -> None:
    """Refuse a record (already checked against the cache's schema) that this mpadvise cannot
    apply, or whose hardware fingerprint is not the one its policy and its profile give."""
    tuned = Policy.from_dict(record["policy"], source="policy").tuned_on
    claimed = record["hardware_fp"]
    if tuned is not None and tuned.hardware_fingerprint and tuned.hardware_fingerprint != claimed:
        raise MpadviseError(f"hardware_fp {claimed!r} disagrees with the policy's tuned_on.hardware_fingerprint "
                            f"{tuned.hardware_fingerprint!r}; the record was edited or is corrupt")
    profile = record["hardware"]
    if profile is None:
        raise MpadviseError("it carries no hardware profile, so its hardware fingerprint cannot be checked; "
                            "export it again with `mpadvise cache export`")
    try:
        computed = hardware_fingerprint(HardwareProfile.from_dict(profile))
    except (TypeError, ValueError) as exc:
        raise MpadviseError(f"its hardware profile is invalid ({exc})") from None
    if computed != claimed:
        raise MpadviseError(f"hardware_fp {claimed!r} is not the fingerprint of its hardware profile "
                            f"({computed!r}): the record was edited, or written by an mpadvise with another "
                            "fingerprint recipe; export it again from the machine that tuned it")


app = typer.Typer(name="cache", help="The per-GPU recommendation cache: list, show, export, import, clear.",
                  no_args_is_help=True, context_settings={"help_option_names": ["-h", "--help"]})
for _command in (cache_list, cache_show, cache_export, cache_import, cache_clear):
    app.command(_command.__name__.removeprefix("cache_"))(handle_errors(_command))
