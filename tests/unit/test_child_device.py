"""A trial on ``cuda:N`` times device N: through a fake ``torch.cuda`` whose devices each keep
their own queue of work, so that an event recorded on the wrong device measures nothing."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn
from fakes import FakeCudaTimeline, gpu_profile

from advisor.trial import TrialSpec, _child, _step_window
from policies import Policy

STEP_S = 0.010  # the GPU time one training step takes on the trial's device


def _spec(tmp_path, device: str) -> TrialSpec:
    return TrialSpec(policy=Policy(mode="fp32").to_dict(), result_path=str(tmp_path / "result.json"),
                     warmup_steps=2, measure_steps=4, device=device)


def _train_on(cuda: FakeCudaTimeline, device: int, seen: list[int]):
    """A training function whose every step queues STEP_S of work on ``device``."""

    def train(mp) -> None:
        net = nn.Linear(4, 1)
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
        x = torch.randn(8, 4)
        mp.micro_batch_size(8)
        while True:
            seen.append(torch.cuda.current_device())
            loss = net(x).pow(2).mean()
            cuda.run(device, STEP_S)
            mp.step(loss, optimizer)

    return train


# Every fp32 precision switch torch has (>= 2.9), generic first: a mode applied on a CUDA device
# writes the cuDNN ones, which a CPU-only test process otherwise never touches.
_PRECISION_SWITCHES = ("", "cuda.matmul", "cudnn", "cudnn.conv", "cudnn.rnn", "mkldnn", "mkldnn.matmul",
                       "mkldnn.conv", "mkldnn.rnn")


def _switch(path: str):
    backend = torch.backends
    for name in filter(None, path.split(".")):
        backend = getattr(backend, name)
    return backend


@pytest.fixture
def cuda(monkeypatch):
    """Two fake CUDA devices; the process's precision switches as they were, afterwards."""
    saved = {p: _switch(p).fp32_precision for p in _PRECISION_SWITCHES if hasattr(_switch(p), "fp32_precision")}
    yield FakeCudaTimeline(count=2).install(monkeypatch)
    for path, value in saved.items():
        _switch(path).fp32_precision = value


def test_a_trial_on_cuda_1_times_the_work_of_device_1(tmp_path, cuda):
    profile = dataclasses.replace(gpu_profile("H100"), index=1)
    seen: list[int] = []
    data, error = _child.run_in_process(_train_on(cuda, 1, seen), _spec(tmp_path, "cuda:1"), profile=profile)
    assert error is None and data["stage"] == "done" and data["complete"], data
    assert data["device"] == "cuda:1"
    # The first interval starts inside the first step(), after its forward was queued.
    assert data["step_times"][1:] == pytest.approx([STEP_S] * 5)  # not 0: device 0 did nothing
    assert set(seen) == {1}, "the trial's device is the current device while it runs"
    assert set(cuda.synchronized) == {1}
    assert cuda.current == 0, "an in-process trial gives the current device back"


def test_a_trial_on_cuda_0_still_times_device_0(tmp_path, cuda):
    seen: list[int] = []
    data, error = _child.run_in_process(_train_on(cuda, 0, seen), _spec(tmp_path, "cuda:0"), profile=gpu_profile("H100"))
    assert error is None and data["step_times"][1:] == pytest.approx([STEP_S] * 5)
    assert set(seen) == {0} and set(cuda.synchronized) == {0}


def test_the_current_device_is_restored_even_when_the_trial_fails(tmp_path, cuda):
    def broken(mp) -> None:
        raise RuntimeError("the script failed")

    _, error = _child.run_in_process(broken, _spec(tmp_path, "cuda:1"), profile=gpu_profile("H100"))
    assert "the script failed" in error
    assert cuda.current == 0


def test_a_trial_child_makes_its_device_current_for_the_whole_script(tmp_path, cuda, monkeypatch):
    # A child process is the trial's: code that says "cuda" without an index (torch.compile,
    # CUDA graphs, a script's own .cuda()) must land on the trial's device.
    monkeypatch.setattr(_step_window.atexit, "register", lambda fn: None)
    spec = dataclasses.replace(_spec(tmp_path, "cuda:1"), first_step_timeout=60.0)
    writer = _child.ResultWriter(spec.result_path)
    applied = _child._build(spec, writer, profile=gpu_profile("H100"), device="cuda:1", in_process=False)
    recorder = applied._observer
    try:
        assert cuda.current == 1 and cuda.set_devices == [1]
    finally:
        recorder._watchdog.cancel()
