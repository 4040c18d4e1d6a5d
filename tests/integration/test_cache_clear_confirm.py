"""``mpadvise cache clear`` asks before deleting: on a terminal it takes y or n, without one it
refuses unless ``--yes`` says it. The command runs as a real process, on a pseudo-terminal where
a person would answer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _terminal import answer_on_terminal

from advisor.cache._recommend import record_tune
from policies import Policy, TunedOn
from probes import HardwareProfile

ROOT = Path(__file__).resolve().parents[2]
A100 = HardwareProfile(kind="cuda", name="NVIDIA A100-SXM4-80GB", index=0, compute_capability=(8, 0),
                       memory_total=80 * 2**30, torch_version="2.5.1+cu124")


@pytest.fixture
def home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    home = tmp_path / "home"
    monkeypatch.setenv("MPADVISE_HOME", str(home))
    assert record_tune(profile=A100, policy=Policy(mode="bf16-mixed", tuned_on=TunedOn(model_signature="cd" * 8)),
                       script=str(tmp_path / "train.py"), workload_fingerprint="ab" * 8, trials=[],
                       speedup_vs_fp32=1.5, goodput=150.0) is not None
    return home


def _env(home: Path) -> dict[str, str]:
    return {**os.environ, "MPADVISE_HOME": str(home), "COLUMNS": "200"}


def _on_terminal(home: Path, answer: str, *args: str) -> tuple[int, str]:
    """Run ``mpadvise cache clear ARGS`` with a pseudo-terminal as stdin, answer the prompt, and
    return the exit code and everything the command wrote to its terminal."""
    return answer_on_terminal([sys.executable, "-m", "advisor.cli", "cache", "clear", *args], answer, cwd=ROOT,
                              env=_env(home))


def _count(home: Path) -> int:
    out = subprocess.run([sys.executable, "-m", "advisor.cli", "cache", "list", "--json"], cwd=ROOT, env=_env(home),
                         capture_output=True, text=True, timeout=120)
    return len(json.loads(out.stdout)["recommendations"])


def test_no_keeps_the_cache_and_yes_clears_it(home: Path):
    code, text = _on_terminal(home, "n")
    assert "Delete the cached recommendations in " in text and "[y/N]" in text
    assert code == 1 and "nothing deleted" in text
    assert _count(home) == 1
    code, text = _on_terminal(home, "y")
    assert code == 0 and "deleted 1 recommendation from" in text, text
    assert _count(home) == 0


def test_without_a_terminal_it_refuses_unless_told_yes(home: Path):
    result = subprocess.run([sys.executable, "-m", "advisor.cli", "cache", "clear"], cwd=ROOT, env=_env(home),
                            stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "pass --yes" in lines[0] and "Traceback" not in result.stderr
    assert _count(home) == 1
    result = subprocess.run([sys.executable, "-m", "advisor.cli", "cache", "clear", "--yes", "--json"], cwd=ROOT,
                            env=_env(home), stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and '"deleted": 1' in result.stdout
    assert _count(home) == 0
