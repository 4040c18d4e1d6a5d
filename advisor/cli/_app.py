"""The root ``mpadvise`` app: each command declares its options and delegates; torch is
imported inside commands, so ``mpadvise --help`` stays fast."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
from typer.core import TyperGroup

from advisor._version import __version__
from advisor.cli import _cache, _daemon, _env
from advisor.cli._common import JsonOption, QuietOption, console, fail, handle_errors, print_json
from advisor.tune import PAIRS_MAX, OptionInfo, TuneOptions, option_info


class _OneLineUsageErrors(TyperGroup):
    """A value typer itself refuses (an unknown option, a missing argument...) is one red line
    on stderr, exit 2, as the commands' own bad values are, not typer's usage text in a box."""

    def main(self, *args: Any, standalone_mode: bool = True, **kwargs: Any) -> Any:
        if not standalone_mode:
            return super().main(*args, standalone_mode=False, **kwargs)
        try:
            # Not standalone: typer returns the exit code and lets a usage error through.
            code = super().main(*args, standalone_mode=False, **kwargs)
        except typer.Abort:
            raise SystemExit(fail("aborted").exit_code) from None
        except typer.TyperException as exc:
            message = getattr(exc, "format_message", None)
            if type(exc).__name__ == "NoArgsIsHelpError" or message is None:  # typer printed the help
                raise SystemExit(getattr(exc, "exit_code", 2)) from None
            ctx = getattr(exc, "ctx", None)
            hint = f" (see {ctx.command_path} -h)" if ctx is not None else ""
            raise SystemExit(fail(" ".join(message().split()) + hint, getattr(exc, "exit_code", 2)).exit_code) from None
        raise SystemExit(code if isinstance(code, int) else 0)

    # typer turns a Ctrl-C while it parses, prints help or dispatches into a silent exit 130; a
    # command's own Ctrl-C is its one line already (handle_errors). These say it in that line.
    def make_context(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().make_context(*args, **kwargs)
        except KeyboardInterrupt:
            raise fail("interrupted", 130) from None

    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            raise fail("interrupted", 130) from None


app = typer.Typer(
    cls=_OneLineUsageErrors,
    name="mpadvise",
    help="Hardware-aware precision advisor for PyTorch training: measures, picks and applies "
    "the fastest stable precision policy.",
    no_args_is_help=True,
    add_completion=True,  # --install-completion / --show-completion
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},  # every command and group inherits -h
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


# How each tune option reads on the command line where its field's type would not do.
_TUNE_OPTION_TYPES: dict[str, Any] = {"modes": list[str] | None, "memory_limit": str | None, "out": Path | None}


def _framework_help() -> str:
    from advisor.frameworks import FRAMEWORKS

    return f"How the script trains: {', '.join(FRAMEWORKS)}; default: read from its imports."


def with_tune_options(
    taken: Callable[[OptionInfo], bool] = lambda option: True,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Expand a command's ``options: TuneOptions`` into one option per field ``taken`` accepts, as
    :class:`TuneOptions` declares it, so the command line cannot drift from the API."""
    chosen = [option for option in option_info() if taken(option)]

    def expand(command: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(command, eval_str=True)
        parameters = []
        for parameter in signature.parameters.values():
            if parameter.name != "options":
                parameters.append(parameter)
                continue
            parameters += [
                inspect.Parameter(
                    option.name, parameter.kind,
                    default=None if isinstance(option.default, tuple) else option.default,  # typer: a list defaults to None
                    annotation=Annotated[_TUNE_OPTION_TYPES.get(option.name, option.type),
                                         typer.Option(*option.flags, help=_framework_help() if option.name == "framework" else option.help)],
                )
                for option in chosen
            ]

        @functools.wraps(command)
        def wrapper(**values: Any) -> Any:
            given = {option.name: values.pop(option.name) for option in chosen}
            options = TuneOptions(**{name: value for name, value in given.items() if value is not None})
            return command(options=options, **values)

        wrapper.__signature__ = signature.replace(parameters=parameters)  # type: ignore[attr-defined]
        wrapper.__annotations__ = {p.name: p.annotation for p in parameters}
        return wrapper

    return expand


@app.command(rich_help_panel="Tune")
@handle_errors
@with_tune_options()
def tune(
    script: Annotated[Path, typer.Argument(
        help="The training script: one that calls advisor.load_policy(), or one that trains with a framework and "
        "never imports advisor (then apply the answer with: mpadvise run SCRIPT -- ARGS).")],
    script_args: Annotated[list[str] | None, typer.Argument(help="Arguments for the script, after --.")] = None,
    *,
    options: TuneOptions,
    submit: Annotated[bool, typer.Option("--submit", help="Queue the tune with the local daemon "
                                         "(mpadvise daemon start) and follow it.")] = False,
    dry_run: Annotated[bool, typer.Option(
        "--dry-run", help="Show the search space (modes, and why each other one is left out; micro-batch sizes; loss "
        "scaling) and the plan (framework, launch command, candidates, budget, config file, study), then stop: no "
        "trial runs, nothing is written.")] = False,
    json_output: JsonOption = False,
    quiet: QuietOption = False,
    verbose: Annotated[bool, typer.Option(
        "--verbose", help="The whole report: the search's priors and stop, the run-to-run spread, FLOPs and MFU, the "
        "re-measured gap, the cost, the machine's notes and the study; by default, the answer at a glance.")] = False,
) -> None:
    """Search precision mode, loss scaling and micro-batch size for the fastest stable policy."""
    from advisor.cli._tune import run_tune_command, submit_tune_command
    from probes import UsageError

    if dry_run and submit:
        raise UsageError("--dry-run cannot be used with --submit: it shows a tune here without running it; leave out "
                         "--submit")
    if dry_run:
        raise typer.Exit(run_tune_command(script, script_args or [], options, json_output=json_output, console=console,
                                          dry_run=True))
    command = submit_tune_command if submit else run_tune_command
    raise typer.Exit(command(script, script_args or [], options, json_output=json_output, console=console, quiet=quiet,
                             verbose=verbose))


@app.command(rich_help_panel="Tune")
@handle_errors
@with_tune_options(lambda option: option.trial)
def trial(
    script: Annotated[Path, typer.Argument(help="The training script (it calls advisor.load_policy(), or trains with a framework).")],
    script_args: Annotated[list[str] | None, typer.Argument(help="Arguments for the script, after --.")] = None,
    *,
    options: TuneOptions,
    plot: Annotated[Path | None, typer.Option("--plot", help="Write loss curves and step times to this PNG.")] = None,
    stream: Annotated[Path | None, typer.Option(
        "--stream", help="Append one JSON line per finished trial to this file, then the comparison "
        "(default: the file MPADVISE_TRIAL_STREAM names, if any), so a run cut short keeps every verdict.")] = None,
    pairs: Annotated[int, typer.Option(
        "--pairs", min=0, max=PAIRS_MAX,
        help="Run fp32 and each stable candidate again this many rounds, interleaved, for a paired "
        "speed-up with its 95% interval (0: one run of each).")] = 0,
    json_output: JsonOption = False,
    quiet: QuietOption = False,
) -> None:
    """Run the fp32 reference and the named candidates; compare speed, memory and stability."""
    from advisor.cli._trial import TrialStream, run_trial_command

    code = run_trial_command(script, script_args or [], options, plot=plot, json_output=json_output, console=console,
                             stream=None if stream is None else TrialStream(stream), quiet=quiet, pairs=pairs)
    raise typer.Exit(code)


@app.command(rich_help_panel="Apply")
@handle_errors
def run(
    script: Annotated[Path, typer.Argument(help="The training script: a Lightning, HF Trainer or Accelerate script, or one that calls load_policy().")],
    script_args: Annotated[list[str] | None, typer.Argument(help="Arguments for the script, after --.")] = None,
    config: Annotated[Path | None, typer.Option(help="Config file to apply; default: resolved as load_policy() does.")] = None,
    framework: Annotated[str | None, typer.Option(help=_framework_help())] = None,
    device: Annotated[str | None, typer.Option(help="cpu or cuda:N whose policy applies; default: the first GPU, else the CPU.")] = None,
    json_output: Annotated[bool, typer.Option("--json", help="After the script's own output, print one line of JSON on "
                                              "stdout: the policy applied and its source, the framework, the script's "
                                              "exit code and wall time (mpadvise run --json x.py | tail -1 | jq).")] = False,
    guard: Annotated[str | None, typer.Option(help="warn or fallback (or off): what the guard does when the run turns "
                                              "unstable late; default MPADVISE_GUARD, else warn.")] = None,
) -> None:
    """Run a script, unchanged, with its tuned policy applied (the script's exit code is this command's)."""
    from advisor.cli._run import run_command

    raise typer.Exit(run_command(script, script_args or [], config=config, framework=framework, device=device,
                                 json_output=json_output, guard=guard))


@app.command(rich_help_panel="Apply")
@handle_errors
def policy(
    target: Annotated[Path | None, typer.Argument(
        help="A training script, or a .toml config file to check.")] = None,
    device: Annotated[str | None, typer.Option(help="cpu or cuda:N; default: the first GPU, else the CPU.")] = None,
    json_output: JsonOption = False,
) -> None:
    """Which policy load_policy() would apply for a script (or a config file) here, and why."""
    from advisor.cli._export import explain_policy

    info = explain_policy(target, device=device)
    if json_output:
        print_json(info)
        return
    console.print(f"[bold]{info['describe']}[/] from {info['source']}", highlight=False)
    if info["not_applied_because"]:
        console.print(f"[yellow]not applying the tuned policy[/]: {info['not_applied_because']}", highlight=False)


@app.command(rich_help_panel="Apply")
@handle_errors
def export(
    config: Annotated[Path | None, typer.Argument(
        help="A config file (.toml, as mpadvise tune writes), or a training script (.py) whose "
        "policy resolves as mpadvise policy does.")] = None,
    to: Annotated[str | None, typer.Option("--to", help="lightning, fabric, transformers, "
                                           "accelerate, deepspeed or torchtitan.")] = None,
    out: Annotated[Path | None, typer.Option("--out", help="Write the export to this file instead of printing it.")] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing --out file (never the script, nor a .py file "
                                        "mpadvise export did not write).")] = False,
    json_output: JsonOption = False,
) -> None:
    """Print a policy as a framework's own settings: faithful, or refused with the reason."""
    from advisor.cli._export import export_command

    export_command(config, target=to, out=out, json_output=json_output, force=force)


# The help groups the commands by what they are for: Tune, Apply, Machine, then the groups (Cache, Service).
app.command("show", rich_help_panel="Apply")(_cache.show)
app.add_typer(_cache.app, name="cache", rich_help_panel="Cache")
app.add_typer(_cache.study_app, name="study", rich_help_panel="Cache")
app.add_typer(_daemon.app, name="daemon", rich_help_panel="Service")
app.command("probe", rich_help_panel="Machine")(_env.probe)
app.command("env", rich_help_panel="Machine")(_env.env)
