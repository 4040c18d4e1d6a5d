"""The guard's slow signals, fed by hand: the loss behind fp32's curve, a climb, and updates lost
to rounding (a stall); and that noise, a loss heading towards zero and fp32 weights trip none."""

from __future__ import annotations

import math
import random

import torch

from advisor.runtime._guard import BEHIND, CLIMB, STALL, Guard, GuardLimits, LossTrend, UpdateProbe

LIMITS = GuardLimits()


def _feed(guard: Guard, losses, *, lost=lambda step: None):
    for step, loss in enumerate(losses, start=1):
        found = guard.observe(step, loss=loss, applied=True, loss_scale=None, lost=lost(step))
        if found is not None:
            return found
    return None


def _noisy(n: int, level=lambda step: 1.0, spread: float = 0.3, seed: int = 0) -> list[float]:
    rng = random.Random(seed)
    return [level(step) * math.exp(rng.gauss(0.0, spread)) for step in range(1, n + 1)]


def test_a_climb_is_named_from_the_window_where_it_began():
    losses = _noisy(300, level=lambda s: 1.0 / math.sqrt(s)) + _noisy(200, level=lambda s: 0.06 * 1.02 ** s, seed=1)
    signal, onset, detail = _feed(Guard("warn"), losses)
    assert signal == CLIMB and 300 < onset <= 300 + 4 * LIMITS.loss_window, (onset, detail)


def test_noise_a_loss_heading_to_zero_and_a_plateau_never_trip():
    for seed in range(5):
        assert _feed(Guard("warn"), _noisy(3000, spread=0.5, seed=seed)) is None
        assert _feed(Guard("warn"), _noisy(3000, level=lambda s: 1.0 / s, seed=seed)) is None
        assert _feed(Guard("warn"), _noisy(3000, level=lambda s: max(0.1, 1.0 - s / 500), seed=seed)) is None


def test_a_run_behind_fp32s_curve_trips_and_one_beside_it_does_not():
    reference = _noisy(200, level=lambda s: 1.0 / math.sqrt(s), spread=0.1, seed=7)
    beside = _noisy(400, level=lambda s: 1.0 / math.sqrt(s), spread=0.1, seed=8)
    assert _feed(Guard("warn", reference=reference), beside) is None
    behind = [v * 1.3 for v in beside]
    signal, onset, detail = _feed(Guard("warn", reference=reference), behind)
    # Judged once, on the last whole window the run shares with fp32's 200 steps: 176-200.
    assert (signal, onset) == (BEHIND, 176) and "over steps 176-200" in detail


def test_lost_updates_in_probes_in_a_row_are_a_stall():
    every = LIMITS.probe_every

    def lost(step: int) -> float | None:
        return None if step % every else (0.95 if step >= 100 else 0.1)

    signal, onset, detail = _feed(Guard("warn"), [1.0] * 400, lost=lost)
    assert (signal, onset) == (STALL, 100) and "95% of sampled updates lost" in detail
    assert _feed(Guard("warn"), [1.0] * 400, lost=lambda s: None if s % every else 0.1) is None


def test_without_a_safer_mode_the_trend_is_not_watched_and_rearm_starts_afresh():
    losses = _noisy(300, level=lambda s: 1.0 / math.sqrt(s)) + _noisy(200, level=lambda s: 0.06 * 1.02 ** s, seed=1)
    assert _feed(Guard("warn", trend=False), losses) is None
    guard = Guard("warn")
    assert _feed(guard, losses) is not None
    guard.rearm()
    assert guard.trend.best is None and guard.trend.losses == []


def test_the_trend_travels_with_the_checkpoint():
    guard = Guard("warn")
    _feed(guard, _noisy(60))
    resumed = Guard("warn")
    resumed.load_state_dict(guard.state_dict())
    assert resumed.trend.state_dict() == guard.trend.state_dict()


def test_the_probe_sees_bf16_updates_rounded_away_and_ignores_fp32():
    def step(dtype: torch.dtype, lr: float) -> float | None:
        weight = torch.nn.Parameter(torch.full((64,), 0.25, dtype=dtype))
        weight.grad = torch.full((64,), 0.1, dtype=dtype)
        probe = UpdateProbe(every=5)
        probe.before(5, [weight])
        torch.optim.SGD([weight], lr=lr).step()
        return probe.lost()

    assert step(torch.bfloat16, 1e-4) == 1.0  # 1e-5 against a spacing of 2^-10 at 0.25
    assert step(torch.bfloat16, 0.1) == 0.0
    assert step(torch.float32, 1e-4) is None  # fp32 weights: nothing to probe
    probe = UpdateProbe(every=5)
    probe.before(4, [torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16))])
    assert probe.lost() is None  # not a probing step


def test_loss_trend_windows_are_its_own():
    trend = LossTrend(window=4, windows=1, climb_margin=0.05, gap_margin=0.05)
    assert [trend.add(s, 1.0) for s in range(1, 5)] == [None] * 4 and trend.best == (1.0, 1.0)
    assert [trend.add(s, 2.0) for s in range(5, 9)][-1][0] == CLIMB
