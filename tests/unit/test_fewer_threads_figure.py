"""A cached speed-up measured on fewer CPU threads than torch's own (other processes kept cores
busy through the tune) is marked wherever the cache lists it: a one-thread gain is not the
machine's (on the 2-core Xeon, bf16-true 1.39x on one thread, 1.17x on two)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

import probes
from advisor.cache._recommend import record_tune
from advisor.cli._app import app
from policies import Policy, TunedOn

runner = CliRunner()
HELD = "paired re-measurement, 2 pairs, on 1 of torch's 2 threads, other processes keeping cores busy"


@pytest.fixture(autouse=True)
def home(cache_home: Path) -> Path:
    return cache_home


def _record(tmp_path: Path, name: str, speedup: float, threads: int | None, basis: str) -> int:
    script = tmp_path / name
    script.write_text("pass\n")
    policy = Policy(mode="bf16-true", tuned_on=TunedOn(speedup_vs_fp32=speedup, speedup_low=speedup * 0.95,
                                                       speedup_high=speedup * 1.05, speedup_basis=basis,
                                                       speedup_threads=threads, global_batch=64))
    entry = record_tune(profile=probes.cpu_profile(), policy=policy, script=script,
                        workload_fingerprint=(name.encode().hex() * 8)[:16], trials=[], speedup_vs_fp32=speedup,
                        goodput=1000.0, args=[])
    assert entry is not None
    return entry


def test_the_list_marks_a_figure_from_fewer_threads_and_says_why(tmp_path) -> None:
    _record(tmp_path, "held.py", 1.39, 1, HELD)
    _record(tmp_path, "quiet.py", 1.17, None, "paired re-measurement, 3 pairs")
    for command in (["cache", "list"], ["show"]):
        result = runner.invoke(app, command, env={"COLUMNS": "200"})
        assert result.exit_code == 0, result.output
        rows = {name: next(line for line in result.output.splitlines() if name in line)
                for name in ("held.py", "quiet.py")}
        assert "1.39x*" in rows["held.py"] and "1.17x" in rows["quiet.py"] and "*" not in rows["quiet.py"], rows
        assert "*: measured on fewer threads than torch's own" in " ".join(result.output.split())


def test_no_mark_and_no_legend_without_such_a_figure(tmp_path) -> None:
    _record(tmp_path, "quiet.py", 1.17, None, "paired re-measurement, 3 pairs")
    result = runner.invoke(app, ["cache", "list"], env={"COLUMNS": "200"})
    assert result.exit_code == 0 and "1.17x" in result.output and "*" not in result.output, result.output


def test_an_entry_and_its_json_carry_the_threads(tmp_path) -> None:
    entry = _record(tmp_path, "held.py", 1.39, 1, HELD)
    shown = runner.invoke(app, ["cache", "show", str(entry)], env={"COLUMNS": "200"})
    assert shown.exit_code == 0 and "on 1 of torch's 2 threads" in " ".join(shown.output.split()), shown.output
    listed = runner.invoke(app, ["cache", "list", "--json"])
    assert listed.exit_code == 0, listed.output
    (row,) = json.loads(listed.output)["recommendations"]
    assert row["policy"]["tuned_on"]["speedup_threads"] == 1
