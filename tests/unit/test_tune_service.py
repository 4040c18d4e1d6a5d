"""The tune service (advisor.tune.tune_script) against a fake trial runner: the study it names
and stores, the config file, the cache entry, and the JSON that mpadvise tune prints."""

from __future__ import annotations

import functools
import json

import pytest
from test_search import GPU, FakeRunner
from typer.testing import CliRunner

from advisor.cache._recommend import cached_answers
from advisor.cli._app import app
from advisor.tune import ScriptLaunch, TuneOptions, TuneRequest, study_name_for, tune_script
from advisor.tune import job as tune_job
from advisor.tune._service import check_judgeable_window
from advisor.tune._space import SpaceLimits
from policies import load_config
from probes import UsageError, hardware_fingerprint

SPEEDS = {"fp32": 10.0, "tf32": 6.0, "bf16-mixed": 4.0, "fp16-mixed": 4.2, "bf16-true": 3.0}
OPTIONS = TuneOptions(trials=3, modes=["bf16-mixed"], no_priors=True)

# What `mpadvise tune --json` prints and a daemon job stores, key for key: callers read it.
TUNE_JSON_KEYS = {
    "winner", "winner_label", "speedup_vs_fp32", "speedup", "tie_note", "scale_batch_note", "user_batch", "space",
    "trials_run", "trials_resumed", "stop_reason", "matmul_ratio_vs_fp32", "finalists", "remeasure_rounds",
    "remeasure_max_rounds", "remeasure_leaning_rounds", "remeasure_stop", "reference_rounds", "time_budget", "gap", "dropped_finalists",
    "pruned", "reference", "replicate", "candidates", "wall_s", "window_note", "measure_steps", "extended_window", "disturbed",
    "flops_per_step", "flops_basis", "peak_tflops", "cost", "late",
    "script", "args", "framework", "calls_load_policy", "config_file", "cache_id", "storage", "study_name",
    "hardware",
}


@pytest.fixture
def script(tmp_path, cache_home):
    path = tmp_path / "train.py"
    path.write_text("import advisor\nmp = advisor.load_policy()\n")
    return path


def test_a_tune_names_its_study_stores_it_writes_the_config_and_caches(script, cache_home):
    request = TuneRequest(script, ("--lr", "0.1"), OPTIONS)
    done = tune_script(request, profile=GPU, runner=FakeRunner(SPEEDS))
    assert done.exit_code == 0 and done.result.policy.mode == "bf16-mixed"
    assert done.study_name == study_name_for(script.resolve(), ["--lr", "0.1"], hardware_fingerprint(GPU))
    assert done.request.options.storage == f"sqlite:///{cache_home / 'studies.db'}"
    assert (cache_home / "studies.db").is_file()
    assert done.config_file == script.with_name("train.mpadvise.toml")
    assert load_config(done.config_file).mode == "bf16-mixed"
    assert "mp = advisor.load_policy()" in done.config_file.read_text()
    answers = cached_answers(GPU, script)
    assert len(answers) == 1 and answers[0].label.startswith(f"cache entry #{done.cache_id} ")
    assert answers[0].args == ("--lr", "0.1")
    payload = json.loads(json.dumps(done.to_dict(), default=str))
    assert set(payload) == TUNE_JSON_KEYS
    assert payload["calls_load_policy"] and payload["framework"] is None and payload["args"] == ["--lr", "0.1"]


def test_no_cache_writes_the_config_only(script, cache_home):
    done = tune_script(TuneRequest(script, (), OPTIONS.with_(no_cache=True)), profile=GPU, runner=FakeRunner(SPEEDS))
    assert done.cache_id is None and done.config_file is not None and cached_answers(GPU, script) == []


def test_a_framework_scripts_config_says_to_run_it_through_mpadvise(tmp_path, cache_home):
    script = tmp_path / "train.py"
    script.write_text("import lightning\n")
    launch = ScriptLaunch("lightning", True, ("-m", "advisor.frameworks._boot", "lightning"),
                          SpaceLimits(modes=("fp32", "bf16-mixed")), "Lightning's Trainer")
    done = tune_script(TuneRequest(script, (), OPTIONS, launch), profile=GPU, runner=FakeRunner(SPEEDS))
    text = done.config_file.read_text()
    assert "mpadvise run SCRIPT -- ARGS" in text and "load_policy" not in text
    assert done.request.options.framework == "lightning" and done.to_dict()["framework"] == "lightning"
    assert not done.calls_load_policy


def test_a_request_round_trips_through_json(script):
    launch = ScriptLaunch("transformers", False, ("-m", "x"), SpaceLimits(modes=None, micro_batch=False,
                                                                         loss_scale_kinds=("dynamic",)), "the HF Trainer")
    request = TuneRequest(script, ("a", "b"), OPTIONS.with_(out="/x/y.toml", seed=3), launch)
    assert TuneRequest.from_dict(json.loads(json.dumps(request.to_dict()))) == request


def test_the_cli_prints_the_services_json(script, monkeypatch):
    monkeypatch.setattr("advisor.cli._tune.tune_script", functools.partial(tune_script, runner=FakeRunner(SPEEDS)))
    monkeypatch.setattr("probes.profile_for", lambda device=None: GPU)
    result = CliRunner().invoke(app, ["tune", str(script), "--trials", "3", "-m", "bf16-mixed", "--no-priors", "--json",
                                      "--", "--lr", "0.1"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert set(payload) == TUNE_JSON_KEYS
    assert payload["winner"]["mode"] == "bf16-mixed" and payload["config_file"] == str(script.with_name("train.mpadvise.toml"))
    assert payload["hardware"] == {"name": GPU.name, "fingerprint": hardware_fingerprint(GPU)}


def test_the_job_entry_point_writes_the_result_file(script, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(tune_job, "tune_script", functools.partial(tune_script, profile=GPU, runner=FakeRunner(SPEEDS)))
    request, result = tmp_path / "job.request.json", tmp_path / "job.result.json"
    request.write_text(json.dumps(TuneRequest(script, ("--lr", "0.1"), OPTIONS).to_dict()))
    assert tune_job.main([str(request), str(result)]) == 0
    data = json.loads(result.read_text())
    assert set(data) == TUNE_JSON_KEYS and data["winner"]["mode"] == "bf16-mixed"
    assert capsys.readouterr().out == ""  # nothing on stdout: the result is the file


def test_the_job_entry_point_says_what_went_wrong_in_one_line(tmp_path, capsys):
    request, result = tmp_path / "job.request.json", tmp_path / "job.result.json"
    request.write_text(json.dumps({"script": str(tmp_path / "missing.py")}))
    assert tune_job.main([str(request), str(result)]) == 2  # a script that is not there: a usage error
    assert capsys.readouterr().err.splitlines() == [f"error: script {tmp_path / 'missing.py'} does not exist"]
    assert not result.exists()
    assert tune_job.main([]) == 2


def test_tune_help_tells_framework_scripts_to_use_mpadvise_run():
    result = CliRunner().invoke(app, ["tune", "--help"], env={"COLUMNS": "300"}, terminal_width=300)
    assert "mpadvise run SCRIPT -- ARGS" in " ".join(result.output.split())


class _Untouched:
    """A runner the tune must never call: a refusal comes before the first trial."""

    def __call__(self, policy, label):
        raise AssertionError(f"a trial ran ({label}) although the tune should have been refused first")


@pytest.mark.parametrize(("out", "says"), [
    ("missing/dir/train.mpadvise.toml", "does not exist"),
    (".", "it is a directory"),
])
def test_a_config_path_the_tune_cannot_write_is_refused_before_any_trial(script, tmp_path, out, says):
    target = tmp_path / out
    request = TuneRequest(script, (), OPTIONS.with_(out=str(target)))
    with pytest.raises(UsageError, match=f"cannot write config file .*{says}"):  # refused before anything runs: exit 2
        tune_script(request, profile=GPU, runner=_Untouched())


def test_an_existing_file_that_is_not_a_config_is_refused_before_any_trial(script, tmp_path):
    notes = tmp_path / "notes.toml"
    notes.write_text("title = 'my notes'\n")
    request = TuneRequest(script, (), OPTIONS.with_(out=str(notes)))
    with pytest.raises(UsageError, match="not an mpadvise config file"):
        tune_script(request, profile=GPU, runner=_Untouched())
    assert notes.read_text() == "title = 'my notes'\n"


@pytest.mark.parametrize(("steps", "warmup", "smallest"), [(10, 2, 30), (1, 0, 32), (29, 2, 30)])
def test_a_window_too_short_for_a_verdict_is_refused_before_any_trial(script, steps, warmup, smallest):
    request = TuneRequest(script, (), OPTIONS.with_(steps=steps, warmup=warmup))
    with pytest.raises(UsageError, match=f"gives {steps + warmup} steps per trial.*at least 32.*--steps {smallest} or more"):
        tune_script(request, profile=GPU, runner=_Untouched())


def test_the_shortest_judgeable_window_is_accepted():
    check_judgeable_window(OPTIONS.with_(steps=30, warmup=2))
    check_judgeable_window(OPTIONS.with_(steps=32, warmup=0))
