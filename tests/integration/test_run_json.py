"""``mpadvise run --json``: the script's own output passes through unchanged, then one line of
JSON on stdout says what ran (``mpadvise run --json train.py | tail -1 | jq``)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from policies import Policy

SCRIPTS = Path(__file__).resolve().parent / "scripts"
ROOT = Path(__file__).resolve().parents[2]

LOUD = """\
import sys
print("line one from the script")
print("to stderr from the script", file=sys.stderr)
print("last line from the script")
sys.exit(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
"""


def _summary(stdout: str) -> dict:
    return json.loads(stdout.splitlines()[-1])


def test_the_scripts_output_passes_through_and_the_last_line_is_json(tmp_path, isolated_home, cli):
    script = tmp_path / "loud.py"
    script.write_text(LOUD)
    proc = cli("run", "--json", str(script), "--", "7", timeout=120)
    assert proc.returncode == 7
    assert proc.stdout.splitlines()[:2] == ["line one from the script", "last line from the script"]
    # A plain script with nothing tuned for it runs as it is; mpadvise says so in one line first.
    hint, *rest = proc.stderr.splitlines()
    assert hint.startswith(f"mpadvise: no tuned policy for {script}") and f"mpadvise tune {script}" in hint
    assert rest == ["to stderr from the script"]
    summary = _summary(proc.stdout)
    assert summary["script"] == str(script) and summary["framework"] == "torch"
    assert summary["exit_code"] == 7 and isinstance(summary["wall_s"], float) and summary["wall_s"] >= 0
    assert summary["policy"] is None and summary["source"] == "none: the script's own settings"


def test_a_loop_api_script_names_its_config(tmp_path, isolated_home, cli):
    script = tmp_path / "tiny_ok.py"
    shutil.copy(SCRIPTS / "tiny_ok.py", script)
    config = Policy(mode="bf16-mixed").save(tmp_path / "chosen.toml")
    proc = cli("run", str(script), "--config", str(config), "--json", "--", "3", timeout=120)
    assert proc.returncode == 0, proc.stderr
    summary = _summary(proc.stdout)
    assert summary["policy"]["mode"] == "bf16-mixed" and summary["source"] == f"config file {config}"
    assert summary["source_kind"] == "explicit" and summary["exit_code"] == 0


def test_an_untuned_framework_script_says_none(tmp_path, isolated_home, cli):
    script = tmp_path / "train.py"
    script.write_text(LOUD)
    proc = cli("run", "--json", "--framework", "Lightning", str(script), timeout=120)
    assert proc.returncode == 0, proc.stderr
    summary = _summary(proc.stdout)
    assert summary["framework"] == "lightning" and summary["policy"] is None
    assert summary["source"].startswith("none") and summary["source_kind"] is None


def test_tail_and_a_json_reader_read_it_through_a_pipe(tmp_path, isolated_home):
    script = tmp_path / "loud.py"
    script.write_text(LOUD)
    run = subprocess.Popen([sys.executable, "-m", "advisor.cli", "run", "--json", str(script)],
                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd=ROOT)
    tail = subprocess.run(["tail", "-1"], stdin=run.stdout, capture_output=True, text=True, timeout=120)
    run.stdout.close()
    assert run.wait(timeout=120) == 0
    assert json.loads(tail.stdout)["exit_code"] == 0
