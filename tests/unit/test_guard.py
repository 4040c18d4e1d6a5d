"""The runtime guard's decisions, fed plain values; its fallback ladder; its checkpoint state."""

from __future__ import annotations

import math

import pytest
import torch

import advisor
from advisor._load import PolicySource, Resolution, after_guard_events
from advisor.runtime import Guard, GuardEvent, GuardLimits, guard_fallback, guard_setting
from advisor.tune import StabilityThresholds
from policies import Policy
from probes import MpadviseError, profile_for


def _feed(guard: Guard, steps: int, *, loss=lambda s: 1.0, applied=lambda s: True, scale=lambda s: None):
    for step in range(1, steps + 1):
        found = guard.observe(step, loss=loss(step), applied=applied(step), loss_scale=scale(step))
        if found is not None:
            return step, found
    return None


def test_a_healthy_fp16_run_never_trips():
    # A dynamic scaler: calibration skips at the start, then one skip per growth interval.
    guard = Guard("warn", GuardLimits.from_thresholds(StabilityThresholds()))
    skipped = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 500, 1000, 1500}
    scales = {}
    scale = 65536.0
    for step in range(1, 2001):
        scale = scale / 2 if step in skipped else scale
        scales[step] = scale
    assert _feed(guard, 2000, loss=lambda s: 1.0 / s, applied=lambda s: s not in skipped,
                 scale=lambda s: scales[s]) is None


def test_persistent_skips_trip_with_their_onset():
    guard = Guard("warn")
    tripped = _feed(guard, 300, applied=lambda s: s < 200, scale=lambda s: 1024.0)
    assert tripped is not None
    step, (signal, onset, _) = tripped
    assert signal == "skip rate" and onset == 200 and step == 200 + GuardLimits().max_skips


def test_a_collapsing_scale_trips_at_the_floor_naming_where_the_fall_began():
    guard = Guard("warn")
    tripped = _feed(guard, 100, applied=lambda s: s < 50, scale=lambda s: 2.0 if s < 50 else 2.0 / 2 ** (s - 49))
    assert tripped is not None
    step, (signal, onset, detail) = tripped
    assert signal == "loss-scale collapse" and step == 51 and onset == 50 and "below the floor 1" in detail


def test_a_non_finite_loss_on_an_applied_step_trips_at_once_and_only_once():
    guard = Guard("warn")
    tripped = _feed(guard, 100, loss=lambda s: math.nan if s >= 70 else 1.0)
    assert tripped is not None and tripped[0] == 70 and tripped[1][:2] == ("non-finite loss", 70)
    assert guard.observe(101, loss=math.nan, applied=True, loss_scale=None) is None  # said once
    guard.rearm()
    assert guard.observe(102, loss=math.nan, applied=True, loss_scale=None) is not None


def test_off_never_trips_and_settings_are_checked():
    assert _feed(Guard("off"), 50, loss=lambda s: math.inf) is None
    assert guard_setting(None, {}) == "off"
    assert guard_setting(None, {"MPADVISE_GUARD": "Fallback"}) == "fallback"
    assert guard_setting("warn", {"MPADVISE_GUARD": "off"}) == "warn"
    with pytest.raises(MpadviseError, match="MPADVISE_GUARD='loud' is not a guard setting"):
        guard_setting(None, {"MPADVISE_GUARD": "loud"})


def test_the_fallback_ladder_goes_to_the_next_safer_mode_this_cpu_runs():
    profile = profile_for("cpu")
    ladder = {mode: guard_fallback(Policy(mode=mode), profile) for mode in
              ("fp16-mixed", "bf16-mixed", "bf16-true", "fp16-true", "fp32", "fp8-torchao")}
    assert ladder["fp16-mixed"].mode == "bf16-mixed"
    assert ladder["bf16-mixed"].mode == "fp32"
    assert ladder["bf16-true"].mode == "bf16-mixed"
    assert ladder["fp16-true"].mode == "fp16-mixed"
    assert ladder["fp8-torchao"].mode == "bf16-mixed"
    assert ladder["fp32"] is None


def test_the_next_load_policy_follows_the_events_as_a_chain():
    resolution = Resolution(Policy(mode="fp16-mixed"), "config file x.toml", PolicySource.BESIDE_SCRIPT)
    events = [
        {"signal": "skip rate", "step": 900, "policy": "bf16-mixed", "fallback": "fp32", "created_at": "2026-01-02"},
        {"signal": "non-finite loss", "step": 300, "policy": "fp16-mixed", "fallback": "bf16-mixed",
         "created_at": "2026-01-01"},
    ]
    heeded = after_guard_events(resolution, events)
    assert heeded.policy.mode == "fp32" and "skip rate" in heeded.source
    assert after_guard_events(resolution, []) is resolution


def test_guard_state_travels_with_the_checkpoint(monkeypatch):
    monkeypatch.delenv("MPADVISE_POLICY", raising=False)
    mp = advisor.load_policy(Policy(mode="fp32"), device="cpu", guard="warn")
    mp.on_guard_event = None  # the cache is the integration tests' (test_guard_late.py)
    net = torch.nn.Linear(4, 1)
    model, optimizer = mp.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    for step in range(3):
        loss = model(torch.randn(8, 4)).pow(2).mean() * (math.inf if step == 2 else 1.0)
        mp.step(loss, optimizer)
    (event,) = mp.guard.events
    assert event.signal == "non-finite loss" and event.step == 3 and event.action == "warned"
    resumed = advisor.load_policy(Policy(mode="fp32"), device="cpu", guard="warn")
    resumed.load_state_dict(mp.state_dict())
    assert resumed.guard.events == [event] and resumed.guard.tripped
    assert GuardEvent.from_dict(event.to_dict()) == event


def test_fallback_from_pure_bf16_upcasts_in_place_and_withholds_the_bad_step(monkeypatch):
    monkeypatch.delenv("MPADVISE_POLICY", raising=False)
    mp = advisor.load_policy(Policy(mode="bf16-true"), device="cpu", guard="fallback")
    mp.on_guard_event = None  # the cache is the integration tests' (test_guard_late.py)
    net = torch.nn.Linear(4, 1)
    model, optimizer = mp.setup(net, torch.optim.Adam(net.parameters(), lr=0.01))
    model(mp.to_device(torch.randn(8, 4))).float().pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    before = model.weight.detach().float().clone()
    loss = model(mp.to_device(torch.randn(8, 4))).float().pow(2).mean() * math.inf
    assert mp.step(loss, optimizer) is False
    assert mp.mode == "bf16-mixed" and model.weight.dtype == torch.float32
    assert torch.equal(model.weight.detach(), before)  # the bad step was not applied
    assert all(v.dtype == torch.float32 for s in optimizer.state.values() for v in s.values() if v.dim() > 0)
    with mp.autocast():
        loss = model(mp.to_device(torch.randn(8, 4))).float().pow(2).mean()
    assert mp.step(loss, optimizer) is True and torch.isfinite(model.weight).all()


def test_the_guard_reads_the_loss_scale_only_on_a_skipped_step(monkeypatch):
    # The scale falls only when the scaler skips a step; an applied step's read would be a
    # second device sync on a GPU, beyond the loss value's.
    monkeypatch.delenv("MPADVISE_POLICY", raising=False)
    mp = advisor.load_policy(Policy(mode="fp16-mixed"), device="cpu", guard="warn")
    mp.on_guard_event = None
    net = torch.nn.Linear(4, 1)
    model, optimizer = mp.setup(net, torch.optim.SGD(net.parameters(), lr=0.01))
    reads = []
    read = mp._mode.loss_scale
    monkeypatch.setattr(mp._mode, "loss_scale", lambda: reads.append(1) or read())
    for step in range(12):
        with mp.autocast():
            loss = model(torch.randn(8, 4)).float().pow(2).mean() * (math.inf if step in (3, 7) else 1.0)
        mp.step(loss, optimizer)
    assert 2 <= mp.skipped_steps < 12 and len(reads) == mp.skipped_steps and mp.guard.events == []


def test_fp8_torchao_falls_back_to_bf16_mixed_in_place_keeping_the_optimizers_parameters(monkeypatch):
    from torchao.float8.float8_linear import Float8Linear

    monkeypatch.delenv("MPADVISE_POLICY", raising=False)
    mp = advisor.load_policy(Policy(mode="fp8-torchao"), device="cpu", guard="fallback")
    mp.on_guard_event = None
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16))
    model, optimizer = mp.setup(net, torch.optim.SGD(net.parameters(), lr=0.01))
    assert any(isinstance(m, Float8Linear) for m in model.modules())
    held = [id(p) for group in optimizer.param_groups for p in group["params"]]
    x, y = torch.randn(32, 64), torch.randn(32, 16)
    for step in range(6):
        with mp.autocast():
            loss = (model(x).float() - y).pow(2).mean() * (math.nan if step == 2 else 1.0)
        mp.step(loss, optimizer)
    (event,) = mp.guard.events
    assert (event.signal, event.policy, event.fallback, event.action) == ("non-finite loss", "fp8-torchao",
                                                                          "bf16-mixed", "fell back")
    assert mp.mode == "bf16-mixed" and not any(isinstance(m, Float8Linear) for m in model.modules())
    assert [id(p) for p in model.parameters()] == held  # the optimizer still trains the model's weights
    before = model[0].weight.detach().clone()
    with mp.autocast():
        loss = (model(x).float() - y).pow(2).mean()
    mp.step(loss, optimizer)
    assert math.isfinite(float(loss)) and not torch.equal(before, model[0].weight)
