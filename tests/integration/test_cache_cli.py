"""``mpadvise show`` and ``mpadvise cache ...`` through Typer's runner, on a private cache.

The commands are registered into a fresh Typer app, and this machine's hardware is a fixed
A100 profile, so what ``show`` calls "this machine" does not depend on where the tests run.
"""

from __future__ import annotations

import json
import sqlite3
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from advisor import cli
from advisor._paths import database_path
from advisor.cache import _store as _cache
from advisor.cache._recommend import record_tune
from advisor.cli import _cache as _cache_cli
from advisor.cli._cache import parse_duration
from policies import Policy, TunedOn
from probes import HardwareProfile, hardware_fingerprint

A100 = HardwareProfile(
    kind="cuda", name="NVIDIA A100-SXM4-80GB", index=0, compute_capability=(8, 0), sm_count=108,
    memory_total=81229 * 1024**2, driver_version="550.54.15", cuda_runtime="12.4",
    torch_version="2.5.1+cu124", libraries=(("torchao", "0.10.0"), ("transformer_engine", None)),
)
H100 = replace(A100, name="NVIDIA H100 80GB HBM3", compute_capability=(9, 0), sm_count=132)
A100_OLD_TORCH = replace(A100, torch_version="2.4.0+cu124")


@pytest.fixture
def app(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> typer.Typer:
    monkeypatch.setenv("MPADVISE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("COLUMNS", "200")
    monkeypatch.setattr(_cache, "_warned_no_cache", set())
    monkeypatch.setattr(_cache_cli, "_machine_profiles", lambda: [A100])
    # The CLI's console took its width when it was created; tables should not wrap here.
    monkeypatch.setattr(cli.console, "_width", 200)
    application = typer.Typer()

    @application.callback()
    def root() -> None:
        """mpadvise (test app)."""

    application.command("show")(_cache_cli.show)
    application.add_typer(_cache_cli.app, name="cache")
    return application


def run(app: typer.Typer, *args: str) -> Any:
    return CliRunner().invoke(app, list(args))


def _record(profile: HardwareProfile, script: str, mode: str = "bf16-mixed", workload: str = "ab" * 8) -> int:
    recommendation_id = record_tune(
        profile=profile, policy=Policy(mode=mode, tuned_on=TunedOn(model_signature="cd" * 8)),
        script=script, workload_fingerprint=workload,
        trials=[
            {"number": 0, "mode": "fp32", "outcome": "ok", "verdict": "stable", "goodput": 100.0},
            {"number": 1, "mode": "fp16-true", "outcome": "unstable", "verdict": "unstable",
             "reason": "loss stalled", "goodput": 150.0},
            {"number": 2, "mode": mode, "outcome": "ok", "verdict": "stable", "goodput": 175.0},
        ],
        speedup_vs_fp32=1.75, goodput=175.0,
    )
    assert recommendation_id is not None
    return recommendation_id


@pytest.fixture
def entries(app: typer.Typer, tmp_path: Path) -> dict[str, int]:
    """Three entries: this machine, this machine under an older torch, another GPU."""
    return {
        "here": _record(A100, str(tmp_path / "train.py"), workload="01" * 8),
        "old torch": _record(A100_OLD_TORCH, str(tmp_path / "train.py"), "fp16-mixed", "02" * 8),
        "h100": _record(H100, str(tmp_path / "big.py"), "fp8-torchao", "03" * 8),
    }


def _rows() -> int:
    with sqlite3.connect(database_path()) as conn:
        return conn.execute("SELECT COUNT(*) FROM recommendations").fetchone()[0]


def _error_line(result: Any) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.output
    return lines[0]


# -- show ---------------------------------------------------------------------------------------


def test_show_on_an_empty_cache_says_so(app: typer.Typer, tmp_path: Path) -> None:
    result = run(app, "show")
    assert result.exit_code == 0, result.output
    assert "No recommendations cached for this machine (NVIDIA A100-SXM4-80GB)" in result.stdout
    assert not (tmp_path / "home").exists()  # reading an empty cache creates nothing
    data = json.loads(run(app, "show", "--json").stdout)
    assert data["recommendations"] == [] and data["hardware"][0]["fingerprint"] == hardware_fingerprint(A100)


def test_show_lists_this_machines_entries_and_hides_other_hardware(
    app: typer.Typer, entries: dict[str, int]
) -> None:
    result = run(app, "show")
    assert result.exit_code == 0, result.output
    assert "bf16-mixed" in result.stdout and "valid" in result.stdout and "1.75x" in result.stdout
    assert "fp8-torchao" not in result.stdout
    assert "2 entries tuned on other hardware or versions not shown" in result.stdout
    data = json.loads(run(app, "show", "--json").stdout)
    (row,) = data["recommendations"]
    assert (row["id"], row["valid"], row["status"], row["this_machine"]) == (entries["here"], True, "valid", True)
    assert (row["workload_fp"], row["mode"], row["speedup_vs_fp32"]) == ("01" * 8, "bf16-mixed", 1.75)
    assert data["other_hardware"] == 2


def test_show_all_says_why_other_entries_do_not_apply(app: typer.Typer, entries: dict[str, int]) -> None:
    data = json.loads(run(app, "show", "--all", "--json").stdout)
    status = {row["id"]: row for row in data["recommendations"]}
    assert status[entries["here"]]["status"] == "valid"
    old = status[entries["old torch"]]
    assert not old["valid"] and "torch 2.4.0+cu124 -> 2.5.1+cu124" in old["status"]
    assert old["status"] == "other hardware: torch 2.4.0+cu124 -> 2.5.1+cu124"
    assert "device NVIDIA H100 80GB HBM3 -> NVIDIA A100-SXM4-80GB" in status[entries["h100"]]["status"]
    text = run(app, "show", "--all").stdout
    assert "Other hardware or versions (not applied here)" in text
    assert "fp8-torchao" in text and "torch 2.4.0+cu124 -> 2.5.1+cu124" in text


def test_show_details_gives_each_entry_in_full(app: typer.Typer, entries: dict[str, int]) -> None:
    plain = run(app, "show").stdout
    assert "loss stalled" not in plain  # the trials' reasons are details
    result = run(app, "show", "--details")
    assert result.exit_code == 0, result.output
    assert "loss stalled" in result.stdout and "torch 2.5.1+cu124" in result.stdout
    assert "fp8-torchao" not in result.stdout  # only this machine's entries, as without --details
    data = json.loads(run(app, "show", "--details", "--json").stdout)
    (record,) = data["details"]
    assert record["id"] == entries["here"]
    assert [trial["verdict"] for trial in record["trials"]] == ["stable", "unstable", "stable"]
    assert "details" not in json.loads(run(app, "show", "--json").stdout)


# -- cache list / show ----------------------------------------------------------------------------


def test_cache_list_shows_every_entry_newest_first(app: typer.Typer, entries: dict[str, int]) -> None:
    result = run(app, "cache", "list")
    assert result.exit_code == 0, result.output
    assert "NVIDIA H100 80GB HBM3" in result.stdout and "big.py" in result.stdout
    data = json.loads(run(app, "cache", "list", "--json").stdout)
    assert [row["id"] for row in data["recommendations"]] == [entries["h100"], entries["old torch"], entries["here"]]


def test_cache_show_prints_one_entry_with_its_trials(app: typer.Typer, entries: dict[str, int]) -> None:
    result = run(app, "cache", "show", str(entries["here"]))
    assert result.exit_code == 0, result.output
    assert "loss stalled" in result.stdout and "torch 2.5.1+cu124" in result.stdout
    data = json.loads(run(app, "cache", "show", str(entries["here"]), "--json").stdout)
    assert [trial["verdict"] for trial in data["trials"]] == ["stable", "unstable", "stable"]
    assert data["policy"]["tuned_on"]["hardware_fingerprint"] == hardware_fingerprint(A100)


def test_cache_show_of_a_missing_id_is_one_line(app: typer.Typer, entries: dict[str, int]) -> None:
    result = run(app, "cache", "show", "999")
    assert result.exit_code == 1
    assert "recommendation #999 is not in the cache" in _error_line(result)


# -- export / import / clear ----------------------------------------------------------------------


def test_export_clear_import_round_trip(app: typer.Typer, entries: dict[str, int], tmp_path: Path) -> None:
    shared = tmp_path / "team.json"
    result = run(app, "cache", "export", str(shared))
    assert result.exit_code == 0, result.output
    assert "exported 3 recommendations" in result.stdout
    assert json.loads(run(app, "cache", "export", str(tmp_path / "one.json"), "--id", str(entries["here"]), "--json").stdout)["exported"] == 1

    cleared = json.loads(run(app, "cache", "clear", "--yes", "--json").stdout)
    assert cleared["deleted"] == 3 and _rows() == 0

    result = run(app, "cache", "import", str(shared))
    assert result.exit_code == 0, result.output
    assert "imported 3 of 3 records" in result.stdout
    assert _rows() == 3
    # A fresh local tune of one key is newer than the file's answer for it, and stays.
    fresh = _record(A100, str(tmp_path / "train.py"), "fp16-mixed", workload="01" * 8)
    again = json.loads(run(app, "cache", "import", str(shared), "--json").stdout)
    assert (again["records"], again["imported"], again["kept_newer"]) == (3, 2, 1)
    assert _rows() == 3
    assert "1 kept: the cached answer for the same key is newer" in run(app, "cache", "import", str(shared)).stdout
    assert json.loads(run(app, "cache", "show", str(fresh), "--json").stdout)["mode"] == "fp16-mixed"
    data = json.loads(run(app, "show", "--json").stdout)
    assert [row["valid"] for row in data["recommendations"]] == [True]


def _exported(app: typer.Typer, tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    path = tmp_path / "export.json"
    assert run(app, "cache", "export", str(path)).exit_code == 0
    return path, json.loads(path.read_text())


def test_import_of_a_corrupt_file_is_one_line_and_writes_nothing(
    app: typer.Typer, entries: dict[str, int], tmp_path: Path
) -> None:
    path, _ = _exported(app, tmp_path)
    path.write_text(path.read_text()[:200])  # truncated in transit
    before = _rows()
    result = run(app, "cache", "import", str(path))
    assert result.exit_code == 1
    line = _error_line(result)
    assert "is not an mpadvise export: invalid JSON" in line and "nothing was imported" in line
    assert _rows() == before


@pytest.mark.parametrize(
    ("tamper", "message"),
    [
        pytest.param(lambda r: r.update(hardware_fp="ffffffffffffffff"), "disagrees with the policy's", id="claims-other-hardware"),
        pytest.param(lambda r: r["hardware"].update(name="NVIDIA B200"), "is not the fingerprint of its hardware profile", id="edited-profile"),
        pytest.param(lambda r: r.update(hardware=None), "carries no hardware profile", id="no-profile"),
        pytest.param(lambda r: r["policy"].update(mode="fp64"), "'fp64' is not allowed", id="unknown-mode"),
        pytest.param(lambda r: r.update(workload_fp="not hex"), "workload_fp must be", id="bad-workload"),
    ],
)
def test_import_refuses_a_foreign_or_corrupt_record_whole(
    app: typer.Typer, entries: dict[str, int], tmp_path: Path, tamper: Any, message: str
) -> None:
    path, document = _exported(app, tmp_path)
    tamper(document["records"][1])
    path.write_text(json.dumps(document))
    assert run(app, "cache", "clear", "--yes").exit_code == 0
    result = run(app, "cache", "import", str(path))
    assert result.exit_code == 1
    line = _error_line(result)
    assert "record 1" in line and message in line and "nothing was imported" in line
    assert _rows() == 0


def test_clear_older_than_keeps_recent_entries(app: typer.Typer, entries: dict[str, int]) -> None:
    result = run(app, "cache", "clear", "--yes", "--older-than", "30d")
    assert result.exit_code == 0, result.output
    assert "deleted 0 recommendations older than 30d" in result.stdout
    assert _rows() == 3
    with sqlite3.connect(database_path()) as conn:
        conn.execute("UPDATE recommendations SET created_at = '2020-01-01T00:00:00.000000+00:00' WHERE id = ?", [entries["h100"]])
    data = json.loads(run(app, "cache", "clear", "--yes", "--older-than", "12h", "--json").stdout)
    assert (data["deleted"], data["older_than_seconds"]) == (1, 43200.0)
    assert _rows() == 2


@pytest.mark.parametrize("value", ["abc", "30", "-3d", "0d", "3x", "d30", "1d 2"])
def test_older_than_rejects_what_is_not_a_duration(app: typer.Typer, entries: dict[str, int], value: str) -> None:
    result = run(app, "cache", "clear", "--older-than", value)
    assert result.exit_code == 2
    assert "--older-than" in _error_line(result)
    assert _rows() == 3


def test_durations_parse_with_units_and_sums() -> None:
    assert parse_duration("30d").total_seconds() == 30 * 86400
    assert parse_duration("1d12h").total_seconds() == 36 * 3600
    assert parse_duration(" 2W ").total_seconds() == 14 * 86400
    assert parse_duration("1.5h").total_seconds() == 5400


# -- damaged and missing caches -------------------------------------------------------------------


def test_a_corrupt_database_is_moved_aside_and_commands_keep_working(
    app: typer.Typer, tmp_path: Path, warnings: list[str]
) -> None:
    database_path().parent.mkdir(parents=True)
    database_path().write_bytes(b"garbage" * 500)
    result = run(app, "show")
    assert result.exit_code == 0, result.output
    assert "No recommendations cached" in result.stdout
    assert len(warnings) == 1 and str(database_path()) in warnings[0] and ".corrupt-" in warnings[0]
    _record(A100, str(tmp_path / "train.py"))
    assert json.loads(run(app, "cache", "list", "--json").stdout)["recommendations"][0]["mode"] == "bf16-mixed"


def test_an_unusable_cache_directory_is_no_cache_for_readers_and_an_error_for_writers(
    app: typer.Typer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, warnings: list[str]
) -> None:
    (tmp_path / "a-file").write_text("not a directory")
    monkeypatch.setenv("MPADVISE_HOME", str(tmp_path / "a-file" / "home"))
    result = run(app, "show")
    assert result.exit_code == 0 and "No cache" in result.stdout
    result = run(app, "cache", "list", "--json")
    assert result.exit_code == 0 and json.loads(result.stdout)["cache"] is False
    assert len(warnings) == 1 and "continuing without the cache" in warnings[0]
    export = tmp_path / "x.json"
    export.write_text("{}")
    result = run(app, "cache", "import", str(export))
    assert result.exit_code == 1 and "MPADVISE_HOME" in _error_line(result)
