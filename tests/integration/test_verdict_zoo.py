"""The cheap half of the verdict zoo (tests/verdicts): every short-trial verdict must match the
truth that long runs established (tests/verdicts/truth.json), through the same code as
scripts/bench_verdicts.py."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ZOO = Path(__file__).resolve().parents[1] / "verdicts" / "zoo.py"
_spec = importlib.util.spec_from_file_location("verdict_zoo", ZOO)
zoo = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = zoo  # dataclasses look their module up
_spec.loader.exec_module(zoo)

CHEAP = zoo.select(zoo.load_cases(), cheap=True)


def test_every_case_has_a_clear_recorded_truth_that_the_manifest_expects():
    truth = zoo.load_truth()
    for case in zoo.load_cases():
        for mode, expected in case.modes.items():
            record = truth[case.name][mode]
            assert record["truth"] == expected, (case.name, mode, record["reason"])
            assert record["clear"], (case.name, mode, record["reason"])


def test_truth_rule_on_made_up_curves():
    falling = [1.0 - 0.009 * i for i in range(100)]
    assert zoo.truth_of(falling, falling).truth == "stable"
    assert zoo.truth_of(falling, [1.0] * 100).truth == "unstable"  # no fall: a stall
    assert zoo.truth_of(falling, falling[:50] + [float("nan")] * 50).truth == "unstable"
    assert zoo.truth_of(falling, [v * 2 for v in falling]).truth == "unstable"  # ends twice as high


@pytest.mark.slow
@pytest.mark.parametrize("case", CHEAP, ids=[c.name for c in CHEAP])
def test_cheap_case_verdicts_match_the_truth(case, isolated_home):
    scored, run = zoo.score_case(case, zoo.load_truth())
    wrong = [f"{s.mode}: truth {s.truth}, verdict {s.verdict} ({s.reason})" for s in scored if s.verdict != s.truth]
    assert not wrong, f"{case.name}: " + "; ".join(wrong)
