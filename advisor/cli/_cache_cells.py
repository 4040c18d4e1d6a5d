"""The tables that ``mpadvise show`` and ``mpadvise cache`` print, and the guard's events."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from policies import Policy, PolicyError

SPEEDUP = "×fp32"  # a cache entry's figure: the tune's one speed-up, its winner's over fp32
SCRIPT = "script args"  # tells two tunes of one script apart
FEWER_THREADS_MARK = "*"  # a figure measured on fewer CPU threads than torch's own


def _table(title: str, columns: tuple[str, ...], *, legend: str | None = None) -> Table:
    """A table whose short columns never wrap and whose prose columns wrap at their spaces
    (folding only a word longer than the column); ``legend`` goes under it."""
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
    """Whether an entry's figure was measured on fewer threads than torch's own."""
    threads = _tuned_on(row).get("speedup_threads")
    return type(threads) is int and threads != 0


def _legend(rows: list[dict[str, Any]]) -> str:
    """What the figure column says, and what an args cell of ``-`` means when one shows."""
    legend = (f"{SPEEDUP}: the winner's speed-up over fp32 (paired re-measurement where there was one; its "
              "interval: mpadvise cache show ID)")
    if any(_fewer_threads(row) for row in rows):
        legend += (f"; {FEWER_THREADS_MARK}: measured on fewer threads than torch's own, other processes keeping "
                   "cores busy (the gain on all cores can differ)")
    return legend + _args_legend(rows)


def _figure_cell(row: dict[str, Any]) -> str:
    figure = _speedup(row["speedup_vs_fp32"])
    fewer = row["speedup_vs_fp32"] is not None and _fewer_threads(row)
    return figure + FEWER_THREADS_MARK if fewer else figure


def _args_legend(rows: list[dict[str, Any]]) -> str:
    if any(row["args"] is None and row["script_name"] for row in rows):
        return "; ?: arguments not recorded (an older tune)"
    return ""


def _script_cell(row: dict[str, Any]) -> str:
    """``"train.py --epochs 1"``; ``?`` for arguments an older tune did not record."""
    name = row["script_name"]
    if not name:
        return "-"
    return f"{name} ?" if row["args"] is None else shlex.join([name, *row["args"]])


def _speedup_with_interval(record: dict[str, Any]) -> str:
    """``"1.52x, the winner's speed-up over fp32 (interval 1.40x-1.65x; paired re-measurement,
    4 pairs)"``: the figure with what the tune's ``[tuned_on]`` says of its interval and basis."""
    if record["speedup_vs_fp32"] is None:
        return "- (not measured)"
    figure = f"{_speedup(record['speedup_vs_fp32'])}, the winner's speed-up over fp32"
    tuned = _tuned_on(record)
    low, high, basis = tuned.get("speedup_low"), tuned.get("speedup_high"), tuned.get("speedup_basis")
    extra = []
    if isinstance(low, (int, float)) and isinstance(high, (int, float)) and low != high:  # fp32's own is 1-1
        extra.append(f"interval {_speedup(low)}-{_speedup(high)}")
    if isinstance(basis, str) and basis:
        extra.append(basis)
    return f"{figure} ({'; '.join(extra)})" if extra else figure


def plural(count: int, singular: str, plural: str | None = None) -> str:
    return f"{count} {singular if count == 1 else (plural or singular + 's')}"


def guard_event_rows(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The guard's cached events as ``show --json`` gives them (newest first)."""
    keep = ("id", "script", "workload_fp", "signal", "step", "tripped_at", "policy", "fallback", "action",
            "detail", "created_at")
    return [{key: event.get(key) for key in keep} for event in events]


def _no_cache(report: dict[str, Any], console: Console) -> bool:
    """Say so, and return True, when no cache could be opened."""
    if not report["cache"]:
        console.print(f"No cache: {report['database']} cannot be used (see the warning above).",
                      highlight=False)
    return not report["cache"]


def render_show(report: dict[str, Any], console: Console) -> None:
    """``mpadvise show``: this machine's entries, then (``--all``) the others and why they do not
    apply here; a plain sentence when there is nothing to list."""
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
                       ("id", SCRIPT, "workload", "mode", SPEEDUP, "tuned", "status"), legend=_legend(here))
        for row in here:
            status = "[green]valid[/]" if row["valid"] else f"[yellow]{row['status']}[/]"
            table.add_row(str(row["id"]), _script_cell(row), row["workload_fp"][:8], row["mode"],
                          _figure_cell(row), row["tuned"], status)
        console.print(table)
    if other:
        keys = _device_keys(other)
        table = _table("Other hardware or versions (not applied here)",
                       ("id", "device", SCRIPT, "mode", "tuned", "why not"),
                       legend=_device_legend(keys) + _args_legend(other))
        for row in other:
            table.add_row(str(row["id"]), keys[_device_of(row)], _script_cell(row), row["mode"], row["tuned"],
                          row["status"].removeprefix("other hardware: "))
        console.print(table)
    _render_guard_events(report.get("guard_events", []), console)
    hidden = report["other_hardware"] - len(other)
    if hidden:
        console.print(f"{plural(hidden, 'entry', 'entries')} tuned on other hardware or versions not shown; "
                      "`mpadvise show --all` lists them.", highlight=False)


def _render_guard_events(events: list[dict[str, Any]], console: Console) -> None:
    """The guard's events on this machine: what a long run saw, and what the next run applies."""
    if not events:
        return
    table = _table("Guard events on this machine (the next load_policy() applies the fallback)",
                   ("id", "script", "signal", "step", "policy", "fallback", "action", "when"))
    for event in events:
        table.add_row(str(event["id"]), escape(str(event["script"] or "-")), event["signal"], str(event["step"]),
                      event["policy"], str(event["fallback"] or "-"), event["action"], str(event["created_at"])[:10])
    console.print(table)


def render_list(report: dict[str, Any], console: Console) -> None:
    """Every cached recommendation as a table."""
    rows = report["recommendations"]
    if _no_cache(report, console):
        return
    if not rows:
        console.print(f"The cache {report['database']} holds no recommendations.", highlight=False)
        return
    devices = _device_keys(rows)
    table = _table(report["database"], ("id", "device", SCRIPT, "workload", "mode", SPEEDUP, "tuned"),
                   legend=_device_legend(devices) + "\n" + _legend(rows))
    for row in rows:
        # Tables show a fingerprint's prefix, as git shows short hashes; --json and `cache show` the whole key.
        table.add_row(str(row["id"]), devices[_device_of(row)], _script_cell(row), row["workload_fp"][:8], row["mode"],
                      _figure_cell(row), row["tuned"])
    console.print(table)


def _device_of(row: dict[str, Any]) -> str:
    return row["device"] or row["hardware_fp"]


def _device_keys(rows: list[dict[str, Any]]) -> dict[str, str]:
    """A short key per device (``d1``, ``d2``...) so a device column stays narrow; the legend
    under the table names each device in full."""
    names = list(dict.fromkeys(_device_of(row) for row in rows))
    return {name: f"d{i}" for i, name in enumerate(names, 1)}


def _device_legend(devices: dict[str, str]) -> str:
    return "; ".join(f"{key}: {name}" for name, key in devices.items())


def render_record(record: dict[str, Any], console: Console) -> None:
    """One recommendation: facts, then its trials."""
    summary = summary_row(record)
    args = summary["args"]
    versions = ", ".join(f"{name} {version or 'absent'}" for name, version in (record["versions"] or {}).items())
    facts = Table(title=f"cache entry #{record['id']}", show_header=False, title_justify="left", title_style="bold")
    facts.add_column(style="cyan")
    facts.add_column(overflow="fold")
    for fact in (("policy", summary["mode"]), ("script", record["script"] or "-"),
                 ("arguments", "- (not recorded)" if args is None else shlex.join(args) if args else "(none)"),
                 ("device", summary["device"] or "-"), ("hardware fingerprint", record["hardware_fp"]),
                 ("workload fingerprint", record["workload_fp"]), (SPEEDUP, _speedup_with_interval(record)),
                 ("goodput", f"{record['goodput']:.1f} samples/s" if record["goodput"] else "-"),
                 ("tuned", str(record["created_at"])), ("versions", versions or "-")):
        facts.add_row(*fact)
    console.print(facts)
    trials = record.get("trials") or []
    if not trials:
        return
    table = Table(title="trials", title_justify="left")
    for column in ("#", "mode", "outcome", "verdict", "goodput", "reason"):
        table.add_column(column, overflow="fold")
    for trial in trials:
        goodput = trial.get("goodput")
        table.add_row(str(trial.get("number")), trial.get("mode") or "-", trial.get("outcome") or "-",
                      trial.get("verdict") or "-", "-" if goodput is None else f"{goodput:.1f}", trial.get("reason") or "")
    console.print(table)


def summary_row(row: dict[str, Any]) -> dict[str, Any]:
    """One recommendation as list/show print it (no trials)."""
    try:
        described = Policy.from_dict(row["policy"]).describe()
    except PolicyError:
        described = f"{row['mode']} (unreadable policy)"
    hardware, summary, script = row.get("hardware") or {}, row.get("summary") or {}, row.get("script")
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
