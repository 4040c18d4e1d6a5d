"""Goodput counts the samples each step used: the batch that reached ``to_device`` since the last
``step()``, never a whole dataset moved to the device once."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from advisor.tune._judge import samples_per_step
from advisor.tune._run import FunctionRunner, TrialSettings
from policies import Policy

DATASET, BATCH = 4096, 64


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    x = torch.randn(DATASET, 16)
    return x, (x @ torch.randn(16, 4)).argmax(dim=1)


def _net(mp):
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    return mp.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))


def moves_its_data_once(mp) -> None:
    """A script that keeps its dataset on the device and indexes batches there."""
    model, optimizer = _net(mp)
    batch = mp.micro_batch_size(BATCH)
    x, y = mp.to_device(*_data())
    while True:
        for i in range(0, DATASET - batch + 1, batch):
            with mp.autocast():
                loss = F.cross_entropy(model(x[i : i + batch]), y[i : i + batch])
            mp.step(loss, optimizer)


def moves_each_batch(mp) -> None:
    """The usual loop, its last batch short: each step counts what it was given."""
    model, optimizer = _net(mp)
    batch = mp.micro_batch_size(BATCH)
    x, y = _data()
    sizes = [batch, batch, batch - 16]
    while True:
        for size in sizes:
            xb, yb = mp.to_device(x[:size], y[:size])
            with mp.autocast():
                loss = F.cross_entropy(model(xb), yb)
            mp.step(loss, optimizer)


FP32 = Policy(mode="fp32")


def _run(train, policy: Policy = FP32):
    settings = TrialSettings(warmup_steps=1, measure_steps=8, device="cpu")
    result = FunctionRunner(train, settings)(policy, policy.mode)
    assert result.outcome == "ok", (result.reason, result.stderr_tail)
    return result


def test_a_dataset_moved_once_counts_the_micro_batch_per_step() -> None:
    result = _run(moves_its_data_once)
    assert set(result.samples) == {BATCH}
    assert samples_per_step(result) == BATCH


def test_a_split_counts_every_micro_batch_of_the_step() -> None:
    # Micro-batch 16 of the script's 64: four micro-steps of 16 per optimizer step.
    result = _run(moves_its_data_once, Policy(mode="fp32", micro_batch_size=16))
    assert set(result.samples) == {BATCH}


def test_each_step_counts_the_batch_it_was_given() -> None:
    result = _run(moves_each_batch)
    assert list(result.samples) == [BATCH, BATCH, BATCH - 16] * 3


def test_step_samples_decides_from_the_batches_seen() -> None:
    from advisor.runtime._split import step_samples

    assert step_samples([4096], asked=64, micro=16) == 16  # a dataset: the micro-batch handed out
    assert step_samples([4096, 16, 16], asked=64, micro=16) == 16
    assert step_samples([48], asked=64, micro=64) == 48  # a short last batch counts as it is
    assert step_samples([], asked=64, micro=64) == 64  # indexed on the device: nothing moved
    assert step_samples([128], asked=64, micro=128) == 128  # --scale-batch hands out more than asked
    assert step_samples([32], asked=None, micro=None) == 32  # no micro_batch_size(): what was moved
    assert step_samples([], asked=None, micro=None) is None
