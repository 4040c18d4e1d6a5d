"""The tune options, declared once: validation, dict and argv forms, and the daemon's request
model built from the same fields."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from pydantic import ValidationError

import advisor
from advisor.daemon._models import JobRequest, TuneOptionsModel
from advisor.frameworks import plan_for
from advisor.tune._options import TuneOptions, option_info
from advisor.tune._run import TrialSettings
from probes import MpadviseError, UsageError

# The daemon's documented job options (docs/daemon.md); stored jobs carry exactly these keys.
JOB_OPTIONS = ["trials", "time_budget", "steps", "warmup", "modes", "scale_batch", "include_emulated",
               "memory_limit", "timeout", "first_step_timeout", "seed", "framework", "resume", "fresh", "out", "no_cache", "no_priors"]


def test_one_set_of_names_and_defaults():
    names = [option.name for option in option_info()]
    assert [n for n in names if n not in ("device", "storage", "nproc_per_node")] == JOB_OPTIONS
    assert [option.name for option in option_info() if option.job] == JOB_OPTIONS
    defaults = TuneOptions()
    assert (defaults.trials, defaults.steps, defaults.warmup, defaults.timeout, defaults.seed) == (20, 40, 5, 600.0, 0)
    assert defaults.modes == () and defaults.time_budget is None and not defaults.no_priors and not defaults.no_cache
    assert {option.name: option.flag for option in option_info()}["modes"] == "--mode"
    assert all(option.help.endswith(".") for option in option_info())


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"trials": 0}, "--trials 0 is not allowed; expected a whole number >= 1"),
        ({"trials": True}, "--trials True is not allowed; expected a whole number"),
        ({"trials": 2.5}, "--trials 2.5 is not allowed; expected a whole number"),
        ({"steps": 0}, "--steps 0 is not allowed; expected a whole number >= 1"),
        ({"warmup": -1}, "--warmup -1 is not allowed; expected a whole number >= 0"),
        ({"seed": -3}, "--seed -3 is not allowed; expected a whole number >= 0"),
        ({"time_budget": 0}, "--time-budget 0 is not allowed; expected seconds > 0"),
        ({"timeout": math.nan}, "--timeout nan is not allowed; expected seconds > 0"),
        ({"timeout": "600"}, "--timeout '600' is not allowed; expected seconds > 0"),
        ({"modes": "bf16-mixed"}, "--mode 'bf16-mixed' is not allowed; expected a list of mode names"),
        ({"modes": ["fp32", 3]}, "--mode ['fp32', 3] is not allowed"),
        ({"scale_batch": 1}, "--scale-batch 1 is not allowed; expected True or False"),
        ({"memory_limit": "lots"}, "memory limit 'lots' is not a size"),
        ({"memory_limit": 0}, "--memory-limit 0 is not allowed; expected a size such as 4GiB"),
        ({"out": 5}, "--out 5 is not allowed; expected a file path"),
        ({"device": 0}, "--device 0 is not allowed; expected text"),
        ({"framework": "Keras!"}, "--framework 'Keras!' is not allowed; expected a framework name such as lightning"),
        ({"nproc_per_node": 0}, "--nproc-per-node 0 is not allowed; expected a whole number >= 1"),
    ],
)
def test_a_bad_value_names_the_option_the_value_and_what_is_allowed(changes, needle):
    # A usage error: the CLI says it in one line and exits 2, whichever command took the option.
    with pytest.raises(UsageError) as info:
        TuneOptions(**changes)
    assert needle in str(info.value)
    with pytest.raises(UsageError):
        TuneOptions().with_(**changes)


def test_a_framework_name_is_taken_in_any_case_as_the_registry_takes_it(tmp_path):
    # The frameworks registry names what exists and accepts any case; the option passes the
    # name on as written, so a refusal quotes it and a known name resolves.
    assert TuneOptions(framework="Lightning").framework == "Lightning"
    script = tmp_path / "train.py"
    script.write_text("print('never run')\n")
    assert plan_for(script, TuneOptions(framework="Lightning").framework).framework == "lightning"
    with pytest.raises(UsageError, match="unknown framework 'Keras'; expected one of lightning"):
        plan_for(script, TuneOptions(framework="Keras").framework)


def test_options_that_cannot_go_together_and_unknown_names_are_usage_errors():
    with pytest.raises(UsageError, match="cannot be used with --nproc-per-node 2"):
        TuneOptions(nproc_per_node=2, device="cuda:0")
    with pytest.raises(UsageError, match="unknown tune option 'use_priors'"):
        TuneOptions.from_dict({"use_priors": True})


def test_values_are_normalised_once():
    options = TuneOptions(modes=["bf16-mixed"], out=Path("/tmp/x.toml"), memory_limit="1GiB")
    assert options.modes == ("bf16-mixed",) and options.out == "/tmp/x.toml"
    assert options.memory_limit_bytes == 2**30 and TuneOptions(memory_limit=4096).memory_limit_bytes == 4096
    assert TuneOptions(memory_limit="").memory_limit is None  # an empty flag means no limit
    assert hash(options) == hash(TuneOptions(modes=("bf16-mixed",), out="/tmp/x.toml", memory_limit="1GiB"))


def test_dict_round_trip_and_a_stored_job_row_loads():
    options = TuneOptions(trials=3, modes=["fp32", "bf16-mixed"], memory_limit="4GiB", no_priors=True, device="cpu")
    assert TuneOptions.from_dict(options.to_dict()) == options
    assert list(options.to_dict(job=True)) == JOB_OPTIONS and options.to_dict(job=True)["modes"] == ["fp32", "bf16-mixed"]
    # A job row as the daemon has always stored it (the request model's dump).
    row = {"trials": 2, "time_budget": None, "steps": 32, "warmup": 2, "modes": ["fp32"], "scale_batch": False,
           "include_emulated": False, "memory_limit": None, "timeout": 600.0, "seed": 0, "resume": False,
           "out": "/w/train.mpadvise.toml", "no_cache": False, "no_priors": False}
    # A row stored before an option existed loads, that option at its default.
    assert TuneOptions.from_dict(row).to_dict(job=True) == {**row, "framework": None, "first_step_timeout": 120.0,
                                                                     "fresh": False}
    # A row stored while --speedup-within existed loads too: the retired option is dropped.
    assert TuneOptions.from_dict({**row, "speedup_within": 0.1}) == TuneOptions.from_dict(row)
    with pytest.raises(MpadviseError, match="unknown tune option 'use_priors'; expected some of trials"):
        TuneOptions.from_dict({"use_priors": False})


def test_argv_leaves_defaults_out_and_repeats_modes():
    assert TuneOptions().to_argv() == []
    argv = TuneOptions(trials=3, time_budget=90.5, modes=["fp32", "bf16-mixed"], no_cache=True,
                       memory_limit="4GiB", out="/w/x.toml").to_argv()
    assert argv == ["--trials", "3", "--time-budget", "90.5", "--mode", "fp32", "--mode", "bf16-mixed",
                    "--memory-limit", "4GiB", "--out", "/w/x.toml", "--no-cache"]


def test_trial_settings_take_the_measuring_window_from_the_options():
    settings = TrialSettings.for_tune(TuneOptions(steps=12, warmup=3, seed=7, memory_limit="1MiB", timeout=9.0))
    assert (settings.measure_steps, settings.warmup_steps, settings.seed) == (12, 3, 7)
    assert (settings.memory_limit, settings.timeout, settings.device) == (2**20, 9.0, None)


def test_the_request_model_is_built_from_the_dataclass():
    fields = TuneOptionsModel.model_fields
    assert list(fields) == JOB_OPTIONS
    for option in option_info():
        if option.job:
            assert fields[option.name].get_default(call_default_factory=True) == (
                list(option.default) if isinstance(option.default, tuple) else option.default)
            assert fields[option.name].description.startswith(option.help)
    assert TuneOptionsModel().model_dump() == TuneOptions().to_dict(job=True)
    options = TuneOptions(trials=7, modes=["fp32"], memory_limit="2GiB", seed=5, no_priors=True)
    assert TuneOptionsModel.model_validate(options.to_dict(job=True)).model_dump() == options.to_dict(job=True)


def test_what_the_wire_takes_the_dataclass_takes_and_the_lower_bounds_agree():
    for option in option_info():
        if not option.job or option.minimum is None:
            continue
        # Whole numbers and seconds step by 1 above a bound they may not reach; a fraction by 0.01.
        step = 1 if float(option.job_limit).is_integer() else 0.01
        lowest = option.minimum + (step if option.above else 0)
        top = option.job_limit
        for value in (lowest, top):
            dumped = JobRequest.model_validate({"script": "/x", "options": {option.name: value}}).options.model_dump()
            assert getattr(TuneOptions.from_dict(dumped), option.name) == value
        below = option.minimum if option.above else option.minimum - 1
        with pytest.raises(ValidationError):
            JobRequest.model_validate({"script": "/x", "options": {option.name: below}})
        with pytest.raises(MpadviseError):
            TuneOptions(**{option.name: below})
    with pytest.raises(ValidationError):  # the wire stays strict: a memory limit is text
        TuneOptionsModel.model_validate({"memory_limit": 4096})


def test_the_api_takes_the_same_names():
    with pytest.raises(MpadviseError, match="unknown tune option 'use_priors'"):
        advisor.tune(lambda mp: None, use_priors=False)
    with pytest.raises(MpadviseError, match="--steps 0 is not allowed"):
        advisor.tune(lambda mp: None, steps=0)
