"""The search's priors and its stored study, against the fake runner: which untried candidates
a measured failure rules out, and what a resumed study remembers of pruned ones."""

from __future__ import annotations

import dataclasses
import functools
import shutil

import pytest
from rich.console import Console
from test_search import RATIOS, FakeRunner, tune

from advisor.cli._report import render_tune
from advisor.trial import TrialResult
from advisor.tune._space import Candidate, Measured, upper_bound
from policies import Policy

# The whole report (mpadvise tune --verbose): it holds every figure these tests read.
render_verbose = functools.partial(render_tune, verbose=True)

BOUND_KW = {"user_batch": 64, "reference_goodput": 100.0, "dtype_ratio": RATIOS}
RATIO_BOUND = 100 * 12 * 1.25  # an unmeasured 16-bit mode: its matmul ratio, with slack


class ScaleSkipRunner(FakeRunner):
    """fp16-mixed overflows and skips every step after calibration when its loss scale starts
    at 2^12 or more; a lower scale runs clean."""

    def __call__(self, policy: Policy, label: str) -> TrialResult:
        result = super().__call__(policy, label)
        scale = policy.loss_scale.init_scale if policy.loss_scale else None
        if scale is None or scale < 2.0**12:
            return result
        return dataclasses.replace(result, skipped=tuple(i >= 8 for i in range(len(result.skipped))))


class SplitCuresRunner(FakeRunner):
    """bf16-true diverges at the script's batch of 64 and trains fine at 32 (BatchNorm over a
    smaller micro-batch, or a backward that no longer overflows)."""

    def __call__(self, policy: Policy, label: str) -> TrialResult:
        result = super().__call__(policy, label)
        if policy.mode != "bf16-true" or policy.micro_batch_size is not None:
            return result
        return dataclasses.replace(result, losses=result.losses[:10] + (float("nan"),) * (len(result.losses) - 10))


def test_ceiling_counts_only_stable_runs():
    # A run that skipped most of its steps has a low goodput; another loss scale that does not
    # skip is not bounded by it.
    skipping = Candidate("fp16-mixed", None, "dynamic", 65536.0, 2000)
    measured = {
        Candidate("fp32"): Measured(Candidate("fp32"), 100.0, True, True),
        skipping: Measured(skipping, 50.0, True, False, outcome="unstable"),
    }
    other_scale = Candidate("fp16-mixed", None, "static", 256.0)
    assert upper_bound(other_scale, measured, **BOUND_KW) == pytest.approx(RATIO_BOUND)


def test_search_finds_the_loss_scale_that_does_not_skip():
    # The default scale 2^16 skips (goodput below bf16-mixed's); static 2^8 is the fastest policy.
    runner = ScaleSkipRunner({"fp32": 100, "tf32": 40, "bf16-mixed": 20, "fp16-mixed": 10, "bf16-true": 30,
                              "fp16-true": 30})
    result = tune(runner, remeasure=False)
    assert result.winner.mode == "fp16-mixed" and result.winner.init_scale < 2.0**12


@pytest.mark.parametrize(("kind", "split_bound"), [
    ("diverged", RATIO_BOUND), ("skips", RATIO_BOUND), ("scale_collapse", RATIO_BOUND),
    ("stalled", 0.0), ("underflow", 0.0),
])
def test_a_split_rules_out_only_what_a_split_cannot_cure(kind, split_bound):
    full = Candidate("bf16-true")
    measured = {
        Candidate("fp32"): Measured(Candidate("fp32"), 100.0, True, True),
        full: Measured(full, 900.0, True, False, outcome="unstable", verdict_kind=kind),
    }
    assert upper_bound(Candidate("bf16-true", 32), measured, **BOUND_KW) == pytest.approx(split_bound)


def test_search_tries_a_split_of_a_diverged_mode():
    runner = SplitCuresRunner({"fp32": 100, "bf16-mixed": 20, "bf16-true": 15})
    result = tune(runner, remeasure=False, modes=["fp32", "bf16-mixed", "bf16-true"])
    assert result.winner.mode == "bf16-true" and result.winner.micro_batch in (16, 32)


# fp16-mixed at a low loss scale is the fastest policy: the priors prune what cannot beat it.
SPEEDS = {"fp32": 100, "tf32": 40, "bf16-mixed": 20, "fp16-mixed": 10, "bf16-true": 30, "fp16-true": 30}


@pytest.fixture(scope="module")
def _pruned_once(tmp_path_factory):
    """A stored study whose priors pruned proposals, tuned once for this module's tests."""
    path = tmp_path_factory.mktemp("pruned") / "study.db"
    result = tune(ScaleSkipRunner(SPEEDS), storage=f"sqlite:///{path}", study_name="p", remeasure=False, trials=30)
    assert result.search.pruned, "the priors pruned nothing: the test needs a pruned proposal"
    return path, result


def _pruned_study(tmp_path, pruned_once):
    """A copy of that study for one test to resume, and the first tune's result."""
    path, result = pruned_once
    shutil.copy(path, tmp_path / "study.db")
    return f"sqlite:///{tmp_path / 'study.db'}", result


def test_resume_keeps_pruned_candidates_unmeasured(tmp_path, _pruned_once):
    # --resume --no-priors must run what the priors pruned, not take it for a measured failure.
    storage, before = _pruned_study(tmp_path, _pruned_once)
    second = ScaleSkipRunner(SPEEDS)
    after = tune(second, storage=storage, study_name="p", resume=True, no_priors=True, remeasure=False, trials=60)
    assert after.search.resumed == len(before.search.measured) - 1  # the reference is run again, not resumed
    assert not after.search.pruned
    for cand in before.search.pruned:
        assert cand.label in second.labels, f"{cand.label} was pruned, and never run on --no-priors"
        assert after.search.measured[cand].outcome == "ok"


def test_resumed_pruned_candidates_say_pruned(tmp_path, _pruned_once):
    storage, before = _pruned_study(tmp_path, _pruned_once)
    after = tune(ScaleSkipRunner(SPEEDS), storage=storage, study_name="p", resume=True, remeasure=False, trials=30)
    data = after.to_dict()
    assert {row["outcome"] for row in data["candidates"]} <= {"ok", "unstable"}
    assert all(row["goodput"] > 0 for row in data["candidates"])
    pruned = {row["label"]: row for row in data["pruned"]}
    assert set(before.search.pruned) <= {c for c in after.search.pruned}
    assert set(pruned) == {c.label for c in after.search.pruned}
    assert all(row["outcome"] == "pruned" and row["reason"].startswith("not run") for row in pruned.values())
    console = Console(record=True, width=200)
    render_verbose(data, console)
    text = console.export_text()
    for label in pruned:
        line = next(ln for ln in text.splitlines() if f" {label} " in ln)
        assert "pruned" in line and " ok" not in line, line
