"""A real CPU tune of a tiny script through the CLI: trials, table, config file, cache, resume."""

from __future__ import annotations

import io
import json
import os
import shutil
from pathlib import Path

import pytest
from rich.console import Console

from advisor.cli._report import render_tune
from advisor.tune import study_status
from policies import Policy, load_config

SCRIPTS = Path(__file__).resolve().parent / "scripts"


@pytest.fixture
def tiny_script(tmp_path):
    script = tmp_path / "train.py"
    shutil.copy(SCRIPTS / "tiny_ok.py", script)
    return script


def test_cli_tune_writes_config_caches_and_reports(tiny_script, isolated_home, cli):
    proc = cli("tune", str(tiny_script), "--trials", "2", "--steps", "32", "--warmup", "2", "--no-priors",
               "-m", "bf16-mixed", "--json", "--", "60")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["trials_run"] == 2
    assert result["user_batch"] == 32
    # fp32 ran once more, same seed, its initial weights perturbed; its drift is in the reference's verdict.
    assert result["replicate"]["seed"] == 0 and result["replicate"]["steps"] == 34
    assert not result["replicate"]["reused"] and not result["replicate"]["note"]
    assert "final_gap_limit" in result["reference"]["verdict"]["metrics"]
    labels = {c["label"] for c in result["candidates"]}
    assert "fp32" in labels and any(label.startswith("bf16-mixed") for label in labels)
    assert all(c["outcome"] in ("ok", "unstable", "too-short", "oom") for c in result["candidates"])
    winner = [c for c in result["candidates"] if c["winner"]]
    assert len(winner) == 1 and winner[0]["stable"]
    config = tiny_script.with_name("train.mpadvise.toml")
    assert result["config_file"] == str(config)
    policy = load_config(config)
    assert policy.mode == winner[0]["mode"]
    assert policy.tuned_on.hardware_fingerprint == result["hardware"]["fingerprint"]
    assert policy.tuned_on.speedup_vs_fp32 is not None and policy.tuned_on.trials >= 2
    assert result["cache_id"] is not None

    show = cli("show", "--json")
    assert show.returncode == 0, show.stderr
    entries = json.loads(show.stdout)
    assert "train.py" in json.dumps(entries)

    # One speed-up figure for the winner: printed (--json and the report rendered from it),
    # written (the config file) and cached are the same number, with the same interval.
    figure = result["speedup_vs_fp32"]
    assert figure is not None and figure == result["speedup"]["ratio"] == winner[0]["speedup_vs_fp32"]
    assert winner[0]["speedup_basis"] == result["speedup"]["basis"]
    tuned = policy.tuned_on
    assert (tuned.speedup_vs_fp32, tuned.speedup_low, tuned.speedup_high, tuned.speedup_basis) == (
        figure, result["speedup"]["low"], result["speedup"]["high"], result["speedup"]["basis"])
    cached = [e for e in _dicts(entries) if e.get("id") == result["cache_id"] and "speedup_vs_fp32" in e]
    assert cached and all(e["speedup_vs_fp32"] == figure for e in cached)
    assert all(Policy.from_dict(e["policy"]).tuned_on.speedup_vs_fp32 == figure for e in cached)
    console = Console(record=True, width=300, file=io.StringIO())
    render_tune(result, console)
    text = console.export_text()
    assert text.startswith("winner: ") and f", {figure:.2f}x fp32 goodput (" in text.splitlines()[0]
    console = Console(record=True, width=300, file=io.StringIO())
    render_tune(result, console, verbose=True)
    assert f", {figure:.2f}x fp32 goodput ({result['speedup']['basis']}" in console.export_text()
    # The script calls load_policy() already: it is not told to add it.
    assert result["calls_load_policy"] and "add to the script" not in text

    # The script now runs the tuned policy with plain python: the config beside it is found,
    # and applies to the workload it was tuned on (the same arguments) only.
    import subprocess
    import sys

    run = subprocess.run([sys.executable, str(tiny_script), "60"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert f"from config file {config}" in run.stderr and "changed since tuning" not in run.stderr
    other = subprocess.run([sys.executable, str(tiny_script), "5"], capture_output=True, text=True, timeout=120)
    assert other.returncode == 0, other.stderr
    misses = [line for line in other.stderr.splitlines() if "changed since tuning" in line]
    assert len(misses) == 1 and "script arguments 60 -> 5" in misses[0] and f"from config file {config}" in misses[0]


def test_cli_tune_resume_continues_the_study(tiny_script, isolated_home, cli):
    common = ["--steps", "32", "--warmup", "2", "--no-priors", "-m", "bf16-mixed", "--no-cache", "--json"]
    first = cli("tune", str(tiny_script), "--trials", "1", *common, "--", "50")
    assert first.returncode == 0, first.stderr
    second = cli("tune", str(tiny_script), "--trials", "1", "--resume", *common, "--", "50")
    assert second.returncode == 0, second.stderr
    data = json.loads(second.stdout)
    assert data["trials_resumed"] >= 1 and data["trials_run"] == 1
    # The replicate is kept with the study: the resumed tune judges against the same spread
    # without running fp32 under the other seed again.
    before, after = json.loads(first.stdout)["replicate"], data["replicate"]
    assert after["reused"] and not before["reused"]
    metrics = json.loads(first.stdout)["reference"]["verdict"]["metrics"]
    assert data["reference"]["verdict"]["metrics"]["replicate_end"] == metrics["replicate_end"]


def _dicts(value):
    """Every dict inside a JSON value, itself included."""
    if isinstance(value, dict):
        yield value
        for item in value.values():
            yield from _dicts(item)
    elif isinstance(value, list):
        for item in value:
            yield from _dicts(item)


def test_cli_tune_resume_keeps_the_study_when_the_workload_changed_outside_the_script(tmp_path, isolated_home, cli):
    # Same script, same arguments (so the same study), but an environment variable changes the
    # model: --resume must not take the old verdicts and stamp the new model's fingerprint on
    # them, nor delete them: it refuses, and --fresh starts afresh.
    script = tmp_path / "train.py"
    source = (SCRIPTS / "tiny_ok.py").read_text()
    layers = "nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4)"
    assert layers in source
    script.write_text("import os\n" + source.replace(
        layers, "nn.Linear(32, int(os.environ['TINY_WIDTH'])), nn.ReLU(), nn.Linear(int(os.environ['TINY_WIDTH']), 4)"))
    common = ["--trials", "1", "--steps", "32", "--warmup", "2", "--no-priors", "-m", "bf16-mixed", "--no-cache",
              "--json", "--", "50"]
    env = dict(os.environ)
    first = cli("tune", str(script), *common, env={**env, "TINY_WIDTH": "64"})
    assert first.returncode == 0, first.stderr
    before = json.loads(first.stdout)
    [study] = study_status(before["storage"], before["study_name"])

    second = cli("tune", str(script), "--resume", *common, env={**env, "TINY_WIDTH": "48"})
    assert second.returncode == 2, second.stderr
    assert "Traceback" not in second.stderr and second.stdout == ""
    errors = [ln for ln in second.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, second.stderr
    assert f"holds {study['measured']} finished trial" in errors[0] and "another workload (the model changed" in errors[0]
    assert "it is kept: pass --fresh to delete it" in errors[0]
    assert study_status(before["storage"], before["study_name"]) == [study]  # before: a warning, the trials gone

    third = cli("tune", str(script), "--fresh", *common, env={**env, "TINY_WIDTH": "48"})
    assert third.returncode == 0, third.stderr
    after = json.loads(third.stdout)
    assert after["trials_resumed"] == 0 and after["trials_run"] == 1
    assert not after["replicate"]["reused"]
    signature = load_config(script.with_name("train.mpadvise.toml")).tuned_on.model_signature
    assert signature == after["winner"]["tuned_on"]["model_signature"] != before["winner"]["tuned_on"]["model_signature"]


@pytest.mark.parametrize(
    ("args", "code", "needle"),
    [
        (["tune", "missing.py"], 2, "does not exist"),
        (["tune", "{script}", "--trials", "0"], 2, "--trials 0 is not allowed"),
        (["tune", "{script}", "-m", "tf32"], 1, "cannot run on"),
        (["tune", "{script}", "-m", "bf17"], 2, "unknown mode"),
        (["tune", "{script}", "--storage", "nosuchdb://x"], 2, "cannot open the Optuna study storage"),
    ],
)
def test_cli_tune_bad_input(tiny_script, isolated_home, cli, args, code, needle):
    proc = cli(*[a.format(script=tiny_script) for a in args], "--steps", "32", "--", "40")
    assert proc.returncode == code, proc.stderr
    assert "Traceback" not in proc.stderr
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and needle in errors[0], proc.stderr
