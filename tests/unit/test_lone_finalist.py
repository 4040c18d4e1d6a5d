"""The speed-up a worker caches rests on its own side-by-side runs, never on another's figure.

A study shared by many workers (or resumed) hands each worker results it did not measure. A
winner known only from such a result is run here beside this machine's fp32 before anything
is cached, even as a lone finalist, even when the time budget was spent before
re-measurement. Fake runners (milliseconds); a real SQLite study file stands for the shared
storage.
"""

from __future__ import annotations

import itertools

import pytest
from test_search import FakeRunner, tune

from advisor.tune._engine import LOCAL_PAIRS
from advisor.tune._space import Candidate

FAST_NODE = {"fp32": 100, "bf16-mixed": 3}  # the node that measured bf16 first: 33x
THIS_NODE = {"fp32": 100, "bf16-mixed": 90}  # this node: bf16 only 1.11x faster


def _study_measured_elsewhere(tmp_path, name: str) -> str:
    """A study whose bf16 results another node measured (without re-measuring anything)."""
    storage = f"sqlite:///{tmp_path / name}"
    other = tune(FakeRunner(FAST_NODE), storage=storage, study_name="s", no_priors=True, modes=("bf16-mixed",),
                 remeasure=False)
    assert other.speedup.ratio == pytest.approx(100 / 3, rel=1e-3)
    return storage


def test_a_winner_measured_elsewhere_is_paired_here_before_it_is_cached(tmp_path):
    storage = _study_measured_elsewhere(tmp_path, "lone.db")
    here = FakeRunner(THIS_NODE)
    ticks = itertools.count(0, 50)  # the time budget is spent before re-measurement could start
    result = tune(here, storage=storage, study_name="s", resume=True, no_priors=True, modes=("bf16-mixed",),
                  time_budget=60, clock=lambda: next(ticks))
    assert result.search.runs == 0 and result.search.resumed > 0  # every figure but fp32's came from the study
    assert result.winner == Candidate("bf16-mixed")
    # Before, this was 33.33x: the other node's bf16 over this node's fp32, "single runs".
    assert result.speedup.pairs >= LOCAL_PAIRS and result.speedup.basis.startswith("paired re-measurement")
    assert result.speedup.ratio == pytest.approx(100 / 90, rel=1e-3)
    assert result.policy.tuned_on.speedup_vs_fp32 == pytest.approx(100 / 90, rel=1e-3)
    assert sum("bf16-mixed (re-measure" in label for label in here.labels) == LOCAL_PAIRS
    assert sum(label.startswith("fp32 (re-measure") for label in here.labels) == LOCAL_PAIRS
    # The goodput cached is this node's too.
    winner = next(f for f in result.finalists if f.candidate == result.winner)
    assert result.policy.tuned_on.goodput == pytest.approx(winner.remeasured_goodput, rel=1e-3)
    assert result.policy.tuned_on.goodput < 2 * result.reference.goodput


def test_a_winner_measured_elsewhere_that_is_unstable_here_is_not_cached(tmp_path):
    storage = _study_measured_elsewhere(tmp_path, "unstable.db")
    here = FakeRunner(THIS_NODE, unstable={"bf16-mixed"})
    ticks = itertools.count(0, 50)
    result = tune(here, storage=storage, study_name="s", resume=True, no_priors=True, modes=("bf16-mixed",),
                  time_budget=60, clock=lambda: next(ticks))
    assert result.winner is None or result.winner.mode == "fp32"
    assert any(m.candidate.mode == "bf16-mixed" for m in result.dropped)


def test_a_winner_this_worker_paired_needs_no_more_rounds(tmp_path):
    runner = FakeRunner(THIS_NODE)
    result = tune(runner, storage=f"sqlite:///{tmp_path / 'own.db'}", study_name="s", no_priors=True,
                  modes=("bf16-mixed",))
    assert result.speedup.pairs >= LOCAL_PAIRS
    assert result.speedup.ratio == pytest.approx(100 / 90, rel=1e-3)
