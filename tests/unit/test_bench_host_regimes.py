"""scripts/bench_host_regimes.py's reading of the CPUs and its summary of side-by-side windows."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def bench(load_bench, monkeypatch):
    # Run as a script, it finds bench_agreement (its machine record) beside it, in scripts/.
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "scripts"))
    return load_bench("bench_host_regimes")


def _window(ms, cpu_per_wall=2.0, idle=0.0, steal=0.0):
    return {"median_ms": ms, "cpu_per_wall": cpu_per_wall, "idle": idle, "steal": steal}


def test_the_cpus_ticks_add_up(bench):
    ticks = bench.cpu_ticks()
    assert ticks["total"] > 0
    assert 0 <= ticks["idle"] <= ticks["total"] and 0 <= ticks["steal"] <= ticks["total"]


def test_a_spell_that_slows_fp32_more_shows_in_the_ratio_and_what_the_cpus_did_shows_beside_it(bench):
    rows = [
        {"fp32": _window(3.0), "bf16": _window(2.0), "ratio": 1.5},
        {"fp32": _window(4.8, cpu_per_wall=1.98), "bf16": _window(2.6, steal=0.01), "ratio": 4.8 / 2.6},
        {"fp32": _window(3.1), "bf16": _window(2.0, idle=0.02), "ratio": 1.55},
    ]
    summary = bench.summary(rows)
    assert summary["fp32_ms"] == [3.0, 3.1, 4.8]
    assert summary["bf16_ms"] == [2.0, 2.0, 2.6]
    assert summary["ratio"] == [1.5, 1.55, 4.8 / 2.6]
    assert summary["fp32_max_over_min"] == 1.6
    assert summary["ratio_max_over_min"] == pytest.approx(4.8 / 2.6 / 1.5, abs=1e-3)
    assert summary["cpu_per_wall"] == [1.98, 2.0]
    assert summary["idle_max"] == 0.02 and summary["steal_max"] == 0.01


def test_a_window_times_its_steps_and_reads_the_process_and_the_cpus(bench):
    class Arm:
        def step(self):
            return 0.002

    w = bench.window(Arm(), 5)
    assert w["median_ms"] == 2.0
    assert w["cpu_per_wall"] >= 0 and 0 <= w["idle"] <= 1 and 0 <= w["steal"] <= 1


@pytest.mark.parametrize("args, line", [
    (["--threads", "two"], "--threads must be whole numbers separated by commas, got 'two'"),
    (["--threads", "0"], "--threads must name at least one count, each at least 1"),
    (["--pairs", "0"], "--pairs must be at least 1"),
])
def test_bad_arguments_end_in_one_line(bench, monkeypatch, args, line):
    monkeypatch.setattr("sys.argv", ["bench_host_regimes.py", *args])
    with pytest.raises(SystemExit) as exc:
        bench.main()
    assert str(exc.value) == line
