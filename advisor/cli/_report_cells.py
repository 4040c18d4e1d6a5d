"""The cells and phrases every tune report is made of, short or whole, and the commands to paste."""

from __future__ import annotations

import math
import os
import shlex
import statistics
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

from advisor.tune import default_storage_url

VERDICT_STYLE = {"ok": "green", "unstable": "yellow", "pruned": "dim"}


def fmt_bytes(value: int | None) -> str:
    if value is None:
        return "-"
    if value >= 2**30:
        return f"{value / 2**30:.2f} GiB"
    return f"{value / 2**20:.0f} MiB"


def compact_table(title: str | None, legend: str | None = None) -> Table:
    """A table in the CLI's compact style: no outer frame, a rule under the headers, and
    ``legend`` (what each short header means) as its caption, wrapped to the terminal."""
    return Table(title=title, title_justify="left", caption=legend, caption_justify="left", box=box.MINIMAL_HEAVY_HEAD,
                 show_edge=False, pad_edge=False)


def spread_text(half_spread: float | None) -> str:
    """``±12%``: half a spread, relative to the median; empty when unknown."""
    if half_spread is None or not math.isfinite(half_spread) or half_spread < 0:
        return ""
    return f"±{half_spread:.0%}" if half_spread >= 0.005 else "±0%"


def spread_line(reference: dict[str, Any], replicate: dict[str, Any] | None) -> str:
    """How far one rounding carried fp32 (its perturbed replicate, as JSON), and the limits that
    set, in one line; empty without a replicate."""
    if not replicate:
        return ""
    if replicate.get("note"):
        return f"run-to-run spread: not measured, {replicate['note']}; the fixed limits apply"
    who = f"fp32 perturbed by one {replicate.get('perturb') or 'bf16'} rounding"
    if replicate.get("identical"):
        return (f"run-to-run spread: {who} trained bit for bit as fp32 (the perturbation never reached the "
                "trained weights); the fixed limits apply")
    metrics = (reference.get("verdict") or {}).get("metrics") or {}
    if "final_gap_limit" not in metrics:
        return f"run-to-run spread: {who} ran, but its spread was not used; the fixed limits apply"
    apart = f"{as_float(metrics.get('final_spread')):.1%} apart"
    if "progress_spread" in metrics:
        apart += f", its fall {as_float(metrics['progress_spread']):.0%} off fp32's"
    limits = f"final loss up to {as_float(metrics['final_gap_limit']):.1%} above fp32's"
    if metrics.get("reference_flat"):
        limits += "; progress is not judged, since fp32's own fall is within that noise"
    elif "progress_limit" in metrics:
        limits += f", a fall at least {as_float(metrics['progress_limit']):.0%} as far as fp32's"
    reused = " (reused from the stored study)" if replicate.get("reused") else ""
    return (f"run-to-run spread: {who} ended at {as_float(metrics.get('replicate_end')):.4g} "
            f"against {as_float(metrics.get('reference_end')):.4g} ({apart}){reused}; "
            f"the limits allow for it: {limits}")


def as_float(value: Any) -> float:
    """A metric from JSON, where non-finite numbers are strings such as ``"inf"``."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return float("nan")


# Above this half-spread a speed-up is called rough: step times this scattered hide a gap of the
# size that separates modes (the design's 2-core build machine sees about ±10% between quartiles).
NOISY_SPREAD = 0.25


def shows_paired(tune: dict[str, Any], row: dict[str, Any]) -> bool:
    """Whether a row's ×fp32 is a paired figure of this run (the winner's, when it is paired)."""
    if row.get("winner"):
        return bool((tune.get("speedup") or {}).get("pairs"))
    return bool((row.get("paired_speedup") or {}).get("ratio"))


def is_reference_row(tune: dict[str, Any], row: dict[str, Any]) -> bool:
    return row.get("label") == (tune.get("reference") or {}).get("label", "fp32") and bool(tune.get("reference_rounds"))


def row_speedup(tune: dict[str, Any], row: dict[str, Any]) -> float | None:
    """The ×fp32 figure a tune table row shows: the winner's one figure; a re-measured
    finalist's paired figure of this run; 1 for fp32 beside them; else the search run's ratio
    (``None`` for a resumed result, never compared with this run's fp32)."""
    if row.get("winner"):
        return tune.get("speedup_vs_fp32")
    if shows_paired(tune, row):
        return row["paired_speedup"]["ratio"]
    return row.get("search_speedup_vs_fp32", row.get("speedup_vs_fp32"))


def _rounds(tune: dict[str, Any], row: dict[str, Any]) -> list[Any]:
    """A row's goodputs over its rounds of re-measurement (fp32's alongside, for fp32)."""
    if is_reference_row(tune, row) and not row.get("winner"):
        return tune.get("reference_rounds") or []
    return next((f.get("rounds") or [] for f in tune.get("finalists") or [] if f.get("label") == row.get("label")), [])


def _measured_runs(rounds: list[Any] | None) -> list[float]:
    return sorted(g for g in rounds or [] if isinstance(g, (int, float)) and g > 0)


def remeasured_goodput(tune: dict[str, Any], row: dict[str, Any]) -> float | None:
    """A row's median goodput over its rounds of re-measurement; its search run's without any."""
    return median_round({"rounds": _rounds(tune, row), "goodput": row.get("goodput")}) or row.get("goodput")


def candidate_spread(tune: dict[str, Any], row: dict[str, Any]) -> float | None:
    """How far the ×fp32 figure a row shows could move with its timing noise, as half a spread:
    a paired figure's interval (or its rounds' range); a search run's step times; else ``None``."""
    beside = is_reference_row(tune, row) and any(shows_paired(tune, r) for r in tune.get("candidates") or [])
    if shows_paired(tune, row) or beside:
        figure = (tune.get("speedup") or {}) if row.get("winner") else (row.get("paired_speedup") or {})
        ratio, low, high = figure.get("ratio"), figure.get("low"), figure.get("high")
        if ratio and low and high:
            return (high - low) / 2 / ratio
        runs = _measured_runs(_rounds(tune, row))
        if len(runs) > 1:
            return (runs[-1] - runs[0]) / 2 / runs[len(runs) // 2]
    p10, p90 = row.get("step_time_p10"), row.get("step_time_p90")
    if isinstance(p10, (int, float)) and isinstance(p90, (int, float)) and p10 > 0:
        return (p90 / p10 - 1) / 2
    timing = row.get("step_time") or ((tune.get("reference") or {}).get("step_time") if row.get("mode") == "fp32"
                                       and not row.get("micro_batch") else None)
    if isinstance(timing, dict) and isinstance(timing.get("rel_iqr"), (int, float)):
        return timing["rel_iqr"] / 2
    return None


def noisy_line(tune: dict[str, Any]) -> str:
    """A warning naming the candidates whose speed-up rests on timings spread wider than
    ±NOISY_SPREAD; empty when none is."""
    noisy = []
    for row in tune.get("candidates") or []:
        spread = candidate_spread(tune, row)
        if row.get("goodput") and spread is not None and spread > NOISY_SPREAD:
            noisy.append(f"{row.get('label')} {spread_text(spread)}")
    if not noisy:
        return ""
    return (f"noisy timings: {', '.join(noisy)}; their speed-ups are rough (another job or a busy GPU ran beside "
            "them): tune again on a quieter machine, or with more --steps")


def fmt_tflops(tflops: float | None) -> str:
    return "-" if tflops is None else f"{tflops:.3g}"


def fmt_mfu(mfu: float | None) -> str:
    return "-" if mfu is None else f"{mfu:.0%}" if mfu >= 0.01 else f"{mfu:.1%}"


def median_round(finalist: dict[str, Any]) -> float:
    """A finalist's median goodput over its rounds (its search run's when it ran none)."""
    runs = _measured_runs(finalist.get("rounds"))
    return statistics.median(runs) if runs else float(finalist.get("goodput") or 0.0)


def describe_speedup(speedup: dict[str, Any]) -> str:
    """The winner's speed-up over fp32 in words: ratio, interval and what it rests on."""
    ratio, low, high = speedup.get("ratio"), speedup.get("low"), speedup.get("high")
    if not ratio:
        return "not measured"
    interval = (f", {speedup.get('confidence', 0.95):.0%} interval {low:.2f}x to {high:.2f}x"
                if low and high and speedup.get("pairs") else "")
    return f"{ratio:.2f}x fp32 goodput ({speedup.get('basis') or 'basis not recorded'}{interval})"


def pasteable_path(path: str | os.PathLike[str]) -> str:
    """A path relative to the working directory when it lies under it, else as given."""
    given = Path(path)
    if given.is_absolute() and given.is_relative_to(Path.cwd()):
        return str(given.relative_to(Path.cwd()))
    return str(given)


def script_and_args(tune: dict[str, Any]) -> list[str]:
    """The script (as :func:`pasteable_path` names it) and, after ``--``, its arguments."""
    args = [str(a) for a in tune.get("args") or []]
    return [pasteable_path(tune.get("script") or "train.py"), *(["--", *args] if args else [])]


def run_command(tune: dict[str, Any]) -> str:
    """``mpadvise run SCRIPT -- ARGS`` for the tuned script, shell-quoted."""
    return shlex.join(["mpadvise", "run", *script_and_args(tune)])


def resume_command(tune: dict[str, Any]) -> str:
    """The command that continues the tune's study: the one it carries (a command line's), else
    ``mpadvise tune SCRIPT --resume -- ARGS``, with ``--storage`` where it is not the default."""
    if tune.get("resume_command"):
        return str(tune["resume_command"])
    storage = tune.get("storage")
    default = default_storage_url()
    where = ["--storage", str(storage)] if storage and storage not in (default, os.environ.get("MPADVISE_STORAGE")) else []
    script, *rest = script_and_args(tune)
    return shlex.join(["mpadvise", "tune", script, "--resume", *where, *rest])


def print_disturbances(console: Console, events: list[dict[str, Any]]) -> None:
    """One line per trial the machine disturbed or lost (``Disturbance.to_dict``'s)."""
    for event in events:
        console.print(f"[yellow]{'lost' if event.get('kind') == 'lost' else 'disturbed'}[/] {event.get('text')}",
                      highlight=False)


def mfu_peak(tune: dict[str, Any]) -> tuple[str, float] | None:
    """The one peak every row's MFU is of: the probed matmul peak of the fastest dtype the
    candidates computed in (of any where none says), as ``("bf16", 990.0)``; else ``None``."""
    peaks = [(str(k), float(v)) for k, v in (tune.get("peak_tflops") or {}).items()
             if isinstance(v, (int, float)) and v > 0]
    used = {row.get("mfu_dtype") for row in tune.get("candidates") or []}
    peaks = [kv for kv in peaks if kv[0] in used] or peaks
    return max(peaks, key=lambda kv: kv[1]) if peaks else None


def shared_reasons(rows: list[dict[str, Any]]) -> list[tuple[list[str], str, str]]:
    """Why each losing candidate lost, a reason shared by several variants once: ``(labels,
    outcome, reason)`` in the order the rows first give each reason."""
    grouped: dict[tuple[str, str], list[str]] = {}
    for row in rows:
        if not (row.get("stable") and row.get("feasible")) and row.get("reason"):
            grouped.setdefault((str(row.get("outcome")), str(row["reason"])), []).append(str(row.get("label")))
    return [(labels, outcome, reason) for (outcome, reason), labels in grouped.items()]
