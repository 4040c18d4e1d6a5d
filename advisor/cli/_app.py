"""The ``mpadvise`` command line: each command declares its options and delegates.

torch is imported inside commands, so ``mpadvise --help`` stays fast. One domain exception
(``MpadviseError``) is caught at the boundary and printed as one red line on stderr.
Exit codes: 0 done, 1 error, 2 usage, 3 no stable policy found.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from advisor._version import __version__
from advisor.cli import _cache, _daemon
from advisor.cli._common import JsonOption, console, fail, handle_errors, print_json

app = typer.Typer(
    name="mpadvise",
    help="Hardware-aware precision advisor for PyTorch training: measures, picks and applies "
    "the fastest stable precision policy.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _version_callback(value: bool) -> None:
    if value:
        console.print(f"mpadvise {__version__}", highlight=False)
        raise typer.Exit()


@app.callback()
def root(
    version: Annotated[
        bool, typer.Option("--version", callback=_version_callback, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """Hardware-aware precision advisor for PyTorch training."""


@app.command()
@handle_errors
def probe(
    json_output: JsonOption = False,
    bench: Annotated[bool, typer.Option("--bench", help="Also measure matmul TFLOP/s per dtype on each device.")] = False,
) -> None:
    """Show what this machine can do: devices, supported precision modes, the safe default."""
    from advisor._hardware import probe_report
    from advisor.cli._probe import render_probe

    report = probe_report(bench=bench)
    if json_output:
        print_json(report)
    else:
        render_probe(report, console)


@app.command()
@handle_errors
def policy(
    target: Annotated[
        Path | None, typer.Argument(help="A training script, or a .toml config file to check.")
    ] = None,
    device: Annotated[str | None, typer.Option(help="cpu or cuda:N; default: the first GPU, else the CPU.")] = None,
    json_output: JsonOption = False,
) -> None:
    """Which policy load_policy() would apply for a script (or a config file) here, and why."""
    from advisor.cli._policy import explain_policy

    info = explain_policy(target, device=device)
    if json_output:
        print_json(info)
        return
    console.print(f"[bold]{info['describe']}[/] from {info['source']}", highlight=False)
    if info["not_applied_because"]:
        console.print(f"[yellow]not applying the tuned policy[/]: {info['not_applied_because']}", highlight=False)


@app.command(context_settings={"help_option_names": ["-h", "--help"]})
@handle_errors
def trial(
    script: Annotated[Path, typer.Argument(help="The training script (it calls advisor.load_policy()).")],
    script_args: Annotated[list[str] | None, typer.Argument(help="Arguments for the script, after --.")] = None,
    mode: Annotated[
        list[str] | None, typer.Option("--mode", "-m", help="Candidate mode; repeat for several. Default: every supported mode.")
    ] = None,
    steps: Annotated[int, typer.Option(help="Measured optimizer steps per trial (after the warm-up).")] = 40,
    warmup: Annotated[int, typer.Option(help="Warm-up steps per trial, not timed.")] = 5,
    memory_limit: Annotated[
        str | None, typer.Option("--memory-limit", help="e.g. 4GiB: a real cap on CUDA, a verdict on peak RSS on CPU.")
    ] = None,
    timeout: Annotated[float, typer.Option(help="Seconds before a trial is killed.")] = 600.0,
    seed: Annotated[int, typer.Option(help="Seed shared by every trial.")] = 0,
    device: Annotated[str | None, typer.Option(help="cpu or cuda:N; default: the first GPU, else the CPU.")] = None,
    plot: Annotated[Path | None, typer.Option("--plot", help="Write loss curves and step times to this PNG.")] = None,
    json_output: JsonOption = False,
) -> None:
    """Run the fp32 reference and the named candidates; compare speed, memory and stability."""
    from advisor.cli._trial import run_trial_command

    code = run_trial_command(
        script, script_args or [], modes=mode or [], steps=steps, warmup=warmup, memory_limit=memory_limit,
        timeout=timeout, seed=seed, device=device, plot=plot, json_output=json_output, console=console,
    )
    raise typer.Exit(code)


@app.command()
@handle_errors
def tune(
    script: Annotated[Path, typer.Argument(help="The training script (it calls advisor.load_policy()).")],
    script_args: Annotated[list[str] | None, typer.Argument(help="Arguments for the script, after --.")] = None,
    trials: Annotated[int, typer.Option(help="Trial budget of the search (the reference not counted).")] = 20,
    time_budget: Annotated[float | None, typer.Option("--time-budget", help="Seconds after which no new trial starts.")] = None,
    steps: Annotated[int, typer.Option(help="Measured optimizer steps per trial (after the warm-up).")] = 40,
    warmup: Annotated[int, typer.Option(help="Warm-up steps per trial, not timed.")] = 5,
    mode: Annotated[list[str] | None, typer.Option("--mode", "-m", help="Restrict the search to these modes.")] = None,
    scale_batch: Annotated[bool, typer.Option("--scale-batch", help="Also try larger global batches (changes the optimisation).")] = False,
    include_emulated: Annotated[bool, typer.Option("--include-emulated", help="Also search FP8 emulated on a CPU.")] = False,
    memory_limit: Annotated[str | None, typer.Option("--memory-limit", help="e.g. 4GiB: candidates above it are infeasible.")] = None,
    timeout: Annotated[float, typer.Option(help="Seconds before a trial is killed.")] = 600.0,
    seed: Annotated[int, typer.Option(help="Seed shared by every trial and the sampler.")] = 0,
    device: Annotated[str | None, typer.Option(help="cpu or cuda:N; default: the first GPU, else the CPU.")] = None,
    storage: Annotated[str | None, typer.Option(help="Optuna storage URL; default: an SQLite file in the cache directory.")] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue the stored study instead of starting afresh.")] = False,
    out: Annotated[Path | None, typer.Option("--out", help="Config file to write; default: <script>.mpadvise.toml beside it.")] = None,
    no_cache: Annotated[bool, typer.Option("--no-cache", help="Do not store the answer in the per-GPU cache.")] = False,
    no_priors: Annotated[
        bool, typer.Option("--no-priors", help="Measure candidates even when the matmul priors say they cannot win.")
    ] = False,
    submit: Annotated[
        bool, typer.Option("--submit", help="Queue the tune with the local daemon (mpadvise daemon start) and follow it.")
    ] = False,
    json_output: JsonOption = False,
) -> None:
    """Search precision mode, loss scaling and micro-batch size for the fastest stable policy."""
    if submit:
        from advisor.daemon._client import submit_tune

        if storage is not None:
            raise fail("--storage cannot be used with --submit: the daemon keeps its studies in its cache directory", 2)
        code = submit_tune(
            script, script_args or [], device=device, json_output=json_output, console=console,
            options={"trials": trials, "time_budget": time_budget, "steps": steps, "warmup": warmup,
                     "modes": mode or [], "scale_batch": scale_batch, "include_emulated": include_emulated,
                     "memory_limit": memory_limit, "timeout": timeout, "seed": seed, "resume": resume,
                     "out": str(out) if out is not None else None, "no_cache": no_cache, "no_priors": no_priors},
        )
        raise typer.Exit(code)
    from advisor.cli._tune import run_tune_command

    code = run_tune_command(
        script, script_args or [], trials=trials, time_budget=time_budget, steps=steps, warmup=warmup,
        memory_limit=memory_limit, timeout=timeout, seed=seed, device=device, modes=mode or [],
        scale_batch=scale_batch, include_emulated=include_emulated, storage=storage, resume=resume, out=out,
        cache=not no_cache, use_priors=not no_priors, json_output=json_output, console=console,
    )
    raise typer.Exit(code)


app.command("show")(_cache.show)
app.add_typer(_cache.app, name="cache")
app.add_typer(_daemon.app, name="daemon")


def main() -> None:
    """Console-script entry point."""
    app()

