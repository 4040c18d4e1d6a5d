"""When a trial may be forked from the warm server and when it starts cold, and how a trial's
command line is read: pure decisions, no process started."""

from __future__ import annotations

import sys

import pytest

from advisor.trial import RUN_MODULE, WARM_ENV, framework_preload
from advisor.trial._python_command import PythonCommand, cold_command, exit_code, parse_command
from advisor.trial._warm import (
    cold_reason,
    environment_difference,
    environment_reason,
    warm_switched_off,
)
from advisor.trial._warm_server import is_per_trial, server_refusal

BOOT = ("-P", "-m", "advisor.frameworks._boot", "lightning")


def test_a_plain_script_on_linux_may_be_forked():
    assert cold_reason(["train.py", "--epochs", "1"], environ={}, platform="linux", can_fork=True) is None


def test_a_framework_script_may_be_forked():
    assert cold_reason([*BOOT, "train.py"], environ={}, platform="linux", can_fork=True) is None


@pytest.mark.parametrize(
    ("command", "kwargs", "needle"),
    [
        (["train.py"], {"environ": {WARM_ENV: "0"}}, f"{WARM_ENV}=0"),
        (["train.py"], {"environ": {WARM_ENV: "off"}}, "starts every trial cold"),
        (["train.py"], {"environ": {}, "platform": "darwin"}, "this is darwin"),
        (["train.py"], {"environ": {}, "can_fork": False}, "fork"),
        (["train.py"], {"environ": {}, "nproc_per_node": 2}, "torchrun"),
        (["-c", "print(1)"], {"environ": {}}, "not one a forked interpreter runs"),
        (["-X", "dev", "train.py"], {"environ": {}}, "not one a forked interpreter runs"),
        ([], {"environ": {}}, "not one a forked interpreter runs"),
    ],
)
def test_what_starts_a_trial_cold(command, kwargs, needle):
    kwargs = {"platform": "linux", "can_fork": True, **kwargs}
    reason = cold_reason(command, **kwargs)
    assert reason is not None and needle in reason


@pytest.mark.parametrize("value", ["1", "", "yes", "on"])
def test_the_switch_left_on_keeps_trials_warm(value):
    assert not warm_switched_off({WARM_ENV: value})
    assert warm_switched_off({WARM_ENV: "0"}) and warm_switched_off({WARM_ENV: " False "})


def test_only_per_trial_variables_may_differ_from_the_servers():
    server = {"PATH": "/bin", "OMP_NUM_THREADS": "2", "MPADVISE_HOME": "/a", "PWD": "/x"}
    trial = {"PATH": "/bin", "OMP_NUM_THREADS": "2", "MPADVISE_HOME": "/b", "MPADVISE_TRIAL_SPEC": "s.json",
             "PWD": "/y"}
    assert environment_difference(server, trial) == []
    assert environment_reason(server, trial) is None


@pytest.mark.parametrize(
    ("change", "differ"),
    [
        ({"OMP_NUM_THREADS": "1"}, ["OMP_NUM_THREADS"]),  # torch sizes its thread pool from it
        ({"CUDA_VISIBLE_DEVICES": "1"}, ["CUDA_VISIBLE_DEVICES"]),  # set only in the trial
        ({"PATH": None}, ["PATH"]),  # unset in the trial
        ({"TORCH_LOGS": "+dynamo", "PYTORCH_CUDA_ALLOC_CONF": "x"}, ["PYTORCH_CUDA_ALLOC_CONF", "TORCH_LOGS"]),
    ],
)
def test_any_other_variable_that_differs_starts_the_trial_cold(change, differ):
    server = {"PATH": "/bin", "OMP_NUM_THREADS": "2"}
    trial = {**server, **{k: v for k, v in change.items() if v is not None}}
    for name in [k for k, v in change.items() if v is None]:
        trial.pop(name)
    assert environment_difference(server, trial) == differ
    reason = environment_reason(server, trial)
    assert reason is not None and differ[0] in reason


def test_the_allowlist_is_explicit():
    assert is_per_trial("MPADVISE_TRIAL_SPEC") and is_per_trial("MPADVISE_POLICY") and is_per_trial("PWD")
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "CUDA_VISIBLE_DEVICES", "PYTHONHASHSEED", "LD_PRELOAD",
                 "TORCH_HOME", "MPADVISE", "RANK"):
        assert not is_per_trial(name), name


@pytest.mark.parametrize(
    ("threads", "cuda", "needle"),
    [(1, False, None), (2, False, "2 threads"), (1, True, "CUDA"), (3, True, "CUDA")],
)
def test_the_server_refuses_to_fork_with_a_thread_or_cuda(threads, cuda, needle):
    reason = server_refusal(threads, cuda)
    assert (reason is None) if needle is None else (needle in reason)


@pytest.mark.parametrize(
    ("argv", "command"),
    [
        (["train.py", "--lr", "1"], PythonCommand("train.py", ("--lr", "1"))),
        (["-P", "train.py"], PythonCommand("train.py", safe_path=True)),
        ([*BOOT, "t.py", "-x"], PythonCommand("advisor.frameworks._boot", ("lightning", "t.py", "-x"), module=True,
                                              safe_path=True)),
        (["-m", "pkg.mod", "-m", "x"], PythonCommand("pkg.mod", ("-m", "x"), module=True)),
        (["-m"], None),
        (["-m", "-P"], None),
        (["-u", "train.py"], None),
        (["-"], None),
    ],
)
def test_a_command_is_read_as_the_interpreter_reads_it(argv, command):
    assert parse_command(argv) == command


def test_a_cold_trial_runs_under_the_runner_unless_torchrun_starts_it():
    assert cold_command("py", ["t.py", "a"]) == ["py", "-P", "-m", RUN_MODULE, "t.py", "a"]
    assert cold_command("py", [*BOOT, "t.py"]) == ["py", "-P", "-m", RUN_MODULE, *BOOT, "t.py"]
    torchrun = ["-m", "torch.distributed.run", "--nproc-per-node", "2", "--no-python", "py", "t.py"]
    assert cold_command("py", torchrun, nproc_per_node=2) == ["py", *torchrun]
    assert cold_command("py", ["-X", "dev", "t.py"]) == ["py", "-X", "dev", "t.py"]


def test_a_framework_script_preloads_its_framework():
    assert framework_preload(BOOT) == ("advisor.frameworks", "advisor.frameworks:lightning")
    assert framework_preload(()) == ()
    assert framework_preload(("-m", "torch.distributed.run", "--standalone")) == ()


@pytest.mark.parametrize(("code", "status"), [(None, 0), (0, 0), (3, 3), (-1, -1), ("bad input", 1)])
def test_system_exit_codes_as_the_interpreter_gives_them(code, status, capsys):
    assert exit_code(SystemExit(code)) == status
    if isinstance(code, str):
        assert capsys.readouterr().err == "bad input\n"


def test_this_platform_reads_as_expected():
    reason = cold_reason(["t.py"], environ={})
    assert (reason is None) == (sys.platform.startswith("linux"))
