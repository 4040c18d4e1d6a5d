"""The cells and phrases every tune report is made of, short or whole, and the whole report
(``mpadvise tune --verbose``)."""

from __future__ import annotations

import functools
import math
import os
import shlex
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from advisor.tune import default_storage_url, shared_storage
from policies import Policy
from probes import MpadviseError

VERDICT_STYLE = {"ok": "green", "unstable": "yellow", "pruned": "dim"}

# Above this half-spread a speed-up is called rough: step times this scattered hide a gap of the
# size that separates modes (the design's 2-core build machine sees about ±10% between quartiles).
NOISY_SPREAD = 0.25


def styled(outcome: str, text: str | None = None) -> str:
    """``text`` (by default the outcome itself) as markup in the outcome's colour."""
    return f"[{VERDICT_STYLE.get(outcome, 'red')}]{outcome if text is None else text}[/]"


def fmt_bytes(value: int | None) -> str:
    if value is None:
        return "-"
    if value >= 2**30:
        return f"{value / 2**30:.2f} GiB"
    return f"{value / 2**20:.0f} MiB"


def compact_table(title: str | None, legend: str | None = None) -> Table:
    """No outer frame, a rule under the headers, ``legend`` (the short headers) as its caption."""
    return Table(title=title, title_justify="left", caption=legend, caption_justify="left", box=box.MINIMAL_HEAVY_HEAD,
                 show_edge=False, pad_edge=False)


def spread_text(half_spread: float | None) -> str:
    """``±12%``: half a spread, relative to the median; empty when unknown."""
    if half_spread is None or not math.isfinite(half_spread) or half_spread < 0:
        return ""
    return f"±{half_spread:.0%}" if half_spread >= 0.005 else "±0%"


def spread_line(reference: dict[str, Any], replicate: dict[str, Any] | None) -> str:
    """How far one rounding carried fp32 (its perturbed replicate), and the limits that set."""
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


def shows_paired(tune: dict[str, Any], row: dict[str, Any]) -> bool:
    """Whether a row's ×fp32 is a paired figure of this run (the winner's, when it is paired)."""
    if row.get("winner"):
        return bool((tune.get("speedup") or {}).get("pairs"))
    return bool((row.get("paired_speedup") or {}).get("ratio"))


def is_reference_row(tune: dict[str, Any], row: dict[str, Any]) -> bool:
    return row.get("label") == (tune.get("reference") or {}).get("label", "fp32") and bool(tune.get("reference_rounds"))


def row_speedup(tune: dict[str, Any], row: dict[str, Any]) -> float | None:
    """The ×fp32 figure a tune table row shows: the winner's one figure, a re-measured finalist's
    paired figure, else the search run's ratio (``None`` for a resumed result)."""
    if row.get("winner"):
        return tune.get("speedup_vs_fp32")
    if shows_paired(tune, row):
        return row["paired_speedup"]["ratio"]
    return row.get("search_speedup_vs_fp32", row.get("speedup_vs_fp32"))


def speedup_cell(tune: dict[str, Any], row: dict[str, Any], goodput: float | None,
                 mark: str = "") -> str:
    """``1.42x ±3%``: the ×fp32 figure a row shows (``mark`` after it) and its spread, or ``-``."""
    ratio = row_speedup(tune, row)
    if not (goodput and ratio):
        return "-"
    spread = spread_text(candidate_spread(tune, row))
    return f"{ratio:.2f}x{mark}" + (f" {spread}" if spread else "")


def _rounds(tune: dict[str, Any], row: dict[str, Any]) -> list[Any]:
    """A row's goodputs over its rounds of re-measurement (fp32's alongside, for fp32)."""
    if is_reference_row(tune, row) and not row.get("winner"):
        return tune.get("reference_rounds") or []
    return next((f.get("rounds") or [] for f in tune.get("finalists") or [] if f.get("label") == row.get("label")), [])


def _measured_runs(rounds: list[Any] | None) -> list[float]:
    return sorted(g for g in rounds or [] if isinstance(g, (int, float)) and g > 0)


def median_round(finalist: dict[str, Any]) -> float:
    """A finalist's median goodput over its rounds (its search run's when it ran none)."""
    runs = _measured_runs(finalist.get("rounds"))
    return statistics.median(runs) if runs else float(finalist.get("goodput") or 0.0)


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


def noisy_rows(tune: dict[str, Any], rows: list[dict[str, Any]],
               label: Callable[[str], str] = str) -> list[str]:
    """``"bf16 ±30%"`` for each row whose timings spread wider than ±NOISY_SPREAD."""
    return [f"{label(str(row.get('label')))} {spread_text(spread)}" for row in rows
            if row.get("goodput") and (spread := candidate_spread(tune, row)) is not None
            and spread > NOISY_SPREAD]


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
    args = [str(a) for a in tune.get("args") or []]
    return [pasteable_path(tune.get("script") or "train.py"), *(["--", *args] if args else [])]


def run_command(tune: dict[str, Any]) -> str:
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


def render_details(tune: dict[str, Any], console: Console) -> None:
    say = functools.partial(console.print, highlight=False)
    console.print(_tune_table(tune))
    if noisy := noisy_rows(tune, tune.get("candidates") or []):
        text = (f"noisy timings: {', '.join(noisy)}; their speed-ups are rough (another job or a "
                "busy GPU ran beside them): tune again on a quieter machine, or with more --steps")
        say(f"[yellow]{escape(text)}[/]")
    if tune.get("window_note"):
        say(f"window: {tune['window_note']}")
    if tune.get("extended_window"):
        say("judged again on a longer window, their gap to fp32 growing: "
            + ", ".join(tune["extended_window"]))
    print_disturbances(console, tune.get("disturbed") or [])
    say(utilisation_line(tune))
    if spread := spread_line(tune.get("reference") or {}, tune.get("replicate")):
        say(spread)
    # Why each losing candidate lost: a reason shared by several variants once.
    reasons: dict[tuple[str, str], list[str]] = {}
    for row in tune.get("candidates") or []:
        if not (row.get("stable") and row.get("feasible")) and row.get("reason"):
            why = (str(row.get("outcome")), str(row["reason"]))
            reasons.setdefault(why, []).append(str(row.get("label")))
    for (outcome, reason), labels in reasons.items():
        say(f"{styled(outcome, escape(', '.join(labels)))}: {escape(reason)}")
    _print_search(tune, say)
    if cost := tune.get("cost"):
        say(f"cost: {cost.get('trials')} trials in {cost.get('wall_s', 0):.0f} s" + (
            f", {cost['trial_equivalents']:.0f} measured windows of {cost['window_s']:.2g} s"
            if cost.get("trial_equivalents") else ""))
    if tune.get("winner") is None:
        console.print("[bold red]no stable policy fits[/]: every candidate was unstable, out of memory or failed")
        return
    _print_winner(tune, console, say)


def _tune_table(tune: dict[str, Any]) -> Table:
    """The candidates in two parts, so that no ratio is read as another kind: above the rule,
    the winner (†) and whoever ran beside fp32 in this run's re-measurement; below, single runs."""
    resumed = tune.get("trials_resumed") or 0
    title = (f"{Path(tune.get('script') or '?').name} on {(tune.get('hardware') or {}).get('name', '?')}: "
             f"the fp32 reference and {tune.get('trials_run', 0)} trials"
             + (f", {resumed} resumed" if resumed else "")
             + f" of {(tune.get('space') or {}).get('grid_size', '?')} candidates")
    rows = list(tune.get("candidates") or [])
    peak = mfu_peak(tune)
    paired = [row for row in rows if shows_paired(tune, row)]
    if paired and not any(row.get("winner") for row in paired):
        paired = []  # nothing to set apart: the winner's figure is a single run's too
    if paired:  # fp32 heads its own scale
        paired += [row for row in rows if row.get("mode") == "fp32" and not row.get("micro_batch")
                   and row not in paired and is_reference_row(tune, row)]
    single = [row for row in rows if row not in paired]
    legend = ("×fp32: goodput over fp32's" + (", above the rule re-measured side by side in this run, ± half its "
                                              "interval; below it, " if paired else " in ")
              + "one search run, ± the spread of its step times; goodput: samples/s, skipped steps lost; "
              "TF/s: achieved TFLOP/s; memory: peak"
              + (f"; MFU: of the probed {peak[0]} peak, one for every row" if peak else ""))
    if any(row.get("resumed") for row in single):
        legend += "; *: an earlier run's or another worker's figure (resumed), never compared with this run's fp32"
    if tune.get("speedup_vs_fp32"):
        speedup = describe_speedup(tune.get("speedup") or {})
        legend += f"\n† the winner's speed-up: {speedup}, the tune's one figure"
    # Numbers and verdicts never wrap, labels wrap at spaces: 80 columns, every figure whole.
    table = compact_table(title, legend)
    table.add_column("", no_wrap=True)
    table.add_column("candidate", overflow="fold", min_width=11, ratio=1)
    for col in ("goodput", "×fp32", "TF/s", *(("MFU",) if peak else ()), "memory"):
        table.add_column(col, justify="right", no_wrap=True)
    table.add_column("verdict", no_wrap=True)
    paired.sort(key=lambda r: -(row_speedup(tune, r) or 0.0))
    for i, row in enumerate(paired + single):
        if paired and i == len(paired):
            table.add_section()
        goodput = remeasured_goodput(tune, row) if i < len(paired) else row.get("goodput")
        won, tflops = bool(row.get("winner")), row.get("tflops")
        resumed = "*" if row.get("resumed") and not shows_paired(tune, row) else ""
        mfu = None if tflops is None or peak is None else tflops / peak[1]
        mfu_cell = "-" if mfu is None else f"{mfu:.0%}" if mfu >= 0.01 else f"{mfu:.1%}"
        table.add_row("→" if won else "", escape(str(row.get("label"))),
                      f"{goodput:,.0f}{resumed}" if goodput else "-",
                      speedup_cell(tune, row, goodput, "†" if won else ""),
                      "-" if tflops is None else f"{tflops:.3g}", *([mfu_cell] if peak else []),
                      fmt_bytes(row.get("peak_memory")), styled(row.get("outcome") or "ok"))
    for row in tune.get("pruned") or []:  # never run: no numbers to show
        table.add_row("", escape(str(row.get("label"))), *("-" for _ in range(5 if peak else 4)),
                      styled("pruned"))
    return table


def utilisation_line(tune: dict[str, Any]) -> str:
    """How the TFLOP/s and MFU columns were found: the reference's FLOPs and the one peak."""
    flops = tune.get("flops_per_step")
    if not flops:
        return "TFLOP/s and MFU: not known (the reference's FLOPs could not be counted)"
    peaks = ", ".join(f"{k} {v:.3g}" for k, v in (tune.get("peak_tflops") or {}).items())
    peak = mfu_peak(tune)
    basis = tune.get("flops_basis") or "counted"
    head = f"FLOPs per step {flops:.3g} ({basis}, in the fp32 reference)"
    if peak is None:
        return head + "; MFU: left out, no matmul peak probed"
    rows = tune.get("candidates") or []
    above = [row["label"] for row in rows if (row.get("tflops") or 0.0) > peak[1]]
    return (head + f"; MFU of every row is of one peak, the probed {peak[0]} matmul peak ({peak[1]:.3g} TFLOP/s, "
            f"the fastest dtype's); probed TFLOP/s: {peaks}"
            + (f"; above 100% ({', '.join(above)}): this workload's matmuls ran faster than the probe's square ones, "
               "so the probed peak is below what this hardware does here" if above else ""))


def _print_search(tune: dict[str, Any], say: Callable[..., None]) -> None:
    """The priors, why the search stopped, the side-by-side re-measurement and any tie."""
    priors = (tune.get("matmul_ratio_vs_fp32") or {}).items()
    if ratios := ", ".join(f"{k} {v:.2g}x" for k, v in priors if k != "fp32"):
        say(f"matmul throughput vs fp32 on this device (the search's priors): {ratios}")
    say(f"search stopped: {tune.get('stop_reason')}")
    resumed = tune.get("trials_resumed") or 0
    if resumed:
        say(f"resumed: {resumed} result{'' if resumed == 1 else 's'} from the stored study (an "
            "earlier run's or another worker's), never compared with this run's fp32: the "
            "finalists among them ran again, and the winner's figure is measured side by side in "
            "this run")
    if tune.get("pruned"):
        say(f"pruned (not run): {len(tune['pruned'])} proposals the priors ruled out; "
            "--no-priors runs them")
    for late in tune.get("late") or []:
        say(f"not run: {late['mode']}, {late['reason']}", markup=False)
    finalists = tune.get("finalists") or []
    rounds = tune.get("remeasure_rounds")
    if len(finalists) > 1:
        close = ", ".join(f"{f['label']} {median_round(f):,.0f}/s" for f in finalists)
        say(f"re-measured side by side{f' in {rounds} rounds' if rounds else ''}: {close}")
    if stop := remeasure_stop_line(tune):
        say(stop)
    for dropped in tune.get("dropped_finalists") or []:
        say(f"[red]dropped[/] {dropped.get('label')}: {dropped.get('reason')}")
    if tune.get("gap"):
        between = tune["gap"].get("between") or []
        # Against fp32, the decisive gap is the speed-up itself; between finalists it is no speed-up.
        rival = "" if between[1:2] == [(tune.get("reference") or {}).get("label", "fp32")] else \
            " (between finalists: not a speed-up over fp32)"
        say(f"gap: {describe_gap(tune['gap'])}{rival}")
    if tune.get("tie_note"):
        say(f"tie: {tune['tie_note']}")


def remeasure_stop_line(tune: dict[str, Any]) -> str:
    """Why re-measurement ended, in one line, when that is news (a limit cut it short)."""
    stop, rounds, most = tune.get("remeasure_stop"), tune.get("remeasure_rounds") or 0, tune.get("remeasure_max_rounds")
    if stop == "time budget":
        budget = tune.get("time_budget")
        spent = f" ({budget:g} s)" if isinstance(budget, (int, float)) else ""
        return (f"re-measurement cut short by the time budget{spent} after {rounds} round{'' if rounds == 1 else 's'}: "
                "a gap it left unresolved counts as a tie")
    if stop == "round limit":
        if most and rounds > most:
            return (f"re-measurement stopped after {rounds} rounds, past its usual {most} while a lead lay beyond the "
                    "margin or a change of threads left rounds unpaired: a gap still unresolved counts as a tie")
        return f"re-measurement stopped at its limit of {most} rounds: a gap still unresolved counts as a tie"
    return ""


def describe_gap(gap: dict[str, Any]) -> str:
    """A re-measured gap in words: who leads whom, by how much, its interval and verdict."""
    leader, other = (gap.get("between") or ["?", "?"])[:2]
    ratio, low, high = gap.get("ratio"), gap.get("low"), gap.get("high")
    lead = f"{leader} runs {ratio:.2f}x the goodput of {other}" if ratio else f"{leader} against {other}"
    interval = (f"{gap.get('confidence', 0.95):.0%} interval {low:.2f}x to {high:.2f}x over {gap.get('pairs')} paired runs"
                if low and high else f"no interval from {gap.get('pairs', 0)} paired runs")
    verdict = {"faster": "resolved", "slower": "resolved", "tie": "a tie: within the margin that counts",
               "unresolved": "unresolved: counted as a tie"}.get(str(gap.get("verdict")), str(gap.get("verdict")))
    return f"{lead} ({interval}): {verdict}"


def _print_winner(tune: dict[str, Any], console: Console, say: Callable[..., None]) -> None:
    try:
        described = Policy.from_dict(tune["winner"]).describe()
    except MpadviseError:  # written by another version: its label still says what won
        described = str(tune.get("winner_label"))
    speedup = tune.get("speedup") or ({"ratio": tune["speedup_vs_fp32"]} if tune.get("speedup_vs_fp32") else None)
    say(f"[bold green]winner[/]: {described}"
        + (f", {describe_speedup(speedup)}" if speedup else ""))
    if tune.get("scale_batch_note"):
        say(f"[yellow]note[/]: {tune['scale_batch_note']}")
    if tune.get("config_file"):
        say(f"wrote {tune['config_file']}")
    if tune.get("cache_id") is not None:
        say(f"cached for this GPU/CPU as entry #{tune['cache_id']} (mpadvise show)")
    if tune.get("storage"):
        # A database server's study is joined as it stands by every worker that runs this tune.
        how = ("every worker running this tune joins it" if shared_storage(tune["storage"])
               else f"continue with: {escape(resume_command(tune))}")
        say(f"study {tune.get('study_name')!r} in {tune['storage']} ({how})")
    if tune.get("framework"):
        # A framework script applies its policy with no changed line: through mpadvise run.
        export = shlex.join(["mpadvise", "export", *([pasteable_path(tune["config_file"])] if tune.get("config_file")
                                                      else []), "--to", str(tune["framework"])])
        say(f"train with it: [bold]{escape(run_command(tune))}[/] (or {escape(export)})")
    elif tune.get("calls_load_policy"):
        say("the script calls advisor.load_policy(): it applies the config file beside it")
    else:
        console.print("add to the script: [bold]mp = advisor.load_policy()[/] (it reads the config file beside it)")
