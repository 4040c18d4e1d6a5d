"""A trial times the user's step, not its own measuring: the recorder's own work in a step
(reading the loss scale, sampling the underflow) is cut out of that step's time, and every step
the user asked for is timed.

The check compares each step with itself, in one run: the trial's time for it against the same
step timed by hand in the user's loop, with the recorder's work made slow (a sleep) so that
leaving it in would show. A load on the machine slows both measurements of a step alike, so
the check holds on a busy machine; comparing a trial with a separate run timed by hand did not
(two CPU-bound neighbours moved that ratio to 0.86). How close the trial's step time is to a
loop without any recorder is a speed figure: ``scripts/bench_overhead.py --trial-modes``
measures it, interleaved, with medians over repeats.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from advisor import AppliedPolicy
from advisor.trial import UNDERFLOW_EVERY, _child
from advisor.tune._run import FunctionRunner, TrialSettings
from policies import Policy

WARMUP, MEASURE = 3, 30
DEPTH, WIDTH, BATCH = 16, 32, 32  # many small tensors: what made the old per-tensor sampling cost most
SLOW = 0.02  # seconds each piece of the recorder's own work is made to take
RESIDUAL = SLOW / 4  # what a step's cut may differ from the recorder's own work in it (median)


@pytest.fixture
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def train(mp, marks: list[float]) -> None:
    """An MLP of many small layers, trained until the trial ends it; ``marks`` gets the time at
    the start and at the end of each optimizer step, as a user times a step by hand."""
    torch.manual_seed(0)
    x = torch.randn(BATCH * 8, WIDTH)
    y = (x @ torch.randn(WIDTH, 4)).argmax(1)
    layers: list[nn.Module] = []
    for _ in range(DEPTH):
        layers += [nn.Linear(WIDTH, WIDTH), nn.LayerNorm(WIDTH), nn.ReLU()]
    net = nn.Sequential(*layers, nn.Linear(WIDTH, 4))
    model, optimizer = mp.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-3))
    batch = mp.micro_batch_size(BATCH)
    marks.append(time.perf_counter())
    while True:
        for i in range(0, len(x), batch):
            xb, yb = mp.to_device(x[i : i + batch], y[i : i + batch])
            with mp.autocast():
                loss = F.cross_entropy(model(xb).float(), yb)
            mp.step(loss, optimizer)
            marks.append(time.perf_counter())


def slowed(work: Callable[..., Any], spent: dict[int, float], marks: list[float]) -> Callable[..., Any]:
    """``work`` that first sleeps ``SLOW``; the seconds it took are added up per step in ``spent``
    (the step is the one the hand-timed loop is in: ``marks`` holds its start and each end)."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        time.sleep(SLOW)
        try:
            return work(*args, **kwargs)
        finally:
            step = len(marks) - 1
            spent[step] = spent.get(step, 0.0) + time.perf_counter() - start

    return wrapper


@pytest.mark.parametrize("mode", ["fp16-mixed", "bf16-mixed"])
def test_a_trial_times_each_step_less_the_recorders_own_work(mode, one_thread, isolated_home, monkeypatch) -> None:
    marks: list[float] = []
    spent: dict[int, float] = {}
    # The recorder reads the loss scale on every step and samples the underflow on some (fp16).
    monkeypatch.setattr(AppliedPolicy, "loss_scale", slowed(AppliedPolicy.loss_scale, spent, marks))
    monkeypatch.setattr(_child, "underflow_counts", slowed(_child.underflow_counts, spent, marks))
    settings = TrialSettings(warmup_steps=WARMUP, measure_steps=MEASURE, device="cpu")
    result = FunctionRunner(lambda mp: train(mp, marks), settings)(Policy(mode=mode), mode)
    assert result.outcome == "ok", (result.reason, result.stderr_tail)

    # Every step the user asked for is timed, and the underflow is still sampled (fp16 only).
    assert len(result.step_times) == len(result.losses) == WARMUP + MEASURE
    sampled = [i for i, u in enumerate(result.underflow) if u is not None]
    assert sampled == (list(range(0, WARMUP + MEASURE, UNDERFLOW_EVERY)) if mode.startswith("fp16") else [])

    # The trial ends inside the last step, so the loop's own marks time every step but that one.
    by_hand = [b - a for a, b in zip(marks, marks[1:])]
    steps = range(WARMUP, len(by_hand))
    assert len(steps) == MEASURE - 1 and all(spent[i] >= SLOW for i in steps)
    cut = [by_hand[i] - result.step_times[i] for i in steps]  # what the trial left out of each step
    off = statistics.median(c - spent[i] for c, i in zip(cut, steps))
    assert abs(off) < RESIDUAL, (
        f"the trial left {statistics.median(cut) * 1e3:.1f} ms per step out of the step's time, the "
        f"recorder's own work took {statistics.median(spent[i] for i in steps) * 1e3:.1f} ms "
        f"(median difference {off * 1e3:+.2f} ms)")
