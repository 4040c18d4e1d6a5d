"""A real CPU tune of a tiny script through the CLI: trials, table, config file, cache, resume."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from policies import load_config

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
    # fp32 ran once more under another seed; its spread is in the reference's verdict.
    assert result["replicate"]["seed"] == 1 and result["replicate"]["steps"] == 34
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

    # The script now runs the tuned policy with plain python: the config beside it is found.
    import subprocess
    import sys

    run = subprocess.run([sys.executable, str(tiny_script), "5"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert f"from config file {config}" in run.stderr


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


@pytest.mark.parametrize(
    ("args", "code", "needle"),
    [
        (["tune", "missing.py"], 1, "does not exist"),
        (["tune", "{script}", "--trials", "0"], 1, "--trials 0 is not allowed"),
        (["tune", "{script}", "-m", "tf32"], 1, "cannot run on"),
        (["tune", "{script}", "-m", "bf17"], 2, "unknown mode"),
        (["tune", "{script}", "--storage", "nosuchdb://x"], 1, "cannot open the Optuna study storage"),
    ],
)
def test_cli_tune_bad_input(tiny_script, isolated_home, cli, args, code, needle):
    proc = cli(*[a.format(script=tiny_script) for a in args], "--steps", "32", "--", "40")
    assert proc.returncode == code, proc.stderr
    assert "Traceback" not in proc.stderr
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and needle in errors[0], proc.stderr
