"""A running search rides out a study storage that goes away: its calls are retried with
backoff for a bounded time, and a storage that stays away ends the search in one line that
names the server (password hidden) and what was kept.

The errors are real: a connection to a loopback port nobody listens on.
"""

from __future__ import annotations

import socket

import pytest
import sqlalchemy

from advisor.tune._space import Candidate, Measured
from advisor.tune._storage import (
    STORAGE_RETRY_ENV,
    STORAGE_RETRY_S,
    StorageLost,
    Worker,
    lost_message,
    storage_retry_s,
    unreachable,
)
from probes import MpadviseError

SECRET_URL = "postgresql://tuner:s3/cr+t=@127.0.0.1:{port}/studies"


def _refused_error() -> Exception:
    """What SQLAlchemy raises when the server is down: a real refused connection."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    pytest.importorskip("psycopg", reason='the postgres extra (pip install "mpadvise[postgres]") is not installed')
    engine = sqlalchemy.create_engine(f"postgresql+psycopg://tuner@127.0.0.1:{port}/studies",
                                      connect_args={"connect_timeout": 10})
    try:
        engine.connect()
    except Exception as exc:
        return exc
    finally:
        engine.dispose()
    raise AssertionError(f"connected to port {port}")


def _worker(sleeps: list[float], retry_s: int = 5) -> Worker:
    return Worker("here:1", None, None, sleeps.append, SECRET_URL.format(port=5432), retry_s)


def test_an_unreachable_storage_is_told_from_a_refused_request():
    assert unreachable(_refused_error())
    assert not unreachable(ValueError("a bug"))
    assert not unreachable(sqlalchemy.exc.IntegrityError("INSERT", {}, Exception("duplicate key")))


def test_a_call_is_retried_until_the_storage_is_back(caplog):
    error = _refused_error()
    failures = iter([error, error, error])
    sleeps: list[float] = []

    def store() -> str:
        failure = next(failures, None)
        if failure is not None:
            raise failure
        return "stored"

    assert _worker(sleeps, retry_s=600).call("storing trial 3's result", store) == "stored"
    assert sleeps == [0.5, 1.0, 2.0]  # backoff between tries


def test_a_storage_that_stays_away_ends_in_one_line_naming_the_server_and_what_was_kept():
    error = _refused_error()
    sleeps: list[float] = []
    worker = _worker(sleeps, retry_s=0)

    def down() -> None:
        raise error

    with pytest.raises(StorageLost):
        worker.call("storing trial 3's result (bf16-mixed)", down)
    worker.untold[3] = Measured(Candidate("bf16-mixed"), 712.25, True, True, outcome="ok")
    message = lost_message(worker.storage, "storing trial 3's result (bf16-mixed): down", worker, 2, retried=0)
    assert "s3" not in message and "postgresql://tuner:***@127.0.0.1:5432/studies" in message
    assert "\n" not in message
    assert "trial 3 bf16-mixed: 712.2 samples/s, stable" in message and "the 1 stored before stay" in message


def test_a_bug_is_not_retried():
    sleeps: list[float] = []

    def bug() -> None:
        raise KeyError("no such attr")

    with pytest.raises(KeyError):
        _worker(sleeps).call("reading the study", bug)
    assert sleeps == []


def test_the_retry_window_is_a_whole_number_of_seconds():
    assert storage_retry_s({}) == STORAGE_RETRY_S == 120
    assert storage_retry_s({STORAGE_RETRY_ENV: "0"}) == 0
    with pytest.raises(MpadviseError, match=STORAGE_RETRY_ENV):
        storage_retry_s({STORAGE_RETRY_ENV: "soon"})


def test_an_outage_while_the_search_opens_its_study_is_ridden_out(tmp_path, monkeypatch, caplog):
    # A worker whose reference and replicate ran while the server went away reached the search's
    # first call, opening the study, during the outage: it ended at once ("cannot open the Optuna
    # study storage ... An exception is raised during the commit"), never retrying, while the
    # other worker rode the same outage out.
    from advisor.tune import _search
    from advisor.tune._options import TuneOptions
    from advisor.tune._space import SearchSpace

    error = _refused_error()
    failures = iter([error, error])
    real = _search.open_study

    def opening(*args, **kwargs):
        failure = next(failures, None)
        if failure is not None:
            raise failure
        return real(*args, **kwargs)

    monkeypatch.setattr(_search, "open_study", opening)
    fp32, bf16 = Candidate("fp32"), Candidate("bf16-mixed")
    options = TuneOptions(storage=f"sqlite:///{tmp_path / 'studies.db'}", resume=True, no_priors=True, trials=3)
    sleeps: list[float] = []
    outcome = _search.run_search(
        SearchSpace(("fp32", "bf16-mixed"), (64,), 64),
        lambda cand: Measured(cand, 100.0 if cand.mode == "fp32" else 200.0, True, True, outcome="ok"),
        options, first=[fp32, bf16], reference_goodput=100.0, dtype_ratio={}, study_name="s",
        known={fp32: Measured(fp32, 100.0, True, True, outcome="ok")}, sleep=sleeps.append)
    assert outcome.measured[bf16].goodput == 200.0
    assert sleeps[:2] == [0.5, 1.0]  # two tries lost to the outage, with backoff
    assert "opening the study: retrying" in caplog.text and "the Optuna study storage is back" in caplog.text


class _OutageAt:
    """An outage at one call a search makes on its Optuna storage: the real refused connection,
    raised before the ``at``-th call reaches the study (``"before"``), or after the ``at``-th
    write went through and only its answer was lost (``"after"``: a commit that landed as the
    server went away). The storage is a real SQLite study; every public call of the RDB storage
    counts, the ones it makes on itself too."""

    WRITES = ("create_", "set_", "record_", "delete_", "fail_")

    def __init__(self, monkeypatch: pytest.MonkeyPatch, error: Exception) -> None:
        import optuna

        self.error, self.at, self.when, self.calls, self.writes, self.where = error, -1, "before", 0, 0, ""
        rdb = optuna.storages.RDBStorage
        names = {n for n in dir(optuna.storages.BaseStorage) if not n.startswith("_")} | {"record_heartbeat"}
        for name in sorted(names):
            if callable(getattr(rdb, name, None)):
                monkeypatch.setattr(rdb, name, self._counted(getattr(rdb, name), name))

    def _counted(self, real, name: str):
        write = name.startswith(self.WRITES)

        def call(storage, *args, **kwargs):
            if self.when == "before":
                hit = self.calls == self.at
            else:
                hit = write and self.writes == self.at
            self.calls += 1
            self.writes += write
            if not hit:
                return real(storage, *args, **kwargs)
            self.where = name
            if self.when == "after":
                real(storage, *args, **kwargs)
            raise self.error
        return call

    def search(self, tmp_path, at: int, when: str, **extra) -> tuple[dict, list[Candidate]]:
        """Run a three-candidate search (fp32 known) with the outage at call or write ``at``;
        returns its measured goodputs and the candidates it ran. ``extra`` goes to the search."""
        from advisor.tune import _search
        from advisor.tune._options import TuneOptions
        from advisor.tune._space import SearchSpace

        self.at, self.when, self.calls, self.writes, self.where = at, when, 0, 0, ""
        goodput = {"fp32": 100.0, "bf16-mixed": 200.0, "bf16-true": 150.0}
        ran: list[Candidate] = []

        def evaluate(cand: Candidate) -> Measured:
            ran.append(cand)
            return Measured(cand, goodput[cand.mode], True, True, outcome="ok")

        fp32 = Candidate("fp32")
        options = TuneOptions(storage=f"sqlite:///{tmp_path / f'{when}-{at}.db'}", resume=True, no_priors=True,
                              trials=3)
        outcome = _search.run_search(
            SearchSpace(("fp32", "bf16-mixed", "bf16-true"), (64,), 64), evaluate, options,
            first=[fp32, Candidate("bf16-mixed")], reference_goodput=100.0, dtype_ratio={}, study_name="s",
            known={fp32: Measured(fp32, 100.0, True, True, outcome="ok")}, sleep=lambda s: None, **extra)
        return {c.mode: m.goodput for c, m in outcome.measured.items()}, ran


OUTAGE_PARTS = 8


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("part", range(OUTAGE_PARTS))
def test_an_outage_at_any_call_of_the_search_is_ridden_out(tmp_path, monkeypatch, recwarn, when, part):
    # An outage between a trial's ask and its parameters (Optuna writes each suggested one)
    # ended a shared-study worker at once: "lost the Optuna study storage ...: An exception is
    # raised during the commit", never retried. A tell whose commit landed before its answer was
    # lost failed its retry ("Trial#0 has already finished").
    outage = _OutageAt(monkeypatch, _refused_error())
    expected = {"fp32": 100.0, "bf16-mixed": 200.0, "bf16-true": 150.0}
    assert outage.search(tmp_path, -1, when)[0] == expected
    count = outage.calls if when == "before" else outage.writes
    assert count > (50 if when == "before" else 15)  # every call is counted (the storage's own among them)
    for at in range(part, count, OUTAGE_PARTS):
        measured, ran = outage.search(tmp_path, at, when)
        assert outage.where, f"call {at} was never made"
        assert measured == expected, f"outage {when} call {at} ({outage.where})"
        assert sorted(c.mode for c in ran) == ["bf16-mixed", "bf16-true"], f"outage {when} call {at} ({outage.where})"
    assert not [w for w in recwarn if "constraint" in str(w.message)]


def test_an_outage_between_the_reference_and_the_search_is_ridden_out(tmp_path, monkeypatch):
    # A worker whose fp32 reference ran through an outage read the study's workload and replicate
    # at once, and ended ("cannot open the Optuna study storage"), while its search would have
    # ridden the same outage out.
    from advisor.tune._study_status import check_study_workload, stored_replicate

    outage = _OutageAt(monkeypatch, _refused_error())
    workload = {"workload_fingerprint": "abc", "model_signature": "def"}
    replicate = {"goodput": 99.0}
    outage.search(tmp_path, -1, "made", workload=workload, replicate=replicate)
    storage = f"sqlite:///{tmp_path / 'made--1.db'}"

    def read() -> tuple[bool, dict | None]:
        return check_study_workload(storage, "s", workload, resume=True), stored_replicate(storage, "s")

    # These only read: an outage before each call is all there is to ride out.
    outage.at, outage.when, outage.calls, outage.writes = -1, "before", 0, 0
    assert read() == (True, replicate)
    count = outage.calls
    assert count >= 4
    for at in range(count):
        outage.at, outage.calls, outage.writes, outage.where = at, 0, 0, ""
        assert read() == (True, replicate), f"outage at call {at} ({outage.where})"
        assert outage.where, f"call {at} was never made"
    # One that stays away (no retry window here) ends the tune in one line naming the server.
    monkeypatch.setenv(STORAGE_RETRY_ENV, "0")
    outage.at, outage.calls = 0, 0
    with pytest.raises(MpadviseError, match=r"^lost the Optuna study storage 'sqlite:///.*' \(retried for 0 s, "
                       + STORAGE_RETRY_ENV + r"\): opening the study: connection failed.*nothing of this tune is in"):
        check_study_workload(storage, "s", workload, resume=True)
