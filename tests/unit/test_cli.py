"""The CLI through typer's test runner: --version, --help without torch, probe, policy, and
tune's options and its summary."""

from __future__ import annotations

import functools
import io
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from rich.console import Console
from typer.testing import CliRunner

from advisor import __version__
from advisor.cli._app import app
from advisor.cli._report import render_tune
from advisor.trial import TrialResult
from advisor.tune._engine import tune_policy
from advisor.tune._options import TuneOptions, option_info
from policies import Policy, TunedOn
from probes import HardwareProfile

# The whole report (mpadvise tune --verbose): it holds every figure these tests read.
render_verbose = functools.partial(render_tune, verbose=True)

runner = CliRunner()


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("MPADVISE_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("MPADVISE_POLICY", raising=False)


def test_version():
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output.strip() == f"mpadvise {__version__}"


def test_help_does_not_import_torch():
    code = "import sys; from advisor.cli._app import app; print('torch' in sys.modules, 'optuna' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False False"


def test_probe_json_describes_this_machine():
    result = runner.invoke(app, ["probe", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    cpu = [d for d in data["devices"] if d["profile"]["kind"] == "cpu"]
    assert len(cpu) == 1
    modes = cpu[0]["modes"]
    assert modes["fp32"]["supported"] and not modes["fp8-te"]["supported"]
    assert modes["fp8-te"]["reason"].startswith("fp8-te:")
    assert cpu[0]["safe_default"]["mode"] in ("fp32", "bf16-mixed")
    assert data["primary"] == cpu[0]["fingerprint"]


def test_probe_table_and_bench():
    result = runner.invoke(app, ["probe", "--bench"], env={"COLUMNS": "160"})
    assert result.exit_code == 0, result.output
    assert "safe default" in result.output and "matmul micro-benchmark" in result.output
    assert "fp32" in result.output and "bf16" in result.output


def test_policy_for_a_script_with_a_config_beside_it(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    Policy(mode="fp32", micro_batch_size=8).save(tmp_path / "train.mpadvise.toml")
    result = runner.invoke(app, ["policy", str(script), "--json"])
    assert result.exit_code == 0, result.output
    info = json.loads(result.output)
    assert info["policy"]["mode"] == "fp32" and info["policy"]["micro_batch_size"] == 8
    assert "train.mpadvise.toml" in info["source"] and info["kind"] == "beside-script"


def test_policy_without_anything_is_the_safe_default(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("")
    result = runner.invoke(app, ["policy", str(script), "--json"])
    assert result.exit_code == 0, result.output
    info = json.loads(result.output)
    assert info["source"].startswith("safe default") and info["kind"] == "safe-default"


def test_policy_tuned_elsewhere_is_not_applied(tmp_path):
    path = tmp_path / "other.mpadvise.toml"
    Policy(mode="fp32", tuned_on=TunedOn(hardware_fingerprint="0" * 16, device="NVIDIA H100", torch="2.4.0")).save(path)
    result = runner.invoke(app, ["policy", str(path), "--json"])
    assert result.exit_code == 0, result.output
    info = json.loads(result.stdout)  # the warning that it is not applied goes to stderr
    assert "device NVIDIA H100" in info["not_applied_because"] and "torch 2.4.0" in info["not_applied_because"]


@pytest.mark.parametrize(
    ("content", "needle", "code"),
    [
        ("mode = [", "invalid TOML", 2),  # a file that does not load is a bad argument
        ('mode = "fp33"\n', "mode: 'fp33' is not allowed", 2),
        ('mode = "fp8-te"\n', "cannot run on", 1),  # a good file this hardware cannot apply
    ],
)
def test_bad_config_file_is_one_line(tmp_path, content, needle, code):
    path = tmp_path / "bad.mpadvise.toml"
    path.write_text(content)
    result = runner.invoke(app, ["policy", str(path)])
    assert result.exit_code == code
    assert needle in " ".join(result.output.split())  # rich may wrap the line at the terminal width
    assert "Traceback" not in result.output


def test_missing_config_file_is_one_line():
    result = runner.invoke(app, ["policy", "nope.mpadvise.toml"])
    assert result.exit_code == 2 and "does not exist" in result.output


def test_unknown_command_is_a_usage_error():
    assert runner.invoke(app, ["frobnicate"]).exit_code == 2


# -- tune: the options come from TuneOptions; one renderer works from the tune's JSON ---------


def test_tune_declares_one_option_per_field_with_its_flag_default_and_help():
    command = typer.main.get_command(app).commands["tune"]
    params = {p.name: p for p in command.params}
    assert [p.name for p in command.params] == ["script", "script_args", *(o.name for o in option_info()),
                                                "submit", "dry_run", "json_output", "quiet", "verbose"]
    for option in option_info():
        param = params[option.name]
        assert param.opts[0] == option.flag and (param.help == option.help or option.name == "framework")
        assert param.default == (None if option.default == () else option.default)


def test_framework_help_lists_the_registered_frameworks():
    from advisor.frameworks import FRAMEWORKS

    commands = typer.main.get_command(app).commands
    for name in ("tune", "trial", "run"):
        framework = next(p for p in commands[name].params if p.name == "framework")
        assert all(f in framework.help for f in FRAMEWORKS), (name, framework.help)


def test_trial_takes_its_options_from_the_same_declarations():
    command = typer.main.get_command(app).commands["trial"]
    taken = [o for o in option_info() if o.trial]
    assert [p.name for p in command.params] == ["script", "script_args", *(o.name for o in taken), "plot", "stream", "pairs",
                                                "json_output", "quiet"]
    params = {p.name: p for p in command.params}
    for option in taken:
        param = params[option.name]
        assert param.opts[0] == option.flag and param.default == (None if option.default == () else option.default)
    assert {o.name for o in taken} == {"steps", "warmup", "modes", "memory_limit", "timeout", "first_step_timeout",
                                       "seed", "device", "framework", "nproc_per_node"}


def test_trial_hands_the_command_one_tune_options(monkeypatch):
    seen = {}

    def fake_run(script, script_args, options, *, plot, json_output, console, stream, quiet, pairs):
        seen.update(options=options, args=script_args, plot=plot, stream=stream, quiet=quiet, pairs=pairs)
        return 0

    monkeypatch.setattr("advisor.cli._trial.run_trial_command", fake_run)
    result = runner.invoke(app, ["trial", "train.py", "-m", "bf16-mixed", "--steps", "12", "--warmup", "3",
                                 "--memory-limit", "2GiB", "--", "--lr", "0.1"])
    assert result.exit_code == 0, result.output
    assert seen["options"] == TuneOptions(modes=["bf16-mixed"], steps=12, warmup=3, memory_limit="2GiB")
    assert seen["args"] == ["--lr", "0.1"] and seen["plot"] is None and seen["stream"] is None
    assert not seen["quiet"] and seen["pairs"] == 0
    result = runner.invoke(app, ["trial", "train.py", "--stream", "trials.jsonl", "-q", "--pairs", "4"])
    assert result.exit_code == 0, result.output
    assert seen["stream"].path == Path("trials.jsonl") and seen["quiet"] and seen["pairs"] == 4


def test_tune_hands_the_command_one_tune_options(tmp_path, monkeypatch):
    seen = {}

    def fake_run(script, script_args, options, *, json_output, console, quiet, verbose):
        seen.update(script=script, args=script_args, options=options, json=json_output, quiet=quiet, verbose=verbose)
        return 3

    monkeypatch.setattr("advisor.cli._tune.run_tune_command", fake_run)
    wanted = TuneOptions(trials=3, time_budget=90.5, modes=["fp32", "bf16-mixed"], memory_limit="4GiB",
                         out=str(tmp_path / "x.toml"), no_cache=True, no_priors=True, seed=4, device="cpu")
    result = runner.invoke(app, ["tune", "train.py", *wanted.to_argv(), "--json", "--", "--lr", "0.1"])
    assert result.exit_code == 3, result.output
    assert seen == {"script": Path("train.py"), "args": ["--lr", "0.1"], "options": wanted, "json": True,
                    "quiet": False, "verbose": False}
    result = runner.invoke(app, ["tune", "train.py", "--quiet", "--fresh"])
    assert result.exit_code == 3 and seen["quiet"] and seen["options"] == TuneOptions(fresh=True), result.output
    result = runner.invoke(app, ["tune", "train.py", "--verbose"])
    assert result.exit_code == 3 and seen["verbose"] and not seen["quiet"], result.output


def test_tune_bad_option_is_one_line_before_anything_runs():
    result = runner.invoke(app, ["tune", "missing.py", "--steps", "0"])
    assert result.exit_code == 2 and "--steps 0 is not allowed; expected a whole number >= 1" in result.output
    assert "Traceback" not in result.output


def test_submit_refuses_storage_as_a_usage_error():
    result = runner.invoke(app, ["tune", "--submit", "train.py", "--storage", "sqlite:///x.db"])
    assert result.exit_code == 2 and "--storage cannot be used with --submit" in result.output


def _fake_trial(policy, label):
    steps = 40
    losses = [2.0 * math.exp(-i / 20) for i in range(steps)]
    if policy.mode == "fp16-mixed":
        losses = losses[:10] + [float("nan")] * (steps - 10)
    ms = {"fp32": 10.0, "bf16-mixed": 5.0}.get(policy.mode, 4.0)
    return TrialResult(
        outcome="ok", label=label, policy=policy.to_dict(), losses=tuple(losses), step_times=(ms / 1e3,) * steps,
        samples=(64,) * steps, skipped=(False,) * steps, warmup_steps=3, user_batch=64, global_batch=64,
        peak_memory=300 * 2**20, workload_fingerprint="ab" * 8, model_signature="cd" * 8,
    )


def _tune_json() -> dict:
    profile = HardwareProfile(kind="cuda", name="NVIDIA A100-SXM4-80GB", index=0, compute_capability=(8, 0),
                              memory_total=80 * 2**30, torch_version="2.13.0")
    options = TuneOptions(trials=4, modes=["bf16-mixed", "fp16-mixed"], no_priors=True)
    result = tune_policy(_fake_trial, profile, options, dtype_ratio={"fp32": 1.0, "bf16": 12.0}, remeasure=False)
    payload = result.to_dict()
    payload.update(script="/w/train.py", args=[], config_file="/w/train.mpadvise.toml", cache_id=4,
                   storage="sqlite:////c/studies.db", study_name="train-s", hardware={"name": profile.name})
    return json.loads(json.dumps(payload, default=str))


def _rendered(tune: dict) -> str:
    console = Console(record=True, width=200, file=io.StringIO())
    render_verbose(tune, console)
    return console.export_text()


def test_one_renderer_shows_a_tune_from_its_json():
    tune = _tune_json()
    text = _rendered(tune)
    assert "train.py on NVIDIA A100-SXM4-80GB: the fp32 reference and " in text and " candidates" in text
    winner = next(row for row in tune["candidates"] if row["winner"])
    assert winner["mode"] == "bf16-mixed"
    assert f"→ │ {winner['label']}" in text and "300 MiB" in text
    assert "fp16-mixed" in text and "unstable" in text  # the loser, and why, under the table
    assert "matmul throughput vs fp32 on this device (the search's priors): bf16 12x" in text
    assert f"search stopped: {tune['stop_reason']}" in text
    assert f"winner: {Policy.from_dict(tune['winner']).describe()}, " in text
    assert "wrote /w/train.mpadvise.toml" in text and "entry #4" in text
    assert ("study 'train-s' in sqlite:////c/studies.db (continue with: mpadvise tune /w/train.py --resume --storage "
            "sqlite:////c/studies.db)") in text
    assert "add to the script: mp = advisor.load_policy()" in text

    # A study on a database server is joined, not resumed; a framework script is run, not edited.
    shared = _rendered({**tune, "storage": "postgresql://tuner:***@db/mpadvise", "framework": "lightning"})
    assert "study 'train-s' in postgresql://tuner:***@db/mpadvise (every worker running this tune joins it)" in shared
    assert "train with it: mpadvise run /w/train.py (or mpadvise export /w/train.mpadvise.toml --to lightning)" in shared
    assert "load_policy" not in shared

    nothing = _rendered({**tune, "winner": None, "winner_label": None})
    assert "no stable policy fits" in nothing and "wrote" not in nothing


# Commands that hand the terminal to something else: the daemon in the foreground.
NO_JSON = {("daemon", "run")}


def _leaf_commands(command, path=()):
    children = getattr(command, "commands", None)
    if not children:
        yield path, command
        return
    for name, child in children.items():
        yield from _leaf_commands(child, (*path, name))


def test_every_command_is_registered_with_help_and_json():
    """A new command is found here once its module adds it to the root app: it needs a help text
    and --json (the recipe in docs/architecture.md)."""
    from typer.main import get_command

    leaves = dict(_leaf_commands(get_command(app)))
    assert {("probe",), ("tune",), ("trial",), ("export",), ("cache", "list"), ("daemon", "start")} <= set(leaves)
    for path, command in leaves.items():
        assert (command.help or "").strip(), path
        options = {opt for param in command.params for opt in getattr(param, "opts", [])}
        assert ("--json" in options) is (path not in NO_JSON), path
