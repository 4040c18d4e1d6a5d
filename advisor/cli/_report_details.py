"""The whole report of a tune (``mpadvise tune --verbose``): every candidate with its figures,
the search, the spread, FLOPs and MFU, the cost, the study and how to continue it."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from advisor.cli._report_cells import (
    VERDICT_STYLE,
    candidate_spread,
    compact_table,
    describe_speedup,
    fmt_bytes,
    fmt_mfu,
    fmt_tflops,
    is_reference_row,
    median_round,
    mfu_peak,
    noisy_line,
    pasteable_path,
    print_disturbances,
    remeasured_goodput,
    resume_command,
    row_speedup,
    run_command,
    shared_reasons,
    shows_paired,
    spread_line,
    spread_text,
)
from advisor.tune import shared_storage
from policies import Policy
from probes import MpadviseError


def render_details(tune: dict[str, Any], console: Console) -> None:
    console.print(_tune_table(tune))
    noisy = noisy_line(tune)
    if noisy:
        console.print(f"[yellow]{escape(noisy)}[/]", highlight=False)
    if tune.get("window_note"):
        console.print(f"window: {tune['window_note']}", highlight=False)
    if tune.get("extended_window"):
        console.print(f"judged again on a longer window, their gap to fp32 growing: {', '.join(tune['extended_window'])}",
                      highlight=False)
    print_disturbances(console, tune.get("disturbed") or [])
    console.print(utilisation_line(tune), highlight=False)
    spread = spread_line(tune.get("reference") or {}, tune.get("replicate"))
    if spread:
        console.print(spread, highlight=False)
    for labels, outcome, reason in shared_reasons(tune.get("candidates") or []):
        console.print(f"[{VERDICT_STYLE.get(outcome, 'red')}]{escape(', '.join(labels))}[/]: {escape(reason)}",
                      highlight=False)
    _print_search(tune, console)
    cost = cost_line(tune.get("cost"))
    if cost:
        console.print(cost, highlight=False)
    if tune.get("winner") is None:
        console.print("[bold red]no stable policy fits[/]: every candidate was unstable, out of memory or failed")
        return
    _print_winner(tune, console)


def _tune_table(tune: dict[str, Any]) -> Table:
    """The candidates in two parts, so that no ratio is read as another kind: above the rule,
    the winner and whoever ran beside fp32 in this run's re-measurement, by that figure (the
    winner's is the tune's one speed-up, marked †); below it, the search's single runs."""
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
    speedup = tune.get("speedup") or {}
    if tune.get("speedup_vs_fp32"):
        legend += f"\n† the winner's speed-up: {describe_speedup(speedup)}, the tune's one figure"
    # Short headers, explained by the legend; numbers and verdicts never wrap, labels wrap at
    # their spaces, so the table fits 80 columns with every figure whole.
    table = compact_table(title, legend)
    table.add_column("", no_wrap=True)
    table.add_column("candidate", overflow="fold", min_width=11, ratio=1)
    for col in ("goodput", "×fp32", "TF/s", *(("MFU",) if peak else ()), "memory"):
        table.add_column(col, justify="right", no_wrap=True)
    table.add_column("verdict", no_wrap=True)
    for row in sorted(paired, key=lambda r: -(row_speedup(tune, r) or 0.0)):
        _add_row(table, tune, row, goodput=remeasured_goodput(tune, row), peak=peak)
    if paired and single:
        table.add_section()
    for row in single:
        _add_row(table, tune, row, goodput=row.get("goodput"), peak=peak)
    for row in tune.get("pruned") or []:  # never run: no numbers to show
        table.add_row("", escape(str(row.get("label"))), *("-" for _ in range(5 if peak else 4)),
                      f"[{VERDICT_STYLE['pruned']}]pruned[/]")
    return table


def _add_row(table: Table, tune: dict[str, Any], row: dict[str, Any], *, goodput: float | None,
             peak: tuple[str, float] | None) -> None:
    outcome, won = row.get("outcome") or "ok", bool(row.get("winner"))
    ratio = row_speedup(tune, row)
    cell = f"{ratio:.2f}x" + ("†" if won else "") if goodput and ratio else "-"
    spread = spread_text(candidate_spread(tune, row)) if cell != "-" else ""
    shown_goodput = f"{goodput:,.0f}" + ("*" if row.get("resumed") and not shows_paired(tune, row) else "") if goodput else "-"
    table.add_row("→" if won else "", escape(str(row.get("label"))), shown_goodput,
                  cell + (f" {spread}" if spread else ""), fmt_tflops(row.get("tflops")),
                  *((fmt_mfu(None if row.get("tflops") is None else row["tflops"] / peak[1]),) if peak else ()),
                  fmt_bytes(row.get("peak_memory")), f"[{VERDICT_STYLE.get(outcome, 'red')}]{outcome}[/]")


def cost_line(cost: dict[str, Any] | None) -> str | None:
    """What the tune cost: its trials and wall time, in measured windows; or ``None``."""
    if not cost:
        return None
    line = f"cost: {cost.get('trials')} trials in {cost.get('wall_s', 0):.0f} s"
    if cost.get("trial_equivalents"):
        line += f", {cost['trial_equivalents']:.0f} measured windows of {cost['window_s']:.2g} s"
    return line


def utilisation_line(tune: dict[str, Any]) -> str:
    """How the TFLOP/s and MFU columns were found: the reference's FLOPs and the one peak."""
    flops = tune.get("flops_per_step")
    if not flops:
        return "TFLOP/s and MFU: not known (the reference's FLOPs could not be counted)"
    peaks = ", ".join(f"{k} {v:.3g}" for k, v in (tune.get("peak_tflops") or {}).items())
    basis = tune.get("flops_basis") or "counted"
    peak = mfu_peak(tune)
    rows = tune.get("candidates") or []
    above = [] if peak is None else [row["label"] for row in rows if (row.get("tflops") or 0.0) > peak[1]]
    head = f"FLOPs per step {flops:.3g} ({basis}, in the fp32 reference)"
    if peak is None:
        return head + "; MFU: left out, no matmul peak probed"
    return (head + f"; MFU of every row is of one peak, the probed {peak[0]} matmul peak ({peak[1]:.3g} TFLOP/s, "
            f"the fastest dtype's); probed TFLOP/s: {peaks}"
            + (f"; above 100% ({', '.join(above)}): this workload's matmuls ran faster than the probe's square ones, "
               "so the probed peak is below what this hardware does here" if above else ""))


def _print_search(tune: dict[str, Any], console: Console) -> None:
    """The priors, why the search stopped, the side-by-side re-measurement and any tie."""
    ratios = ", ".join(f"{k} {v:.2g}x" for k, v in (tune.get("matmul_ratio_vs_fp32") or {}).items() if k != "fp32")
    if ratios:
        console.print(f"matmul throughput vs fp32 on this device (the search's priors): {ratios}", highlight=False)
    console.print(f"search stopped: {tune.get('stop_reason')}", highlight=False)
    resumed = tune.get("trials_resumed") or 0
    if resumed:
        console.print(f"resumed: {resumed} result{'' if resumed == 1 else 's'} from the stored study (an earlier run's or "
                      "another worker's), never compared with this run's fp32: the finalists among them ran again, "
                      "and the winner's figure is measured side by side in this run", highlight=False)
    pruned = tune.get("pruned") or []
    if pruned:
        console.print(f"pruned (not run): {len(pruned)} proposals the priors ruled out; --no-priors runs them",
                      highlight=False)
    finalists = tune.get("finalists") or []
    rounds = tune.get("remeasure_rounds")
    if len(finalists) > 1:
        close = ", ".join(f"{f['label']} {median_round(f):,.0f}/s" for f in finalists)
        console.print(f"re-measured side by side{f' in {rounds} rounds' if rounds else ''}: {close}", highlight=False)
    stop = remeasure_stop_line(tune)
    if stop:
        console.print(stop, highlight=False)
    for dropped in tune.get("dropped_finalists") or []:
        console.print(f"[red]dropped[/] {dropped.get('label')}: {dropped.get('reason')}", highlight=False)
    if tune.get("gap"):
        between = tune["gap"].get("between") or []
        # Against fp32, the decisive gap is the speed-up itself; between finalists it is no speed-up.
        rival = "" if between[1:2] == [(tune.get("reference") or {}).get("label", "fp32")] else \
            " (between finalists: not a speed-up over fp32)"
        console.print(f"gap: {describe_gap(tune['gap'])}{rival}", highlight=False)
    if tune.get("tie_note"):
        console.print(f"tie: {tune['tie_note']}", highlight=False)


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


def _print_winner(tune: dict[str, Any], console: Console) -> None:
    try:
        described = Policy.from_dict(tune["winner"]).describe()
    except MpadviseError:  # written by another version: its label still says what won
        described = str(tune.get("winner_label"))
    speedup = tune.get("speedup") or ({"ratio": tune["speedup_vs_fp32"]} if tune.get("speedup_vs_fp32") else None)
    console.print(f"[bold green]winner[/]: {described}" + (f", {describe_speedup(speedup)}" if speedup else ""),
                  highlight=False)
    if tune.get("scale_batch_note"):
        console.print(f"[yellow]note[/]: {tune['scale_batch_note']}", highlight=False)
    if tune.get("config_file"):
        console.print(f"wrote {tune['config_file']}", highlight=False)
    if tune.get("cache_id") is not None:
        console.print(f"cached for this GPU/CPU as entry #{tune['cache_id']} (mpadvise show)", highlight=False)
    if tune.get("storage"):
        # A database server's study is joined as it stands by every worker that runs this tune.
        how = ("every worker running this tune joins it" if shared_storage(tune["storage"])
               else f"continue with: {escape(resume_command(tune))}")
        console.print(f"study {tune.get('study_name')!r} in {tune['storage']} ({how})", highlight=False)
    if tune.get("framework"):
        # A framework script applies its policy with no changed line: through mpadvise run.
        export = shlex.join(["mpadvise", "export", *([pasteable_path(tune["config_file"])] if tune.get("config_file")
                                                      else []), "--to", str(tune["framework"])])
        console.print(f"train with it: [bold]{escape(run_command(tune))}[/] (or {escape(export)})", highlight=False)
    elif tune.get("calls_load_policy"):
        console.print("the script calls advisor.load_policy(): it applies the config file beside it", highlight=False)
    else:
        console.print("add to the script: [bold]mp = advisor.load_policy()[/] (it reads the config file beside it)")
