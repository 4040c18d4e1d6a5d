"""``mpadvise cache import`` keeps an entry's id where it is free in this cache, and where it is
taken gives a new one and says so (``#1 -> #3``, and in ``--json``): real SQLite caches, real
``mpadvise`` processes exporting from one and importing into another."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import probes
from advisor.cache import Store, record_tune
from policies import Policy, TunedOn

pytestmark = pytest.mark.slow


def _cache(home: Path, workloads: list[str]) -> list[int]:
    """A cache in ``home`` holding one entry per workload fingerprint, in order."""
    home.mkdir(parents=True, exist_ok=True)
    ids = []
    with Store(home / "mpadvise.db") as store:
        for workload in workloads:
            entry = record_tune(
                profile=probes.cpu_profile(), policy=Policy(mode="fp32", tuned_on=TunedOn(workload_fingerprint=workload)),
                script=home / "train.py", workload_fingerprint=workload, speedup_vs_fp32=1.0, goodput=10.0,
                trials=[{"number": 0, "mode": "fp32", "outcome": "ok", "verdict": "stable", "goodput": 10.0}],
                store=store, args=[],
            )
            ids.append(entry)
    return ids


@pytest.fixture
def mpadvise(cli):
    """``mpadvise(home, ARGS)``: the CLI in a subprocess, on the cache in ``home``."""

    def run(home: Path, *args: str):
        env = {**os.environ, "MPADVISE_HOME": str(home)}
        env.pop("MPADVISE_POLICY", None)
        return cli(*args, env=env)

    return run


def _ids(home: Path) -> dict[str, int]:
    with Store(home / "mpadvise.db") as store:
        return {row["workload_fp"]: row["id"] for row in store.list_recommendations()}


@pytest.fixture
def exported(tmp_path: Path, mpadvise) -> Path:
    source = tmp_path / "source"
    assert _cache(source, ["a1" * 8, "b2" * 8, "c3" * 8]) == [1, 2, 3]
    file = tmp_path / "recs.json"
    done = mpadvise(source, "cache", "export", str(file))
    assert done.returncode == 0, done.stderr
    assert sorted(r["id"] for r in json.loads(file.read_text())["records"]) == [1, 2, 3]
    return file


def test_import_into_an_empty_cache_keeps_every_id(tmp_path: Path, exported: Path, mpadvise) -> None:
    target = tmp_path / "empty"
    done = mpadvise(target, "cache", "import", str(exported), "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["imported"] == 3 and report["renumbered"] == []
    assert sorted((pair["exported"], pair["id"]) for pair in report["ids"]) == [(1, 1), (2, 2), (3, 3)]
    assert _ids(target) == {"a1" * 8: 1, "b2" * 8: 2, "c3" * 8: 3}


def test_import_renumbers_only_the_taken_ids_and_prints_the_mapping(tmp_path: Path, exported: Path, mpadvise) -> None:
    target = tmp_path / "busy"
    # Two local entries of other workloads hold ids 1 and 2; id 3 is free.
    assert _cache(target, ["d4" * 8, "e5" * 8]) == [1, 2]
    done = mpadvise(target, "cache", "import", str(exported))
    assert done.returncode == 0, done.stderr
    assert "imported 3 of 3 records" in done.stdout
    assert "#1 -> #4" in done.stdout and "#2 -> #5" in done.stdout and "#3 ->" not in done.stdout
    assert _ids(target) == {"d4" * 8: 1, "e5" * 8: 2, "c3" * 8: 3, "a1" * 8: 4, "b2" * 8: 5}


def test_import_json_lists_the_mapping(tmp_path: Path, exported: Path, mpadvise) -> None:
    target = tmp_path / "busy"
    assert _cache(target, ["d4" * 8]) == [1]
    done = mpadvise(target, "cache", "import", str(exported), "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["renumbered"] == [{"exported": 1, "id": 4}]
    assert sorted((pair["exported"], pair["id"]) for pair in report["ids"]) == [(1, 4), (2, 2), (3, 3)]


def test_a_reimport_replaces_its_own_entries_in_place(tmp_path: Path, exported: Path, mpadvise) -> None:
    # The same key in both caches holds the same id: replacing it keeps that id.
    target = tmp_path / "again"
    assert mpadvise(target, "cache", "import", str(exported)).returncode == 0
    done = mpadvise(target, "cache", "import", str(exported), "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["renumbered"] == []
    assert _ids(target) == {"a1" * 8: 1, "b2" * 8: 2, "c3" * 8: 3}
