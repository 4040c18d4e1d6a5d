"""``mpadvise show``, ``mpadvise cache list|show|export|import|clear`` and ``mpadvise study
status``, and the tables they print. Reading commands treat a cache that cannot be opened as
empty (one warning, exit 0); commands that change it, and ``export``, fail with one line."""

from __future__ import annotations

import datetime
import os
import re
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Column, Table

import probes
from advisor._log import get_logger
from advisor._paths import database_path
from advisor.cache import entry_status, nothing_cached_yet, read_export
from advisor.cli._common import JsonOption, bad_value, console, emit, handle_errors, print_json
from policies import Policy, PolicyError
from probes import HardwareProfile, MpadviseError, UsageError, hardware_fingerprint

if TYPE_CHECKING:
    from advisor.cache import Store

_DURATION = re.compile(r"(\d+(?:\.\d+)?)\s*([smhdw])")
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
SPEEDUP = "×fp32"  # a cache entry's figure: the tune's one speed-up, its winner's over fp32
SCRIPT = "script args"  # tells two tunes of one script apart
FEWER_THREADS_MARK = "*"  # a figure measured on fewer CPU threads than torch's own
_GUARD_EVENT_KEYS = ("id", "script", "workload_fp", "signal", "step", "tripped_at", "policy",
                     "fallback", "action", "detail", "created_at")


@handle_errors
def show(
    all_hardware: Annotated[bool, typer.Option(
        "--all", help="Also list entries tuned on other hardware or versions.")] = False,
    details: Annotated[bool, typer.Option("--details", help="Each entry in full as well: its "
                                          "evidence, versions and every trial.")] = False,
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
    # A file that cannot be written there is a bad value, found before the cache is read.
    with bad_value():
        probes.check_writable(file, "export file")
    with _writable_store() as store:
        report = {"file": str(file), "exported": store.export_records(file, ids=ids or None),
                  "database": str(store.path)}
    emit(report, json_output, lambda report, console: console.print(
        f"exported {plural(report['exported'], 'recommendation')} to {report['file']}",
        highlight=False))


def cache_import(
    file: Annotated[Path, typer.Argument(help="A file written by `mpadvise cache export`.")],
    json_output: JsonOption = False,
) -> None:
    """Add the recommendations of an exported file; refuses the whole file if any record is bad."""
    # A missing file is a bad value, refused first; then an unusable cache is the error to report.
    if not file.is_file():
        what = "is not a file" if file.exists() else "does not exist"
        raise UsageError(f"{file} {what}; expected a file written by `mpadvise cache export`")
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
    records = plural(report["records"], "record")
    line = f"imported {report['imported']} of {records} from {report['file']}"
    if report["kept_newer"]:
        line += f" ({report['kept_newer']} kept: the cached answer for the same key is newer)"
    console.print(line, highlight=False)
    if report["renumbered"]:
        moved = ", ".join(f"#{pair['exported']} -> #{pair['id']}" for pair in report["renumbered"])
        console.print(f"new ids, as those ids were taken in this cache: {moved}", highlight=False)


def cache_clear(
    older_than: Annotated[str | None, typer.Option(
        "--older-than", metavar="DURATION",
        help="Only entries older than this: 30d, 12h, 90m, 2w.")] = None,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Delete without asking (needed where "
                                      "stdin is not a terminal).")] = False,
    json_output: JsonOption = False,
) -> None:
    """Delete cached recommendations and their trials (hardware profiles are kept); asks first."""
    age = parse_duration(older_than) if older_than is not None else None
    scope = f" older than {older_than}" if older_than is not None else ""
    with _writable_store() as store:
        question = f"Delete the cached recommendations{scope} in {store.path}?"
        if not yes and not sys.stdin.isatty():  # without a terminal to ask on, --yes must say it
            raise UsageError(f"{question[:-1].lower()}: stdin is not a terminal to confirm on; pass --yes to delete")
        if not yes and not typer.confirm(question, default=False):
            raise MpadviseError(f"nothing deleted from {store.path}")
        report = {"deleted": store.clear(age), "older_than_seconds": None if age is None else age.total_seconds(),
                  "database": str(store.path)}
    deleted = plural(report["deleted"], "recommendation")
    emit(report, json_output, lambda report, console: console.print(
        f"deleted {deleted}{scope} from {report['database']}", highlight=False))


@handle_errors
def study_status(
    storage: Annotated[str | None, typer.Option(
        "--storage", help="Optuna storage URL; default: MPADVISE_STORAGE, MPADVISE_STORAGE_FILE, else the SQLite file "
        "in the cache directory.")] = None,
    study: Annotated[str | None, typer.Option("--study", help="Only this study; default: every study.")] = None,
    json_output: JsonOption = False,
) -> None:
    """List the studies in a storage: hardware, trials by state, workers seen, the best so far."""
    from advisor.tune import default_storage_url, resolve_storage, shown_url, study_status

    # Read without writing, so it is safe beside running workers.
    url = resolve_storage(storage, os.environ) or default_storage_url()
    report = {"storage": shown_url(url), "studies": study_status(url, study)}
    emit(report, json_output, render_studies)


def render_studies(report: dict[str, Any], console: Console) -> None:
    shown, studies = report["storage"] or "", report["studies"]
    if not studies:
        console.print(f"no studies in {shown}", highlight=False)
        return
    # Short count headers (named under the table), prose wrapping at spaces: 80 columns.
    short = ("done", "run", "wait", "fail")
    table = Table(*(Column(column, justify="right", no_wrap=True) if column in short
                    else Column(column, overflow="fold", ratio=1, min_width=8)
                    for column in ("study", "hardware", *short, "workers", "best so far")),
                  title=f"studies in {shown}", title_justify="left",
                  caption="trials done, running, waiting and failed", caption_justify="left")
    for summary in studies:
        trials, best = summary["trials"], summary["best"]
        table.add_row(summary["study"], summary["hardware"] or "-",
                      *(str(trials[k]) for k in ("complete", "running", "waiting", "failed")),
                      "\n".join(summary["workers"]) or "-",
                      f"{best['label']}: {best['goodput']:,.1f} samples/s" if best else "-")
    console.print(table)


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
    first), each judged valid here or not; ``other_hardware`` counts the others."""
    local = {hardware_fingerprint(profile): profile for profile in profiles}
    report: dict[str, Any] = {"database": str(database_path()), "cache": False,
                              "hardware": [{"fingerprint": fp, "device": p.name} for fp, p in local.items()],
                              "recommendations": [], "other_hardware": 0, "guard_events": []}
    rows = _read_rows()
    if rows is None:
        return report
    report["cache"] = True
    # What the runtime guard saw in long runs here (newest first): the next load_policy() heeds it.
    events = [event for event in _read_rows(events=True) or [] if event["hardware_fp"] in local]
    report["guard_events"] = [{key: e.get(key) for key in _GUARD_EVENT_KEYS} for e in events]
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
    return probes.detect()  # training device first; tests replace this


def _read_rows(*, events: bool = False) -> list[dict[str, Any]] | None:
    """Every recommendation (or guard event), newest first; ``None`` when no cache opens."""
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
    """The cache, for commands that need it: one clear line when it cannot be opened."""
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


def _table(title: str, columns: tuple[str, ...], *, legend: str | None = None) -> Table:
    """Short columns never wrap; prose columns wrap at their spaces; ``legend`` goes under it."""
    table = Table(title=title, title_justify="left", caption=legend, caption_justify="left")
    for column in columns:
        if column in ("id", "workload", SPEEDUP, "tuned", "device"):
            table.add_column(column, no_wrap=True)
        elif column in ("status", "why not"):
            table.add_column(column, overflow="fold", ratio=2)
        elif column == "mode":
            # Wide enough that the mode names ("fp8-torchao") never break mid-word.
            table.add_column(column, overflow="fold", ratio=1, min_width=11)
        else:
            table.add_column(column, overflow="fold", ratio=1)
    return table


def _speedup(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _tuned_on(row: dict[str, Any]) -> dict[str, Any]:
    return (row.get("policy") or {}).get("tuned_on") or {}


def _fewer_threads(row: dict[str, Any]) -> bool:
    threads = _tuned_on(row).get("speedup_threads")
    return type(threads) is int and threads != 0


def _legend(rows: list[dict[str, Any]]) -> str:
    legend = (f"{SPEEDUP}: the winner's speed-up over fp32 (paired re-measurement where there was "
              "one; its interval: mpadvise cache show ID)")
    if any(_fewer_threads(row) for row in rows):
        legend += (f"; {FEWER_THREADS_MARK}: measured on fewer threads than torch's own, other "
                   "processes keeping cores busy (the gain on all cores can differ)")
    return legend + _args_legend(rows)


def _figure_cell(row: dict[str, Any]) -> str:
    fewer = row["speedup_vs_fp32"] is not None and _fewer_threads(row)
    return _speedup(row["speedup_vs_fp32"]) + (FEWER_THREADS_MARK if fewer else "")


def _args_legend(rows: list[dict[str, Any]]) -> str:
    if any(row["args"] is None and row["script_name"] for row in rows):
        return "; ?: arguments not recorded (an older tune)"
    return ""


def _script_cell(row: dict[str, Any]) -> str:
    """``"train.py --epochs 1"``; ``?`` for arguments an older tune did not record."""
    if not (name := row["script_name"]):
        return "-"
    return f"{name} ?" if row["args"] is None else shlex.join([name, *row["args"]])


def plural(count: int, singular: str, plural: str | None = None) -> str:
    return f"{count} {singular if count == 1 else (plural or singular + 's')}"


def _no_cache(report: dict[str, Any], console: Console) -> bool:
    if not report["cache"]:
        console.print(f"No cache: {report['database']} cannot be used (see the warning above).",
                      highlight=False)
    return not report["cache"]


def render_show(report: dict[str, Any], console: Console) -> None:
    """This machine's entries, then (``--all``) the others and why they do not apply here."""
    devices = ", ".join(item["device"] for item in report["hardware"]) or "this machine"
    if _no_cache(report, console):
        return
    here = [row for row in report["recommendations"] if row["this_machine"]]
    other = [row for row in report["recommendations"] if not row["this_machine"]]
    if not here:
        console.print(f"No recommendations cached for this machine ({devices}) in {report['database']}. "
                      "`mpadvise tune train.py` measures and caches one.", highlight=False)
    else:
        table = _table(f"This machine ({devices})",
                       ("id", SCRIPT, "workload", "mode", SPEEDUP, "tuned", "status"),
                       legend=_legend(here))
        for row in here:
            status = "[green]valid[/]" if row["valid"] else f"[yellow]{row['status']}[/]"
            table.add_row(str(row["id"]), _script_cell(row), row["workload_fp"][:8], row["mode"],
                          _figure_cell(row), row["tuned"], status)
        console.print(table)
    if other:
        keys, devices_legend = _device_keys(other)
        table = _table("Other hardware or versions (not applied here)",
                       ("id", "device", SCRIPT, "mode", "tuned", "why not"),
                       legend=devices_legend + _args_legend(other))
        for row in other:
            table.add_row(str(row["id"]), keys[_device_of(row)], _script_cell(row), row["mode"], row["tuned"],
                          row["status"].removeprefix("other hardware: "))
        console.print(table)
    if report.get("guard_events"):  # what a long run saw here, and what the next run applies
        table = _table("Guard events on this machine (the next load_policy() applies the fallback)",
                       ("id", "script", "signal", "step", "policy", "fallback", "action", "when"))
        for event in report["guard_events"]:
            table.add_row(str(event["id"]), escape(str(event["script"] or "-")), event["signal"], str(event["step"]),
                          event["policy"], str(event["fallback"] or "-"), event["action"], str(event["created_at"])[:10])
        console.print(table)
    if hidden := report["other_hardware"] - len(other):
        console.print(f"{plural(hidden, 'entry', 'entries')} tuned on other hardware or versions "
                      "not shown; `mpadvise show --all` lists them.", highlight=False)


def render_list(report: dict[str, Any], console: Console) -> None:
    rows = report["recommendations"]
    if _no_cache(report, console):
        return
    if not rows:
        console.print(f"The cache {report['database']} holds no recommendations.", highlight=False)
        return
    devices, devices_legend = _device_keys(rows)
    table = _table(report["database"],
                   ("id", "device", SCRIPT, "workload", "mode", SPEEDUP, "tuned"),
                   legend=devices_legend + "\n" + _legend(rows))
    for row in rows:
        # Tables show a fingerprint's prefix, as git shows short hashes; --json and `cache show` the whole key.
        table.add_row(str(row["id"]), devices[_device_of(row)], _script_cell(row), row["workload_fp"][:8], row["mode"],
                      _figure_cell(row), row["tuned"])
    console.print(table)


def _device_of(row: dict[str, Any]) -> str:
    return row["device"] or row["hardware_fp"]


def _device_keys(rows: list[dict[str, Any]]) -> tuple[dict[str, str], str]:
    """A short key per device (``d1``, ``d2``...) so a device column stays narrow, and the
    legend that names each device in full."""
    names = dict.fromkeys(_device_of(row) for row in rows)
    keys = {name: f"d{i}" for i, name in enumerate(names, 1)}
    return keys, "; ".join(f"{key}: {name}" for name, key in keys.items())


def render_record(record: dict[str, Any], console: Console) -> None:
    summary = summary_row(record)
    args = summary["args"]
    versions = ", ".join(f"{name} {version or 'absent'}" for name, version in (record["versions"] or {}).items())
    facts = Table(title=f"cache entry #{record['id']}", show_header=False, title_justify="left", title_style="bold")
    facts.add_column(style="cyan")
    facts.add_column(overflow="fold")
    arguments = "- (not recorded)" if args is None else shlex.join(args) if args else "(none)"
    goodput = f"{record['goodput']:.1f} samples/s" if record["goodput"] else "-"
    # "1.52x, the winner's speed-up over fp32 (interval 1.40x-1.65x; paired re-measurement)"
    figure = f"{_speedup(record['speedup_vs_fp32'])}, the winner's speed-up over fp32"
    tuned = _tuned_on(record)
    low, high = tuned.get("speedup_low"), tuned.get("speedup_high")
    extra = [basis] if isinstance(basis := tuned.get("speedup_basis"), str) and basis else []
    if isinstance(low, (int, float)) and isinstance(high, (int, float)) and low != high:
        extra.insert(0, f"interval {_speedup(low)}-{_speedup(high)}")  # fp32's own is 1-1
    if record["speedup_vs_fp32"] is None:
        figure = "- (not measured)"
    elif extra:
        figure += f" ({'; '.join(extra)})"
    for fact in (("policy", summary["mode"]), ("script", record["script"] or "-"),
                 ("arguments", arguments), ("device", summary["device"] or "-"),
                 ("hardware fingerprint", record["hardware_fp"]),
                 ("workload fingerprint", record["workload_fp"]),
                 (SPEEDUP, figure), ("goodput", goodput),
                 ("tuned", str(record["created_at"])), ("versions", versions or "-")):
        facts.add_row(*fact)
    console.print(facts)
    trials = record.get("trials") or []
    if not trials:
        return
    columns = ("#", "mode", "outcome", "verdict", "goodput", "reason")
    table = Table(*(Column(column, overflow="fold") for column in columns), title="trials",
                  title_justify="left")
    for trial in trials:
        goodput = trial.get("goodput")
        table.add_row(str(trial.get("number")), trial.get("mode") or "-", trial.get("outcome") or "-",
                      trial.get("verdict") or "-", "-" if goodput is None else f"{goodput:.1f}", trial.get("reason") or "")
    console.print(table)


def summary_row(row: dict[str, Any]) -> dict[str, Any]:
    try:
        described = Policy.from_dict(row["policy"]).describe()
    except PolicyError:
        described = f"{row['mode']} (unreadable policy)"
    hardware, summary = row.get("hardware") or {}, row.get("summary") or {}
    script = row.get("script")
    # The script's arguments the entry was tuned with (its summary's, else its [tuned_on]'s);
    # None when the tune did not record them.
    args = next((list(args) for args in (summary.get("args"), _tuned_on(row).get("args"))
                 if isinstance(args, list) and all(isinstance(arg, str) for arg in args)), None)
    return {
        "id": row["id"],
        "hardware_fp": row["hardware_fp"],
        "device": hardware.get("name") or summary.get("device"),
        "workload_fp": row["workload_fp"],
        "script": script,
        "script_name": Path(script).name if script else None,
        "args": args,
        "mode": described,
        "policy": row["policy"],
        "speedup_vs_fp32": row["speedup_vs_fp32"],
        "goodput": row["goodput"],
        "created_at": row["created_at"],
        "tuned": str(row["created_at"])[:10],
        "versions": row.get("versions") or {},
    }


app = typer.Typer(name="cache", no_args_is_help=True,
                  help="The per-GPU recommendation cache: list, show, export, import, clear.",
                  context_settings={"help_option_names": ["-h", "--help"]})
for _command in (cache_list, cache_show, cache_export, cache_import, cache_clear):
    app.command(_command.__name__.removeprefix("cache_"))(handle_errors(_command))
study_app = typer.Typer(no_args_is_help=True, help="Optuna studies of tunes: what a shared study "
                        "holds, read without writing.")
study_app.command("status")(study_status)
