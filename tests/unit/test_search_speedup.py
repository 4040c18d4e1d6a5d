"""One speed-up figure per tune: what it prints (``--json`` and the report), writes (the config
file) and caches for its winner is the same number, the paired re-measurement against fp32.
And the tune's other promises around it: a resumed study of a changed workload is not reused,
and a script that already calls ``load_policy()`` is not told to add it."""

from __future__ import annotations

import dataclasses
import functools
import io
import json
import logging

import optuna
import pytest
from rich.console import Console
from test_search import GPU, FakeRunner, tune
from test_search_decisions import SHARED_CPU_MLP, NoisyRunner
from test_search_remeasure import MODES, ScriptedRunner

from advisor._log import get_logger
from advisor.cache._store import open_store
from advisor.cli._report import render_tune
from advisor.trial import TrialResult
from advisor.tune import _study_status
from advisor.tune._confirm import Finalist, paired
from advisor.tune._options import TuneOptions
from advisor.tune._service import calls_load_policy, keep_answer
from advisor.tune._space import Candidate
from advisor.tune._study import STUDY_ATTR_WORKLOAD
from advisor.tune._study_status import check_study_workload, kept_study
from advisor.tune._timing import paired_gap
from policies import Policy, load_config
from probes import MpadviseError, UsageError

# The whole report (mpadvise tune --verbose): it holds every figure these tests read.
render_verbose = functools.partial(render_tune, verbose=True)


def _tune_noisy(seed: int = 3):
    """A tune on a noisy machine, where the search's single runs and the paired rounds differ."""
    runner = NoisyRunner(SHARED_CPU_MLP, seed=seed, slow_search={"bf16-true": 1.19})
    return tune(runner, remeasure=True, modes=MODES)


def test_every_figure_of_the_winners_speed_up_is_the_same_number(tmp_path, cache_home):
    result = _tune_noisy()
    assert result.winner is not None and result.winner.mode != "fp32"
    script = tmp_path / "train.py"
    script.write_text("print('train')\n")
    options = TuneOptions(modes=MODES)
    written, cache_id = keep_answer(result, options, GPU, script, [])
    payload = result.to_dict()
    payload.update(script=str(script), args=[], framework=None, config_file=str(written), cache_id=cache_id,
                   storage=None, study_name="s", hardware={"name": GPU.name})
    data = json.loads(json.dumps(payload, default=str))  # as --json prints it

    # The figure: the paired gap of the winner over fp32, over the rounds both ran.
    best = next(f for f in result.finalists if f.candidate == result.winner)
    pairs = [(w, r) for w, r in zip(best.rounds, result.reference_rounds) if w is not None and r is not None]
    gap = paired_gap([w for w, _ in pairs], [r for _, r in pairs])
    figure = round(gap.ratio, 4)
    assert len(pairs) >= 2 and figure == round(paired(best, _fp32(result)).ratio, 4)
    interval = (round(gap.low, 4), round(gap.high, 4), f"paired re-measurement, {len(pairs)} pairs")

    # --json
    winner_row = next(row for row in data["candidates"] if row["winner"])
    assert data["speedup_vs_fp32"] == data["speedup"]["ratio"] == winner_row["speedup_vs_fp32"] == figure
    assert (data["speedup"]["low"], data["speedup"]["high"], data["speedup"]["basis"]) == interval
    assert winner_row["speedup_basis"] == interval[2]
    # The search's single run is there too, but labelled as such (and here it differs).
    assert winner_row["search_speedup_vs_fp32"] != pytest.approx(figure, abs=5e-3)
    assert all(row["speedup_basis"] == "search run" for row in data["candidates"] if not row["winner"])

    # The config file
    tuned = load_config(written).tuned_on
    assert tuned.speedup_vs_fp32 == figure
    assert (tuned.speedup_low, tuned.speedup_high, tuned.speedup_basis) == interval

    # The cache
    store = open_store()
    with store:
        (row,) = store.find_recommendations(with_trials=True)
    assert row["id"] == cache_id and row["speedup_vs_fp32"] == figure
    cached = Policy.from_dict(row["policy"]).tuned_on
    assert cached.speedup_vs_fp32 == figure
    assert (cached.speedup_low, cached.speedup_high, cached.speedup_basis) == interval
    metrics = next(t["metrics"] for t in row["trials"] if t["metrics"]["label"] == result.winner.label)
    assert metrics["speedup_ratio"] == figure
    assert (metrics["speedup_low"], metrics["speedup_high"], metrics["speedup_basis"]) == interval

    # The rendered report: the winner line and the winner's row show it, and nothing else
    # shows another number as the winner's speed-up.
    console = Console(record=True, width=300, file=io.StringIO())
    render_verbose(data, console)
    text = console.export_text()
    shown = f"{figure:.2f}x"
    winner_line = next(ln for ln in text.splitlines() if ln.startswith("winner: "))
    assert f", {shown} fp32 goodput (paired re-measurement, {len(pairs)} pairs, 95% interval " in winner_line
    assert f"{interval[0]:.2f}x to {interval[1]:.2f}x" in winner_line
    table_row = next(ln for ln in text.splitlines() if ln.lstrip("│ ").startswith("→"))
    assert f"{shown}†" in table_row
    assert f"{winner_row['search_speedup_vs_fp32']:.2f}x" not in table_row
    assert "one search run" in text and "† the winner's speed-up: " in text


def _fp32(result):
    """fp32 as re-measured alongside (``reference_rounds``), as a finalist."""
    ref = Candidate("fp32", result.space.user_batch)
    return Finalist(result.space.normalise(ref), [], [], rounds=list(result.reference_rounds))


def test_the_gap_line_and_the_winner_line_agree_when_the_decisive_gap_is_against_fp32():
    # The bundled demo's case: bf16-true's search run fell inside fp32's band, so fp32 is a
    # finalist and the decisive gap is the speed-up itself; the two lines once said 1.26x and
    # 1.01x.
    runner = ScriptedRunner({"fp32": 100, "bf16-mixed": 300, "bf16-true": 99},
                            {"fp32": [100, 104, 98, 101], "bf16-true": [80, 81, 79, 80]})
    result = tune(runner, modes=MODES, remeasure=True)
    data = json.loads(json.dumps(result.to_dict(), default=str))
    assert result.winner.mode == "bf16-true" and data["gap"]["between"] == ["bf16-true", "fp32"]
    assert round(data["gap"]["ratio"], 4) == data["speedup_vs_fp32"] == data["speedup"]["ratio"]
    assert (round(data["gap"]["low"], 4), round(data["gap"]["high"], 4)) == (data["speedup"]["low"], data["speedup"]["high"])
    console = Console(record=True, width=300, file=io.StringIO())
    render_verbose(data, console)
    lines = console.export_text().splitlines()
    shown = f"{data['speedup_vs_fp32']:.2f}x"
    assert f"bf16-true runs {shown} the goodput of fp32" in next(ln for ln in lines if ln.startswith("gap: "))
    assert f", {shown} fp32 goodput" in next(ln for ln in lines if ln.startswith("winner: "))


# --- --resume and a changed workload ----------------------------------------------------------


class ModelRunner(FakeRunner):
    """FakeRunner whose script built another model: its own fingerprint and signature."""

    def __init__(self, step_ms, *, signature: str, **kwargs):
        super().__init__(step_ms, **kwargs)
        self.signature = signature

    def __call__(self, policy: Policy, label: str) -> TrialResult:
        result = super().__call__(policy, label)
        return dataclasses.replace(result, model_signature=self.signature, workload_fingerprint=self.signature[::-1])


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


SPEEDS = {"fp32": 100, "tf32": 40, "bf16-mixed": 20, "fp16-mixed": 21, "bf16-true": 15, "fp16-true": 14,
          "fp8-torchao": 30}


def test_resume_of_a_changed_workload_refuses_and_keeps_the_study(tmp_path):
    # The script read another config file: same study name, another model. Long ago, --resume
    # took the old verdicts with 0 new trials and stamped the new model's fingerprint on them;
    # then it deleted them with a warning and started afresh. Now they are kept.
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    first = ModelRunner(SPEEDS, signature="12" * 8)
    tune(first, storage=storage, study_name="s", no_priors=True, remeasure=False, trials=6)
    before = kept_study(storage, "s")
    assert before is not None and before.finished >= 1
    second = ModelRunner(SPEEDS, signature="34" * 8)
    with pytest.raises(UsageError) as refused:
        tune(second, storage=storage, study_name="s", resume=True, no_priors=True, remeasure=False, trials=6)
    line = str(refused.value)
    assert line.startswith(f"--resume: study 's' in {storage!r} holds {before.finished} finished trials"), line
    assert f"the model changed: signature {'12' * 6} then, {'34' * 6} now" in line
    assert "it is kept: pass --fresh to delete it" in line and "\n" not in line
    assert len(second.calls) == 1  # only the reference, which tells the workload
    assert kept_study(storage, "s") == before
    stored = optuna.load_study(study_name="s", storage=storage).user_attrs[STUDY_ATTR_WORKLOAD]
    assert stored["model_signature"] == "12" * 8


def test_resume_of_a_changed_workload_without_finished_trials_starts_afresh(tmp_path):
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    study = optuna.create_study(study_name="s", storage=storage, direction="maximize")
    study.set_user_attr(STUDY_ATTR_WORKLOAD, {"workload_fingerprint": "ab" * 8, "model_signature": "12" * 8})
    lines = _Lines()
    get_logger().addHandler(lines)
    try:
        second = ModelRunner(SPEEDS, signature="34" * 8)
        result = tune(second, storage=storage, study_name="s", resume=True, no_priors=True, remeasure=False, trials=6)
    finally:
        get_logger().removeHandler(lines)
    assert result.search.resumed == 0 and result.search.runs == 6
    assert len(second.calls) == 7  # the reference and six trials
    warned = [ln for ln in lines.lines if ln.startswith("--resume: ")]
    assert len(warned) == 1, lines.lines
    assert f"the model changed: signature {'12' * 6} then, {'34' * 6} now" in warned[0]
    assert "a fresh study starts" in warned[0]
    assert result.policy.tuned_on.model_signature == "34" * 8
    stored = optuna.load_study(study_name="s", storage=storage).user_attrs[STUDY_ATTR_WORKLOAD]
    assert stored == {"workload_fingerprint": ("34" * 8)[::-1], "model_signature": "34" * 8}


def test_resume_of_the_same_workload_still_reuses_the_study(tmp_path):
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    first = ModelRunner(SPEEDS, signature="12" * 8, interrupt_after=4)
    with pytest.raises(KeyboardInterrupt):
        tune(first, storage=storage, study_name="s", no_priors=True, remeasure=False, trials=6)
    second = ModelRunner(SPEEDS, signature="12" * 8)
    result = tune(second, storage=storage, study_name="s", resume=True, no_priors=True, remeasure=False, trials=6)
    assert result.search.resumed == 3  # the three trials after the reference


def test_a_shared_study_of_another_workload_is_refused(tmp_path, monkeypatch):
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    study = optuna.create_study(study_name="s", storage=storage, direction="maximize")
    study.set_user_attr(STUDY_ATTR_WORKLOAD, {"workload_fingerprint": "ab" * 8, "model_signature": "12" * 8})
    monkeypatch.setattr(_study_status, "shared_storage", lambda url: url is not None)  # as a database server's
    with pytest.raises(MpadviseError, match="every worker of a shared study must run the same workload"):
        check_study_workload(storage, "s", {"workload_fingerprint": "ab" * 8, "model_signature": "34" * 8},
                             resume=False)
    assert check_study_workload(storage, "s", {"workload_fingerprint": "ab" * 8, "model_signature": "12" * 8},
                                resume=False) is False


# --- the line the report asks the script to add ---------------------------------------------


@pytest.mark.parametrize(
    ("source", "calls"),
    [
        ("import advisor\nmp = advisor.load_policy()\n", True),
        ("from advisor import load_policy\nwith load_policy() as mp:\n    pass\n", True),
        ("import advisor as a\nmp = a.load_policy('x.toml')\n", True),
        ("import advisor\n# mp = advisor.load_policy()\nprint('load_policy')\n", False),
        ("import torch\n", False),
        ("def broken(:\n", False),
    ],
)
def test_a_call_to_load_policy_is_read_from_the_source(tmp_path, source, calls):
    script = tmp_path / "train.py"
    script.write_text(source)
    assert calls_load_policy(script) is calls


def test_a_script_that_calls_load_policy_is_not_told_to_add_it():
    result = tune(FakeRunner(SPEEDS), remeasure=False)
    data = json.loads(json.dumps(result.to_dict(), default=str))
    for calls, expected, absent in ((True, "the script calls advisor.load_policy()", "add to the script"),
                                    (False, "add to the script: mp = advisor.load_policy()", "the script calls")):
        console = Console(record=True, width=300, file=io.StringIO())
        render_verbose({**data, "calls_load_policy": calls}, console)
        text = console.export_text()
        assert expected in text and absent not in text
