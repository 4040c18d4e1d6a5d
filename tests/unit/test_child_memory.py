"""In-process CPU trials report their own peak memory, not the process's lifetime peak."""

from __future__ import annotations

import dataclasses
import os
import sys
import time

import pytest
import torch
import torch.nn as nn

from advisor.trial import _device
from advisor.tune._run import FunctionRunner, TrialSettings
from policies import Policy

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self (Linux)")

HOG = 400 * 2**20
MARGIN = 150 * 2**20
SETTINGS = TrialSettings(warmup_steps=1, measure_steps=3, device="cpu")


def current_rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def tiny(mp) -> None:
    net = nn.Linear(8, 1)
    model, optimizer = mp.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    x = mp.to_device(torch.randn(16, 8))
    mp.micro_batch_size(16)
    while True:
        with mp.autocast():
            loss = model(x).float().pow(2).mean()
        mp.step(loss, optimizer)


def hog(mp) -> None:
    held = torch.ones(HOG // 4)  # touched, so resident; alive for the whole trial  # noqa: F841
    tiny(mp)


def run(train_fn, **settings):
    result = FunctionRunner(train_fn, dataclasses.replace(SETTINGS, **settings))(Policy(mode="fp32"), "fp32")
    return result


def later_trial_is_judged_on_its_own_peak() -> None:
    big = run(hog)
    assert big.outcome == "ok" and big.peak_memory >= HOG
    limit = current_rss() + MARGIN
    assert big.peak_memory > limit  # the process's lifetime peak is above the next trial's limit
    small = run(tiny, memory_limit=limit)
    assert small.outcome == "ok", small.reason
    assert small.memory_kind == "cpu-peak-rss"
    assert current_rss() - MARGIN < small.peak_memory < limit


def test_later_trial_is_not_out_of_memory_for_an_earlier_ones_peak() -> None:
    later_trial_is_judged_on_its_own_peak()


def test_same_without_a_resettable_high_water_mark(monkeypatch) -> None:
    # Where /proc/self/clear_refs cannot be written, the peak comes from sampling the RSS.
    monkeypatch.setattr(_device, "reset_peak_rss", lambda: False, raising=False)
    later_trial_is_judged_on_its_own_peak()


def test_sampled_peak_sees_a_short_allocation(monkeypatch) -> None:
    monkeypatch.setattr(_device, "reset_peak_rss", lambda: False)
    held = torch.ones(HOG // 4)  # make the lifetime peak higher than what follows
    del held
    meter = _device.TrialPeakRss()
    meter.start()
    before = current_rss()
    spike = torch.ones(MARGIN // 4)
    time.sleep(0.2)
    del spike
    peak = meter.stop()
    assert peak is not None and peak >= before + MARGIN * 0.9
    assert peak < before + HOG
