"""torch.compile and CUDA graphs inside a trial: losses read from copies that a later graph
replay cannot overwrite, and no "no-step" verdict while the first forward compiles."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
import torch
import torch.nn as nn

from advisor.trial import EXIT_NO_STEP, TrialSpec, _child, _step_window
from policies import Policy
from probes import HardwareProfile

CPU = HardwareProfile(kind="cpu", name="test CPU", cores=2)


def _spec(tmp_path, **fields) -> TrialSpec:
    spec = TrialSpec(policy=Policy(mode="fp32").to_dict(), result_path=str(tmp_path / "result.json"),
                     warmup_steps=1, measure_steps=4, device="cpu")
    return dataclasses.replace(spec, **fields)


def test_losses_are_copies_that_a_later_replay_cannot_overwrite(tmp_path):
    # Under torch.compile(mode="reduce-overhead") a CUDA graph writes every replay's outputs
    # into the same memory: the loss tensor a step received is overwritten by the next step.
    seen: list[float] = []

    def train(mp) -> None:
        net = nn.Linear(4, 1)
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
        x, y = torch.randn(16, 4), torch.randn(16, 1)
        mp.micro_batch_size(16)
        while True:
            loss = nn.functional.mse_loss(net(x), y)
            seen.append(loss.item())
            mp.step(loss, optimizer)
            loss.detach().fill_(-1.0)  # the next replay reuses the output's memory

    data, error = _child.run_in_process(train, _spec(tmp_path), profile=CPU)
    assert error is None and data["complete"], data
    assert data["losses"] == pytest.approx(seen[:5])
    assert len(set(data["losses"])) == 5  # distinct per step, not all the last one


def test_losses_are_copies_under_gradient_accumulation_too(tmp_path):
    def train(mp) -> None:
        net = nn.Linear(4, 1)
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
        x, y = torch.randn(16, 4), torch.randn(16, 1)
        micro = mp.micro_batch_size(16)
        assert micro == 8
        while True:
            for i in range(2):
                loss = nn.functional.mse_loss(net(x[8 * i : 8 * i + 8]), y[8 * i : 8 * i + 8])
                mp.step(loss, optimizer)
                loss.detach().fill_(-1.0)

    spec = _spec(tmp_path, policy=Policy(mode="fp32", micro_batch_size=8).to_dict())
    data, error = _child.run_in_process(train, spec, profile=CPU)
    assert error is None and data["complete"], data
    assert all(v > 0 for v in data["losses"])


def _child_recorder(tmp_path, first_step_timeout: float) -> _child.TrialRecorder:
    spec = _spec(tmp_path, first_step_timeout=first_step_timeout)
    applied = _child._build(spec, _child.ResultWriter(spec.result_path), profile=CPU, device="cpu", in_process=False)
    return applied._observer


def _wait_for(codes: list[int], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not codes and time.monotonic() < deadline:
        time.sleep(0.02)


def test_compiling_the_first_forward_is_not_counted_as_no_step(tmp_path, exits):
    compile_s, timeout = 1.5, 0.5

    def slow_backend(gm, example_inputs):
        time.sleep(compile_s)  # a large model, or max-autotune: minutes on a real one
        return gm.forward

    # Dynamo's one-time set-up (its import and first-use initialisation: seconds on a loaded
    # machine, before any compile callback fires) comes before the watchdog: the test is about
    # compilation, which the watchdog must not count, not about importing it.
    import torch._dynamo

    torch.compile(lambda x: x + 1, backend="eager")(torch.ones(1))
    torch._dynamo.reset()

    recorder = _child_recorder(tmp_path, first_step_timeout=timeout)
    try:
        model = torch.compile(nn.Linear(4, 4), backend=slow_backend)
        started = time.monotonic()
        model(torch.randn(2, 4))
        assert time.monotonic() - started >= compile_s
        assert exits == [], "the watchdog ended the trial while the first forward compiled"
        # Compilation over, the script still has to step within the timeout.
        _wait_for(exits, 10 * timeout)
        assert exits == [EXIT_NO_STEP]
    finally:
        recorder._watchdog.cancel()
        torch._dynamo.reset()


def test_a_script_that_never_steps_is_still_stopped(tmp_path, exits):
    recorder = _child_recorder(tmp_path, first_step_timeout=0.3)
    try:
        _wait_for(exits, 5.0)
        assert exits == [EXIT_NO_STEP]
    finally:
        recorder._watchdog.cancel()


def test_the_first_step_stops_the_watchdog(tmp_path, exits):
    recorder = _child_recorder(tmp_path, first_step_timeout=0.3)
    try:
        recorder.before_step(recorder.applied)
        time.sleep(0.8)
        assert exits == []
        assert not any(t.name == "mpadvise-no-step" and t.is_alive() for t in threading.enumerate())
    finally:
        recorder._watchdog.cancel()


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class _Activity:
    def __init__(self) -> None:
        self.running = False

    def compiling(self) -> bool:
        return self.running


def test_the_deadline_moves_while_a_compilation_runs():
    clock, activity = _Clock(), _Activity()
    watchdog = _step_window.NoStepWatchdog(10.0, lambda: None, activity=activity, clock=clock)
    clock.now += 4.0
    activity.running = True  # the first forward compiles from 4 s to 300 s
    for _ in range(60):
        clock.now += 5.0
        assert not watchdog.expired()
    activity.running = False
    clock.now += 9.0
    assert not watchdog.expired()  # the whole timeout after the compilation was last seen
    clock.now += 1.0
    assert watchdog.expired()


def test_without_compilation_the_deadline_is_the_timeout():
    clock = _Clock()
    watchdog = _step_window.NoStepWatchdog(10.0, lambda: None, activity=_Activity(), clock=clock)
    clock.now += 9.9
    assert not watchdog.expired()
    clock.now += 0.1
    assert watchdog.expired()


def test_compile_activity_follows_dynamo_and_survives_its_reset():
    import torch._dynamo

    activity = _step_window.CompileActivity()
    seen: list[bool] = []

    def backend(gm, example_inputs):
        seen.append(activity.compiling())
        return gm.forward

    try:
        assert not activity.compiling()  # registers the callbacks
        torch.compile(lambda x: x * 2, backend=backend)(torch.ones(2))
        torch._dynamo.reset()  # clears every callback
        assert not activity.compiling()  # registers them again
        torch.compile(lambda x: x + 1, backend=backend)(torch.ones(2))
        assert seen == [True, True] and not activity.compiling()
    finally:
        torch._dynamo.reset()


def test_a_compilation_already_running_when_first_seen_counts():
    import torch._dynamo

    activity = _step_window.CompileActivity()  # registers nothing until its first look
    seen: list[bool] = []

    def backend(gm, example_inputs):
        seen.append(activity.compiling())  # the first look, halfway through a compilation
        return gm.forward

    try:
        torch.compile(lambda x: x - 1, backend=backend)(torch.ones(2))
        assert seen == [True] and not activity.compiling()
    finally:
        torch._dynamo.reset()
