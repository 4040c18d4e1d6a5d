"""A real tune, then plain runs: the cached answer applies to the tuned workload only.

The tune's trial children and the plain runs compute the workload fingerprint in separate
processes; this checks that they agree for the unchanged script, and that an edited learning
rate or a copy of the script in another folder misses with one line naming why.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent / "scripts"


def _plain_run(script: Path, *args: str) -> str:
    run = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    return run.stderr


def test_a_cached_answer_applies_to_its_workload_only(tmp_path: Path, isolated_home: Path, cli) -> None:
    script = tmp_path / "project" / "train.py"
    script.parent.mkdir()
    shutil.copy(SCRIPTS / "tiny_ok.py", script)
    proc = cli("tune", str(script), "--trials", "1", "--steps", "32", "--warmup", "2", "--no-priors",
               "-m", "bf16-mixed", "--", "60")
    assert proc.returncode == 0, proc.stderr
    script.with_name("train.mpadvise.toml").unlink()

    same = _plain_run(script, "60")
    assert "(from cache entry #1 (tuned " in same and "changed since tuning" not in same

    text = script.read_text()
    assert "lr=3e-3" in text
    script.write_text(text.replace("lr=3e-3", "lr=3e-2"))
    edited = _plain_run(script, "60")
    misses = [line for line in edited.splitlines() if "changed since tuning" in line]
    assert len(misses) == 1, edited
    assert misses[0].startswith("mpadvise: workload changed since tuning (script edited; ")
    # The safe default replaces the tuned mode; where the tune chose the safe default itself
    # (fp32 on a CPU without a fast bf16 path), the line keeps it and says so; where the tune chose
    # fp32 on a CPU whose safe default is bf16-mixed (AMX-BF16, a model too small to gain), fp32
    # is kept as the safer of the two.
    assert "now AdamW(lr=0.03, " in misses[0]
    assert ("using the safe default" in misses[0] or ": the safe default here" in misses[0]
            or "keeping fp32 from cache entry #1 (tuned " in misses[0] and "safer than the safe default bf16-mixed" in misses[0])

    copy = tmp_path / "elsewhere" / "train.py"
    copy.parent.mkdir()
    shutil.copy(script, copy)
    script.write_text(text)
    elsewhere = _plain_run(copy, "60")
    assert "(from safe default for " in elsewhere and "cache entry" not in elsewhere
