"""``mpadvise study status``: what a study storage holds, read without writing, so it is safe
beside running workers."""

from __future__ import annotations

import os
from typing import Annotated, Any

import typer
from rich.table import Column, Table

from advisor.cli._common import JsonOption, console, handle_errors, print_json

app = typer.Typer(help="Optuna studies of tunes: what a shared study holds, read without writing.",
                  no_args_is_help=True)


@app.command()
@handle_errors
def status(
    storage: Annotated[str | None, typer.Option(
        "--storage", help="Optuna storage URL; default: MPADVISE_STORAGE, MPADVISE_STORAGE_FILE, else the SQLite file "
        "in the cache directory.")] = None,
    study: Annotated[str | None, typer.Option("--study", help="Only this study; default: every study.")] = None,
    json_output: JsonOption = False,
) -> None:
    """List the studies in a storage: hardware, trials by state, workers seen, the best so far."""
    from advisor.tune import default_storage_url, resolve_storage, shown_url, study_status

    url = resolve_storage(storage, os.environ) or default_storage_url()
    studies = study_status(url, study)
    if json_output:
        print_json({"storage": shown_url(url), "studies": studies})
        return
    render_status(shown_url(url) or "", studies)


def render_status(shown: str, studies: list[dict[str, Any]]) -> None:
    if not studies:
        console.print(f"no studies in {shown}", highlight=False)
        return
    # Short count headers, named in full under the table, and prose columns that wrap at their
    # spaces: the table fits 80 columns with every count and name whole.
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
