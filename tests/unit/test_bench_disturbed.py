"""scripts/bench_disturbed.py's comparison of several disturbed and undisturbed tunes."""

from __future__ import annotations

import pytest


@pytest.fixture
def bench(load_bench):
    return load_bench("bench_disturbed")


def _tune(winner, ratio, low, high):
    return {"winner_label": winner, "speedup": {"ratio": ratio, "low": low, "high": high}}


def test_a_speed_up_is_inside_an_interval_only_when_both_have_figures(bench):
    assert bench.inside(_tune("bf16-true", 1.2, 1.0, 1.5), _tune("bf16-true", 1.3, 1.1, 1.4)) is True
    assert bench.inside(_tune("bf16-true", 1.5, 1.3, 1.8), _tune("bf16-true", 1.3, 1.1, 1.4)) is False
    assert bench.inside(_tune("bf16-true", 1.2, 1.0, 1.5), _tune("fp32", 1.0, None, None)) is None
    assert bench.inside({"winner_label": None, "speedup": None}, _tune("bf16-true", 1.3, 1.1, 1.4)) is None


def test_rounds_compare_every_disturbed_tune_with_every_undisturbed_one_and_the_controls_among_themselves(bench):
    rounds = [
        {"undisturbed": _tune("bf16-true", 1.20, 1.10, 1.30), "disturbed": _tune("bf16-true", 1.25, 1.15, 1.35)},
        {"undisturbed": _tune("bf16-mixed", 1.40, 1.30, 1.50), "disturbed": _tune("bf16-true", 1.45, 1.20, 1.70)},
        {"undisturbed": _tune("bf16-true", 1.26, 1.00, 1.60), "disturbed": _tune("bf16-true", 1.70, 1.50, 1.90)},
    ]
    summary = bench.rounds_summary(rounds)
    # disturbed 1.25: inside #1 and #3; 1.45: inside #2 and #3; 1.70: inside none
    assert summary["disturbed_inside_undisturbed"] == (4, 9)
    # undisturbed 1.20 in #3; 1.40 in #3; 1.26 in #1: never compared with itself
    assert summary["undisturbed_inside_undisturbed"] == (3, 6)
    assert summary["winners"] == {"undisturbed": ["bf16-true", "bf16-mixed", "bf16-true"],
                                  "disturbed": ["bf16-true", "bf16-true", "bf16-true"]}


def test_rounds_count_the_speed_ups_measured_on_fewer_threads(bench):
    one_thread = {**_tune("bf16-true", 1.4, 1.3, 1.5), "speedup": {"ratio": 1.4, "low": 1.3, "high": 1.5, "threads": 1}}
    rounds = [
        {"undisturbed": _tune("bf16-true", 1.2, 1.1, 1.3), "disturbed": one_thread},
        {"undisturbed": _tune("bf16-true", 1.2, 1.1, 1.3), "disturbed": _tune("bf16-true", 1.25, 1.1, 1.4)},
        {"undisturbed": _tune("fp32", 1.0, None, None), "disturbed": {"winner_label": "fp32", "speedup": None}},
    ]
    assert bench.rounds_summary(rounds)["on_fewer_threads"] == {"undisturbed": 0, "disturbed": 1}


def test_a_neighbour_busy_part_of_each_second_sleeps_the_rest(bench):
    assert bench.neighbour_code(1.0) == "while True: pass"
    code = bench.neighbour_code(0.15)
    compile(code, "neighbour", "exec")
    assert "< 0.15" in code and "time.sleep(0.85)" in code
