"""The Lightning adapter's decisions (what the Trainer and Fabric are given for each policy), its
GradScaler, and the keyword arguments it builds for real Lightning classes (fp8-te through a
fake Transformer Engine recipe module). Trials and runs of real scripts are in
tests/integration/test_framework_lightning.py."""

from __future__ import annotations

import pickle
import sys
import types

import pytest
import torch
from fakes import DelayedScaling, Format

from advisor.frameworks import traits
from advisor.frameworks._lightning import (
    _Application,
    is_sharded,
    lightning_precision,
    shifted_seed,
    transformer_engine_args,
)
from advisor.frameworks._lightning_record import batch_size_of, policy_scaler, take_step_scale
from policies import Fp8Options, LossScale, Policy
from probes import MpadviseError


@pytest.mark.parametrize(
    ("mode", "precision", "plugin", "tf32"),
    [
        ("fp32", "32-true", None, False),
        ("tf32", "32-true", None, True),
        ("bf16-mixed", "bf16-mixed", None, None),
        ("fp16-true", "16-true", None, None),
        ("bf16-true", "bf16-true", None, None),
        # The string would build a default GradScaler, and on a CPU turn fp16 into bf16.
        ("fp16-mixed", "16-mixed", "amp", None),
        # The string would make the weights bf16.
        ("fp8-te", "transformer-engine", "transformer-engine", None),
    ],
)
def test_each_mode_gets_lightnings_setting(mode, precision, plugin, tf32):
    plan = lightning_precision(Policy(mode=mode))
    assert (plan.precision, plan.plugin, plan.tf32) == (precision, plugin, tf32)


def test_every_mode_the_traits_allow_has_a_setting():
    for framework in ("lightning", "fabric"):
        for mode in traits(framework).modes:
            assert lightning_precision(Policy(mode=mode)).precision


def test_fp16_mixed_carries_the_policys_loss_scale():
    scale = LossScale(kind="static", init_scale=1024.0)
    plan = lightning_precision(Policy(mode="fp16-mixed", loss_scale=scale))
    assert plan.loss_scale == scale
    assert "static GradScaler (scale 1024)" in plan.describe()


def test_a_mode_lightning_lacks_is_refused_with_the_modes_it_has():
    with pytest.raises(MpadviseError, match="cannot apply mode fp8-torchao; it can apply fp32, tf32"):
        lightning_precision(Policy(mode="fp8-torchao"))


def test_transformer_engine_plugin_keeps_fp32_weights_and_the_policys_recipe():
    args = transformer_engine_args(Policy(mode="fp8-te"))
    assert args == {
        "weights_dtype": "float32",
        "fallback_compute_dtype": "bfloat16",
        "recipe": {"fp8_format": "HYBRID", "amax_history_len": 1024, "margin": 0},
    }
    options = Fp8Options(recipe="delayed", fp8_format="e4m3", amax_history_len=16, margin=1)
    recipe = transformer_engine_args(Policy(mode="fp8-te", fp8=options))["recipe"]
    # Lightning builds DelayedScaling(**recipe) with fp8_format = Format.<name>.
    assert recipe == {"fp8_format": "E4M3", "amax_history_len": 16, "margin": 1}


def test_transformer_engine_plugin_refuses_a_recipe_it_cannot_build():
    with pytest.raises(MpadviseError, match="delayed recipe only, not 'mxfp8'"):
        transformer_engine_args(Policy(mode="fp8-te", fp8=Fp8Options(recipe="mxfp8")))


@pytest.mark.parametrize(
    ("batch", "size"),
    [
        (torch.zeros(8, 3), 8),
        ((torch.zeros(5, 2), torch.zeros(5)), 5),
        ({"input_ids": torch.zeros(4, 16, dtype=torch.long), "labels": torch.zeros(4)}, 4),
        ([{"x": torch.zeros(6, 1)}], 6),
        ((["a", "b"], torch.zeros(2)), 2),
        (torch.tensor(1.0), None),
        ("text", None),
        (None, None),
    ],
)
def test_batch_size_is_the_leading_dimension_of_the_first_tensor(batch, size):
    assert batch_size_of(batch) == size


def test_the_scripts_seed_moves_by_the_trial_seed():
    assert shifted_seed(42, 0) == 42
    assert shifted_seed(42, 1) == 43
    assert shifted_seed(2**32 - 1, 1) == 0  # stays within Lightning's bounds
    assert shifted_seed(-5, 1) == -5  # out of bounds: Lightning's own error reports it


@pytest.mark.parametrize(
    ("strategy", "sharded"),
    [("auto", False), ("ddp", False), ("fsdp", True), ("deepspeed_stage_2", True), ("DeepSpeedStrategy", True)],
)
def test_sharded_strategies_are_told_apart(strategy, sharded):
    assert is_sharded(strategy) is sharded


def _overflowing_step(scaler, optimizer, param, *, overflow: bool) -> tuple[float | None, bool]:
    optimizer.zero_grad()
    loss = (param * (float("inf") if overflow else 1.0)).sum()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    return scaler.take()


def test_static_scaler_keeps_its_scale_and_still_skips_an_overflowing_step():
    param = torch.nn.Parameter(torch.ones(4))
    optimizer = torch.optim.SGD([param], lr=0.1)
    scaler = policy_scaler("cpu", LossScale(kind="static", init_scale=1024.0))
    assert _overflowing_step(scaler, optimizer, param, overflow=True) == (1024.0, True)
    assert torch.equal(param.detach(), torch.ones(4))  # skipped
    assert scaler.get_scale() == 1024.0  # kept
    assert _overflowing_step(scaler, optimizer, param, overflow=False) == (1024.0, False)
    assert torch.allclose(param.detach(), torch.full((4,), 0.9))


def test_dynamic_scaler_reports_the_scale_its_backward_used_then_backs_off():
    param = torch.nn.Parameter(torch.ones(4))
    optimizer = torch.optim.SGD([param], lr=0.1)
    scaler = policy_scaler("cpu", LossScale(init_scale=256.0, backoff_factor=0.25))
    assert _overflowing_step(scaler, optimizer, param, overflow=True) == (256.0, True)
    assert scaler.get_scale() == 64.0
    assert _overflowing_step(scaler, optimizer, param, overflow=False) == (64.0, False)


def test_scaler_travels_to_a_spawned_process():
    scaler = policy_scaler("cpu", LossScale(kind="static", init_scale=8.0))
    copy = pickle.loads(pickle.dumps(scaler))
    assert type(copy) is type(scaler) and copy.static_scale == 8.0


def test_steps_without_the_policys_scaler_report_no_scale():
    assert take_step_scale(None) == (None, False)
    assert take_step_scale(torch.amp.GradScaler("cpu")) == (None, False)


# ---- the keyword arguments the Trainer and Fabric get (real Lightning, no process) -------------


def test_trainer_gets_the_policys_amp_plugin_in_place_of_the_scripts_precision():
    from lightning.pytorch.plugins.precision import MixedPrecision

    policy = Policy(mode="fp16-mixed", loss_scale=LossScale(kind="static", init_scale=512.0))
    application = _Application(policy, lightning_precision(policy), recorder=None, device="cpu")
    kwargs = application.trainer_kwargs(
        "lightning.pytorch", {"precision": "32-true", "plugins": [MixedPrecision("bf16-mixed", "cpu")], "devices": [0]})
    (plugin,) = kwargs["plugins"]
    # The string "16-mixed" on a CPU would have become bf16-mixed with a default scaler.
    assert isinstance(plugin, MixedPrecision) and (plugin.precision, plugin.device) == ("16-mixed", "cpu")
    assert plugin.scaler.static_scale == 512.0 and plugin.scaler.get_scale() == 512.0
    assert kwargs["precision"] is None  # explicit: PL_TRAINER_PRECISION cannot add one
    assert (kwargs["accelerator"], kwargs["devices"]) == ("cpu", "auto")  # the trial's device


def test_sharded_strategy_cannot_take_the_policys_loss_scale():
    policy = Policy(mode="fp16-mixed", loss_scale=LossScale(kind="static", init_scale=512.0))
    application = _Application(policy, lightning_precision(policy), recorder=None, device=None)
    with pytest.raises(MpadviseError, match="with strategy fsdp builds its own loss scaler"):
        application.fabric_kwargs("lightning.fabric", {"strategy": "fsdp"})
    default = Policy(mode="fp16-mixed")
    kwargs = _Application(default, lightning_precision(default), recorder=None, device=None).fabric_kwargs(
        "lightning.fabric", {"strategy": "fsdp", "precision": "bf16-true"})
    assert kwargs["precision"] == "16-mixed" and kwargs["plugins"] is None


@pytest.fixture
def fake_te_recipe(monkeypatch):
    """A fake ``transformer_engine.common.recipe`` (the piece Lightning's plugin imports to build
    its recipe); Lightning is told the distribution is installed. Returns the fake module."""
    recipe = types.ModuleType("transformer_engine.common.recipe")

    recipe.Format, recipe.DelayedScaling = Format, DelayedScaling
    for name in ("transformer_engine", "transformer_engine.common"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "transformer_engine.common.recipe", recipe)
    from lightning.fabric.plugins.precision import transformer_engine as lightning_te

    # Lightning asks the installed distribution's version, which a fake module has not.
    monkeypatch.setattr(lightning_te, "_TRANSFORMER_ENGINE_AVAILABLE", True)
    return recipe


def test_fp8_te_builds_lightnings_plugin_with_fp32_weights_and_the_policys_recipe(fake_te_recipe):
    policy = Policy(mode="fp8-te", fp8=Fp8Options(fp8_format="e4m3", amax_history_len=16, margin=1))
    application = _Application(policy, lightning_precision(policy), recorder=None, device=None)
    for package in ("lightning.pytorch", "lightning.fabric"):
        kwargs = (application.trainer_kwargs if package == "lightning.pytorch" else application.fabric_kwargs)(
            package, {"precision": "transformer-engine"})
        (plugin,) = kwargs["plugins"]
        assert type(plugin).__module__.startswith(package) and kwargs["precision"] is None
        assert plugin.weights_dtype == torch.float32 and plugin.fallback_compute_dtype == torch.bfloat16
        assert plugin.recipe == fake_te_recipe.DelayedScaling(
            fp8_format=fake_te_recipe.Format.E4M3, amax_history_len=16, margin=1)
