"""scripts/bench_agreement.py's order of measurements and its pooling of recorded runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "bench_agreement.py"


@pytest.fixture
def bench(load_bench):
    return load_bench("bench_agreement")


def test_each_round_runs_one_of_each_kind_in_a_rotating_order(bench):
    order = bench.schedule({"startup_free": 3, "trial": 3, "tune": 3})
    assert order == [
        ("startup_free", 0), ("trial", 0), ("tune", 0),
        ("trial", 1), ("tune", 1), ("startup_free", 1),
        ("tune", 2), ("startup_free", 2), ("trial", 2),
    ]


def test_a_kind_with_fewer_runs_drops_out_of_the_later_rounds(bench):
    order = bench.schedule({"startup_free": 1, "trial": 2, "tune": 4})
    assert sorted(order) == sorted([("startup_free", 0), ("trial", 0), ("trial", 1),
                                    ("tune", 0), ("tune", 1), ("tune", 2), ("tune", 3)])
    assert order[-2:] == [("tune", 2), ("tune", 3)]
    assert bench.schedule({"startup_free": 0, "trial": 0, "tune": 0}) == []


def _record(truth, trials, tunes, *, mode="bf16-mixed", script="examples/accelerate_mlp.py"):
    return {"script": script, "args": ["--width", "4096"], "mode": mode, "startup_free": truth, "trial": trials,
            "tunes": [{"winner": w, "ratio": r} for w, r in tunes]}


def test_pooled_runs_compare_every_tune_with_the_medians_of_all_runs(bench):
    # One run's references alone put two of its tunes off by more than 10%; pooled, none is.
    first = _record([1.10, 1.12, 1.45], [1.48, 1.11, 1.40], [("bf16-mixed", 1.30), ("bf16-mixed", 1.24)])
    second = _record([1.30, 1.28, 1.33], [1.30, 1.27, 1.32], [("bf16-mixed", 1.33), ("fp32", 1.25)])
    found = bench.pooled([first, second])
    assert found["startup_free"]["n"] == 6 and found["trial"]["n"] == 6
    assert found["startup_free"]["median"] == pytest.approx((1.28 + 1.30) / 2)
    assert found["trial"]["median"] == pytest.approx((1.30 + 1.32) / 2)
    assert found["tune"] == pytest.approx({"n": 4, "median": (1.25 + 1.30) / 2, "scatter": found["tune"]["scatter"],
                                           "picked_mode": 3, "within_startup_free": 4, "within_trial": 4})
    alone = bench.pooled([first])
    assert alone["tune"]["within_startup_free"] == 0  # median 1.12: 1.30 and 1.24 are 16% and 11% above it


def test_scatter_is_the_median_absolute_deviation_of_the_log_ratios(bench):
    import math

    assert bench.log_scatter([1.0, 2.0, 4.0]) == pytest.approx(math.log(2))
    assert bench.log_scatter([1.3, 1.3]) == 0.0
    assert bench.log_scatter([]) is None


def test_runs_of_different_scripts_or_modes_are_not_pooled(bench):
    with pytest.raises(ValueError, match="different things"):
        bench.pooled([_record([1.2], [1.2], [("bf16-mixed", 1.2)]),
                      _record([1.2], [1.2], [("bf16-true", 1.2)], mode="bf16-true")])


def test_pool_on_the_command_line_reads_files_and_refuses_bad_ones_in_one_line(tmp_path):
    good = tmp_path / "a.json"
    good.write_text(json.dumps(_record([1.25, 1.3], [1.28], [("bf16-mixed", 1.31)])))
    ok = subprocess.run([sys.executable, str(SCRIPT), "--pool", str(good)], capture_output=True, text=True,
                        cwd=ROOT, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert "tunes that picked bf16-mixed: 1 of 1" in ok.stdout
    bad = tmp_path / "b.json"
    bad.write_text("{}")
    for path in (bad, tmp_path / "missing.json"):
        out = subprocess.run([sys.executable, str(SCRIPT), "--pool", str(path)], capture_output=True, text=True,
                             cwd=ROOT, timeout=120)
        assert out.returncode != 0
        assert out.stderr.strip().startswith("--pool:") and len(out.stderr.strip().splitlines()) == 1, out.stderr
