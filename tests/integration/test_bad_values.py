"""Every command, given a bad value for an option that takes one (a path that is not there, a
negative number, an unknown choice), answers in one line on stderr, ``error: ...``, exit 2,
never a traceback: the project's own checks and typer's alike.

The commands run through typer's CliRunner (a bad value is refused before anything runs, so no
subprocess is needed); one case runs the real command line, as a user meets it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from advisor.cli import app

ROOT = Path(__file__).resolve().parents[2]


CASES = [
    # policy
    (["policy", "{tmp}/missing.py"], "missing.py does not exist"),
    (["policy", "{script}", "--device", "gpu7"], "device 'gpu7' is not allowed"),
    (["policy", "{script}", "--device", "cuda:x"], "device 'cuda:x' is not allowed"),
    (["policy", "{script}", "--device", "cuda:99"], "device 'cuda:99' is not available"),
    (["policy", "{bad_toml}"], "invalid TOML"),
    # trial and tune: choices, numbers, paths
    (["trial", "{script}", "--mode", "fp99"], "unknown mode 'fp99'"),
    (["trial", "{script}", "--framework", "lightnig"], "did you mean lightning?"),
    (["trial", "{script}", "--device", "tpu"], "device 'tpu' is not allowed"),
    (["trial", "{script}", "--seed", "abc"], "Invalid value for '--seed'"),
    (["trial", "{script}", "--steps", "ten"], "Invalid value for '--steps'"),
    (["trial", "{script}", "--steps", "-1"], "--steps -1 is not allowed"),
    (["trial", "{script}", "--warmup", "-1"], "--warmup -1 is not allowed"),
    (["trial", "{script}", "--timeout", "-5"], "--timeout -5 is not allowed"),
    (["trial", "{script}", "--first-step-timeout", "-1"], "is not allowed"),
    (["trial", "{script}", "--nproc-per-node", "0"], "--nproc-per-node 0"),
    (["trial", "{script}", "--memory-limit", "lots"], "'lots' is not a size"),
    (["trial", "{tmp}/missing.py"], "does not exist"),
    (["trial", "{script}", "--plot", "{tmp}/nodir/x.png"], "nodir does not exist"),
    (["trial", "{script}", "--stream", "{tmp}/nodir/s.jsonl"], "--stream {tmp}/nodir/s.jsonl: cannot write there"),
    (["tune", "{script}", "--framework", "keras"], "unknown framework 'keras'; expected one of lightning"),
    (["tune", "{script}", "--framework", "Keras"], "unknown framework 'Keras'"),
    (["tune", "{script}", "--mode", "bf16-mixd"], "did you mean bf16-mixed"),
    (["tune", "{script}", "--trials", "many"], "Invalid value for '--trials'"),
    (["tune", "{script}", "--trials", "0"], "--trials 0 is not allowed"),
    (["tune", "{script}", "--time-budget", "-1"], "--time-budget -1"),
    (["tune", "{script}", "--seed", "-1"], "--seed -1 is not allowed"),
    (["tune", "{script}", "--storage", "bogus://x"], "bogus://x"),
    (["tune", "{script}", "--out", "{tmp}/nodir/x.toml"], "nodir does not exist"),
    # run
    (["run", "{script}", "--config", "{tmp}/none.toml"], "none.toml does not exist"),
    (["run", "{script}", "--config", "{bad_toml}"], "invalid TOML"),
    (["run", "{script}", "--framework", "fabrik"], "did you mean fabric?"),
    (["run", "{script}", "--framework", "lightning", "--device", "gpu7"], "device 'gpu7' is not allowed"),
    (["run", "{tmp}/missing.py"], "does not exist"),
    # export
    (["export", "{tmp}/none.toml", "--to", "lightning"], "none.toml does not exist"),
    (["export", "{config}", "--to", "deepspeeed"], "did you mean deepspeed?"),
    (["export", "{config}", "--to", "lightning", "--out", "{tmp}/nodir/x.py"], "nodir does not exist"),
    (["export", "{tmp}/settings.yaml", "--to", "lightning"], "expected a config file (.toml"),
    (["export", "{bad_toml}", "--to", "lightning"], "invalid TOML"),
    # show, env, probe: no value options; an unknown one
    (["show", "--limit", "3"], "No such option: --limit"),
    (["env", "--device", "cpu"], "No such option: --device"),
    (["probe", "--bench", "3"], "Got unexpected extra argument"),
    # cache
    (["cache", "show", "-1"], "No such option: -1"),
    (["cache", "show", "abc"], "Invalid value for 'ID'"),
    (["cache", "clear", "--older-than", "abc"], "--older-than 'abc' is not a duration"),
    (["cache", "clear", "--older-than", "-3d"], "--older-than '-3d' is not a duration"),
    (["cache", "export", "{tmp}/e.json", "--id", "x"], "Invalid value for '--id'"),
    (["cache", "export", "{tmp}/nodir/x.json"], "nodir does not exist"),
    (["cache", "import", "{tmp}/missing.json"], "missing.json does not exist"),
    # daemon
    (["daemon", "run", "--port", "70000"], "Invalid value for '--port'"),
    (["daemon", "run", "--port", "-1"], "Invalid value for '--port'"),
    (["daemon", "run", "--job-retention-days", "-1"], "Invalid value for '--job-retention-days'"),
    (["daemon", "run", "--allowed-root", "{tmp}/nodir"], "is not a directory"),
    (["daemon", "run", "--host", "example.invalid"], "is not a loopback address"),
    (["daemon", "start", "--wait", "-1"], "Invalid value for '--wait'"),
    (["daemon", "stop", "--wait", "-1"], "Invalid value for '--wait'"),
    (["daemon", "status", "--limit", "-1"], "Invalid value for '--limit'"),
    (["daemon", "run", "--uds", "{tmp}/nodir/sock"], "nodir does not exist"),
    (["daemon", "start", "--uds", "{tmp}/nodir/sock"], "nodir does not exist"),
    # study
    (["study", "status", "--stud"], "No such option: --stud"),
    (["study", "status", "--storage", "bogus://x"], "bogus://x"),
    (["study", "status", "--storage", "sqlite:///{tmp}/none.db"], "does not exist"),
]


def _case_id(case) -> str:
    return " ".join(a.replace("{", "").replace("}", "") for a in case[0])


@pytest.fixture
def files(tmp_path, isolated_home):
    script = tmp_path / "train.py"
    script.write_text("print('never run')\n")
    config = tmp_path / "ok.mpadvise.toml"
    config.write_text('mode = "fp32"\n')
    bad = tmp_path / "bad.mpadvise.toml"
    bad.write_text("mode = [\n")
    (tmp_path / "settings.yaml").write_text("mixed_precision: bf16\n")
    for path in (config, bad):
        path.chmod(0o600)
    return {"tmp": tmp_path, "script": script, "config": config, "bad_toml": bad}


@pytest.mark.parametrize(("argv", "needle"), CASES, ids=[_case_id(c) for c in CASES])
def test_a_bad_value_is_one_line_and_exit_2(argv, needle, files):
    args = [a.format(**files) for a in argv]
    result = CliRunner().invoke(app, args, env={"COLUMNS": "80"})
    assert "Traceback" not in result.output and not (
        result.exception and not isinstance(result.exception, SystemExit)), result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert needle.format(**files) in lines[0], lines[0]
    assert result.stdout == ""
    assert result.exit_code == 2, lines[0]


def test_the_real_command_line_says_it_in_one_line(tmp_path, isolated_home):
    """As a user meets it: typer's own refusal of a value, in the commands' style, naming the
    command's help."""
    proc = subprocess.run([sys.executable, "-m", "advisor.cli", "daemon", "run", "--port", "70000"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines() == [
        "error: Invalid value for '--port': Input should be less than or equal to 65535 "
        "(see python -m advisor.cli daemon run -h)"]
