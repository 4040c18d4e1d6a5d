"""One study shared by many workers: study names, storage URLs and settings, and the search's
claims, waits and retries against a real SQLite study, with a fake runner and a fake sleep."""

from __future__ import annotations

import optuna
import pytest

from advisor.tune import study_name_for
from advisor.tune._options import TuneOptions
from advisor.tune._search import run_search
from advisor.tune._space import Candidate, Measured, SearchSpace
from advisor.tune._storage import (
    GRACE_ENV,
    HEARTBEAT_ENV,
    MAX_RETRY_ENV,
    Heartbeat,
    shared_storage,
    shown_url,
    storage_error,
    storage_url,
)
from advisor.tune._study import (
    STUDY_ATTR_HARDWARE,
    TRIAL_ATTR_CLAIM,
    TRIAL_ATTR_CLOSED,
    TRIAL_ATTR_RESULT,
    candidate_to,
    measured_from,
    measured_to,
)
from advisor.tune._study_status import check_study
from probes import MpadviseError

FP32 = Candidate("fp32")
BF16 = Candidate("bf16-mixed")
PURE = Candidate("bf16-true")
# Three candidates: the script's own batch, no split (what a framework without accumulation gets).
SPACE = SearchSpace(("fp32", "bf16-mixed", "bf16-true"), (64,), 64)
OTHER = "other-node:4242"


# --- names, URLs, settings ------------------------------------------------------------------


def test_the_study_name_ignores_where_the_checkout_lies(tmp_path):
    one, two = tmp_path / "one" / "train.py", tmp_path / "two" / "train.py"
    for path in (one, two):
        path.parent.mkdir()
        path.write_text("print('train')\n")
    assert study_name_for(one, ["--epochs", "1"], "ab" * 8) == study_name_for(two, ["--epochs", "1"], "ab" * 8)


def test_the_study_name_changes_with_content_arguments_name_and_hardware(tmp_path):
    def script(name: str, content: str):
        path = tmp_path / content / name
        path.parent.mkdir(exist_ok=True)
        path.write_text(f"print({content!r})\n")
        return path

    base = study_name_for(script("train.py", "a"), ["--lr", "3e-4"], "ab" * 8)
    assert base.startswith(f"train-{'ab' * 8}-")
    others = {
        study_name_for(script("train.py", "b"), ["--lr", "3e-4"], "ab" * 8),
        study_name_for(script("train.py", "a"), ["--lr", "1e-3"], "ab" * 8),
        study_name_for(script("main.py", "a"), ["--lr", "3e-4"], "ab" * 8),
        study_name_for(script("train.py", "a"), ["--lr", "3e-4"], "cd" * 8),
    }
    assert base not in others and len(others) == 4


@pytest.mark.parametrize(
    ("given", "opened"),
    [
        ("postgresql://u@db:5432/studies", "postgresql+psycopg://u@db:5432/studies"),
        ("postgres://u@db/studies", "postgresql+psycopg://u@db/studies"),
        ("postgresql+psycopg2://u@db/studies", "postgresql+psycopg2://u@db/studies"),
        ("sqlite:///tmp/studies.db", "sqlite:///tmp/studies.db"),
        ("mysql+pymysql://u@db/studies", "mysql+pymysql://u@db/studies"),
    ],
)
def test_a_postgresql_url_without_a_driver_uses_psycopg(given, opened):
    assert storage_url(given) == opened


def test_only_a_database_server_shares_studies():
    assert shared_storage("postgresql://u@db/studies") and shared_storage("mysql://u@db/studies")
    assert not shared_storage("sqlite:///tmp/studies.db") and not shared_storage(None)


def test_passwords_never_reach_a_message():
    assert shown_url("postgresql://tuner:s3cret@db:5432/studies") == "postgresql://tuner:***@db:5432/studies"
    assert shown_url("postgresql://tuner@db:5432/studies") == "postgresql://tuner@db:5432/studies"
    assert shown_url("sqlite:///tmp/a:b@c.db") == "sqlite:///tmp/a:b@c.db"
    message = storage_error("postgresql://tuner:s3cret@db/studies", ConnectionRefusedError("connection refused"))
    assert "s3cret" not in message and "connection refused" in message


def test_a_missing_driver_names_the_extra_that_installs_it():
    try:
        try:
            raise ModuleNotFoundError("No module named 'psycopg'", name="psycopg")
        except ImportError as inner:
            raise ImportError("Failed to import DB access module for the specified storage URL.") from inner
    except ImportError as exc:
        message = storage_error("postgresql://u@db/studies", exc)
        other = storage_error("mysql://u@db/studies", exc)
    assert 'pip install "mpadvise[postgres]"' in message and "psycopg" in message
    assert "mpadvise[postgres]" not in other and "driver" in other


def test_heartbeat_settings_default_and_follow_the_environment():
    assert Heartbeat.from_environ({}) == Heartbeat(30, 120, 2)
    assert Heartbeat.from_environ({HEARTBEAT_ENV: "2"}) == Heartbeat(2, 8, 2)
    assert Heartbeat.from_environ({HEARTBEAT_ENV: "1", GRACE_ENV: "3", MAX_RETRY_ENV: "0"}) == Heartbeat(1, 3, 0)


@pytest.mark.parametrize(
    ("environ", "needle"),
    [
        ({HEARTBEAT_ENV: "0"}, f"{HEARTBEAT_ENV}='0' is not allowed; expected whole seconds >= 1"),
        ({HEARTBEAT_ENV: "1.5"}, f"{HEARTBEAT_ENV}='1.5' is not allowed"),
        ({MAX_RETRY_ENV: "-1"}, f"{MAX_RETRY_ENV}='-1' is not allowed; expected whole retries >= 0"),
        ({HEARTBEAT_ENV: "10", GRACE_ENV: "10"}, f"{GRACE_ENV}=10 is not allowed with {HEARTBEAT_ENV}=10"),
    ],
)
def test_bad_heartbeat_settings_are_one_clear_error(environ, needle):
    with pytest.raises(MpadviseError, match="^" + needle.replace("(", r"\(").replace(".", r"\.")):
        Heartbeat.from_environ(environ)


def test_a_stored_result_keeps_every_field_of_its_candidate():
    cand = Candidate("bf16-mixed", 16, reduce_dtype="bf16")
    m = Measured(cand, 123.0, True, True, outcome="ok", reason="fine")
    assert measured_from(measured_to(m)) == m
    # A result stored before a field existed reads with that field's default.
    old = {k: v for k, v in measured_to(m).items() if k != "reduce_dtype"}
    assert measured_from(old).candidate == Candidate("bf16-mixed", 16)


# --- the search in a study that another worker shares ------------------------------------------


class Runs:
    """A fake trial runner: every candidate stable, the bf16 modes twice as fast as fp32."""

    def __init__(self) -> None:
        self.ran: list[Candidate] = []

    def __call__(self, candidate: Candidate) -> Measured:
        self.ran.append(candidate)
        return Measured(candidate, 100.0 if candidate.mode == "fp32" else 200.0, True, True, outcome="ok")


def _search(url: str, runs, *, sleep=lambda s: None, hardware="ab" * 8, trials=5):
    """This worker's search of the study ``s`` (joined: ``resume``), fp32 measured as its reference."""
    options = TuneOptions(storage=url, resume=True, no_priors=True, trials=trials)
    reference = {FP32: Measured(FP32, 100.0, True, True, outcome="ok")}
    return run_search(SPACE, runs, options, first=[FP32, BF16], reference_goodput=100.0, dtype_ratio={},
                      study_name="s", known=reference, hardware=hardware, sleep=sleep)


def _other_worker_claims(study: optuna.Study, candidate: Candidate) -> optuna.Trial:
    """A trial that another worker runs now: RUNNING, claiming ``candidate``."""
    trial = study.ask()
    trial.set_user_attr(TRIAL_ATTR_CLAIM, {**candidate_to(candidate), "trial": trial.number, "worker": OTHER})
    return trial


@pytest.fixture
def shared(tmp_path, monkeypatch):
    """An SQLite study ``s``, as the other worker made it, and its URL."""
    monkeypatch.delenv(HEARTBEAT_ENV, raising=False)
    monkeypatch.delenv(GRACE_ENV, raising=False)
    monkeypatch.delenv(MAX_RETRY_ENV, raising=False)
    url = f"sqlite:///{tmp_path / 'studies.db'}"
    study = optuna.create_study(study_name="s", storage=url, direction="maximize")
    return url, study


def test_a_candidate_another_worker_runs_is_awaited_and_taken_in_not_run(shared):
    url, study = shared
    theirs = _other_worker_claims(study, BF16)
    waits = []

    def sleep(seconds: float) -> None:  # while this worker waits, the other one finishes
        waits.append(seconds)
        theirs.set_user_attr(TRIAL_ATTR_RESULT, {**measured_to(Measured(BF16, 210.0, True, True, outcome="ok")),
                                                 "source": "run", "worker": OTHER})
        study.tell(theirs, 210.0)

    runs = Runs()
    outcome = _search(url, runs, sleep=sleep)
    # fp32 is the reference; bf16-mixed, queued first, is the other worker's: this one closes
    # its copy, takes the free bf16-true instead, then waits for the other's result.
    assert runs.ran == [PURE]
    closed = [t.user_attrs[TRIAL_ATTR_CLOSED] for t in study.get_trials() if TRIAL_ATTR_CLOSED in t.user_attrs]
    assert closed == [f"not run: trial {theirs.number} of another worker runs bf16-mixed"]
    assert len(waits) == 1
    assert outcome.measured[BF16].goodput == 210.0 and outcome.resumed == 1
    assert outcome.stop_reason.startswith("every candidate of the space was measured")


def test_a_retried_copy_inherits_no_claim(shared):
    url, study = shared
    copy = study.ask()
    # What Optuna's retry callback copies from a stale trial: its claim, under the old number.
    copy.set_user_attr(TRIAL_ATTR_CLAIM, {**candidate_to(BF16), "trial": copy.number - 1 if copy.number else 99,
                                          "worker": OTHER})
    runs = Runs()
    outcome = _search(url, runs)
    assert sorted(runs.ran) == sorted([BF16, PURE]) and outcome.runs == 2


def test_each_result_names_how_it_came_and_who_told_it(shared):
    url, study = shared
    runs = Runs()
    _search(url, runs)
    results = [t.user_attrs[TRIAL_ATTR_RESULT] for t in study.get_trials() if TRIAL_ATTR_RESULT in t.user_attrs]
    ran = sorted(r["mode"] for r in results if r["source"] == "run")
    assert ran == ["bf16-mixed", "bf16-true"]
    assert [r["mode"] for r in results if r["source"] == "reference"] == ["fp32"]
    assert [r["source"] for r in results].count("reference") == 1  # later copies are "known"
    assert len({r["worker"] for r in results}) == 1


def test_a_candidate_whose_workers_keep_dying_is_given_up(shared, monkeypatch):
    url, study = shared
    monkeypatch.setenv(MAX_RETRY_ENV, "1")
    for _ in range(2):  # failed as stale twice: one more than the retries allowed
        study.tell(_other_worker_claims(study, BF16), state=optuna.trial.TrialState.FAIL)
    runs = Runs()
    outcome = _search(url, runs)
    assert runs.ran == [PURE]
    given_up = outcome.measured[BF16]
    assert given_up.outcome == "crash" and not given_up.stable and "lost their workers" in given_up.reason


def test_an_interrupted_trial_is_closed_not_left_running(shared):
    url, study = shared

    def interrupted(candidate: Candidate) -> Measured:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _search(url, interrupted)
    states = {t.state for t in study.get_trials()}
    assert optuna.trial.TrialState.RUNNING not in states
    closed = [t for t in study.get_trials() if TRIAL_ATTR_CLOSED in t.user_attrs]
    assert len(closed) == 1 and closed[0].state == optuna.trial.TrialState.FAIL


def test_a_study_measured_on_other_hardware_is_refused(shared):
    url, study = shared
    study.set_user_attr(STUDY_ATTR_HARDWARE, "cd" * 8)
    with pytest.raises(MpadviseError, match=f"measured on hardware {'cd' * 8}, and this machine is {'ab' * 8}"):
        check_study(url, "s", hardware="ab" * 8, resume=True)
    with pytest.raises(MpadviseError, match="measurements from different hardware never mix"):
        _search(url, Runs())
    check_study(url, "s", hardware="ab" * 8, resume=False)  # not continued: an SQLite study starts afresh


def test_the_study_records_the_hardware_it_was_measured_on(shared):
    url, study = shared
    _search(url, Runs())
    assert optuna.load_study(study_name="s", storage=url).user_attrs[STUDY_ATTR_HARDWARE] == "ab" * 8


def test_a_multi_process_tune_keeps_its_own_study(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    one = study_name_for(script, [], "ab" * 8)
    assert study_name_for(script, [], "ab" * 8, processes=1) == one
    assert study_name_for(script, [], "ab" * 8, processes=2) != one
